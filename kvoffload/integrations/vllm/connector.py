"""``KVOffloadConnector``: vLLM's ``OffloadingConnector`` plus recovery from failed copies.

vLLM 0.33's offloading connector has no failure path: its worker half asserts that every
transfer succeeded, and its scheduler half marks every finished store readable. With the stock
connector a failed copy therefore stops the engine (loudly, never with wrong KV). This subclass
adds the missing path through vLLM's public connector hooks, with ``KVOffloadSpec`` only, split by
role as vLLM splits its own connector: this class is a facade that keeps vLLM's two halves and
adds one of ours beside the one its role has.

- worker side (``connector_worker.py``, ``KVOffloadConnectorWorker``): failed loads reported as
  failed (``failed_recving``, or ``invalid_block_ids`` for a sync load), failed job ids sent to the
  scheduler in ``KVOffloadWorkerMetadata``, and ``per_layer_loads``: each layer's attention waits
  for that layer only (vLLM then runs PIECEWISE CUDA graphs, ``requires_piecewise_for_cudagraph``).
- scheduler side (``connector_scheduler.py``, ``KVOffloadConnectorScheduler``): the chunks of a
  failed job reach the manager before vLLM retires the job (a failed store never becomes readable).

vLLM attributes read (no underscore, but not a declared interface; the reason the supported vLLM
range is pinned): ``OffloadingConnector.connector_scheduler/connector_worker``,
``OffloadingConnectorScheduler.manager``, ``OffloadingConnectorWorker.spec/worker``, and the
step's ``OffloadingConnectorMetadata`` (``load_jobs``/``store_jobs``: ``req_id``, ``sync``, the
specs). ``docs/vllm.md`` lists every vLLM internal the adapter touches.

``kvoffload.integrations.vllm.OffloadingConnector`` is this class too: vLLM's
``--kv-offloading-size`` renames the configured connector to ``OffloadingConnector`` and keeps
``kv_connector_module_path``, so that flag and ``KVOffloadConnector`` combine.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from vllm.config import VllmConfig, get_current_vllm_config_or_none, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput

from kvoffload.integrations.vllm.connector_scheduler import KVOffloadConnectorScheduler
from kvoffload.integrations.vllm.connector_worker import KVOffloadConnectorWorker
from kvoffload.integrations.vllm.options import LAYER_KEY


class KVOffloadConnector(OffloadingConnector):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        with _current(vllm_config):  # so that lower tiers see the model's revision
            super().__init__(vllm_config, role, kv_cache_config)
        self.kv_worker: KVOffloadConnectorWorker | None = None
        self.kv_scheduler: KVOffloadConnectorScheduler | None = None
        if self.connector_worker is not None:
            per_layer = self.requires_piecewise_for_cudagraph(
                vllm_config.kv_transfer_config.kv_connector_extra_config  # type: ignore[union-attr]
            )
            groups = len(kv_cache_config.kv_cache_groups)
            self.kv_worker = KVOffloadConnectorWorker(self.connector_worker, groups, per_layer)
        else:
            workers = vllm_config.parallel_config.world_size
            self.kv_scheduler = KVOffloadConnectorScheduler(self.scheduler.manager, workers)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Per-layer waits run between attention layers: not inside a full CUDA graph."""
        return bool(extra_config.get(LAYER_KEY)) and bool(
            extra_config.get("sync_load_budget_bytes", 0)
        )

    # -- worker side: KVOffloadConnectorWorker ------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        self._worker_half().registered()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadingConnectorMetadata)
        with self._worker_half().starting_loads(meta):
            super().start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.kv_worker is not None:
            self.kv_worker.wait_for_layer_load(layer_name)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        half = self._worker_half()
        half.finish_layer_loads()
        sending, recving = self.get_finished(finished_req_ids)
        return half.transfer_results(sending, recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self.kv_worker is None else self.kv_worker.take_invalid_blocks()

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        meta = super().build_connector_worker_meta()
        return meta if self.kv_worker is None else self.kv_worker.worker_meta(meta)

    def _worker_half(self) -> KVOffloadConnectorWorker:
        assert self.kv_worker is not None, "a worker-side call on the scheduler's connector"
        return self.kv_worker

    # -- scheduler side: KVOffloadConnectorScheduler ------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, OffloadingConnectorMetadata)
        self._scheduler_half().record_jobs(meta)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        half = self._scheduler_half()
        half.report_failures(connector_output)
        super().update_connector_output(connector_output)
        half.retire(connector_output)

    def reset_cache(self) -> bool | None:
        self._scheduler_half().reset()
        done: bool | None = super().reset_cache()
        return done

    def _scheduler_half(self) -> KVOffloadConnectorScheduler:
        assert self.kv_scheduler is not None, "a scheduler-side call on a worker's connector"
        return self.kv_scheduler


def _current(vllm_config: VllmConfig) -> AbstractContextManager[Any]:
    if get_current_vllm_config_or_none() is not None:
        return nullcontext()
    context: AbstractContextManager[Any] = set_current_vllm_config(vllm_config)
    return context
