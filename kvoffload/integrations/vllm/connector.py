"""``KVOffloadConnector``: vLLM's ``OffloadingConnector`` plus recovery from failed copies.

vLLM 0.33's offloading connector has no failure path: its worker half asserts that every
transfer succeeded, and its scheduler half marks every finished store readable. With the stock
connector a failed copy therefore stops the engine (loudly, never with wrong KV). This subclass
adds the missing path through vLLM's public connector hooks, with ``KVOffloadSpec`` only:

- worker side: ``KVOffloadWorker`` runs in ``recovering`` mode (failed jobs reach vLLM's
  bookkeeping as finished, without bytes). A failed *load* is reported as failed:
  ``failed_recving`` for a request waiting on an asynchronous load; for a load the step waited on
  (vLLM's sync loads, ``sync_load_budget_bytes`` > 0), which the engine already retried through a
  second copy path (``engine.py``), its blocks as ``invalid_block_ids`` when the model has one
  KV-cache group. vLLM 0.33 cannot take invalid block ids from a model with several groups (its
  scheduler raises); there a sync load that failed twice raises here instead, with the reason (the
  step would otherwise run on KV that was never loaded). Failed job ids of either direction travel
  back in ``KVOffloadWorkerMetadata``.
- ``per_layer_loads`` (with ``sync_load_budget_bytes`` > 0): vLLM's wait for the step's sync loads
  returns at once, and ``wait_for_layer_load`` (called by vLLM's attention before each layer)
  waits for that layer only (``TransferEngine.wait_layer``), so the forward pass overlaps the rest
  of the load. A layer that failed is retried (whole) before its attention runs. vLLM then runs
  PIECEWISE CUDA graphs (``requires_piecewise_for_cudagraph``).
- scheduler side: the chunks of a failed job (named by the keys our manager put into the job's
  host spec, recorded when vLLM builds the step's metadata) are reported to the manager before
  vLLM retires the job: a failed store then completes as failed (never readable, never written to
  a lower tier), a failed load's chunks are dropped from the host once the load is retired.

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

from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig, get_current_vllm_config_or_none, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
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
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.outputs import KVConnectorOutput

from kvoffload.integrations.vllm.manager import HostChunksSpec, KVOffloadTieringManager
from kvoffload.integrations.vllm.options import LAYER_KEY
from kvoffload.integrations.vllm.spec import KVOffloadSpec
from kvoffload.integrations.vllm.worker import KVOffloadWorker


@dataclass
class KVOffloadWorkerMetadata(OffloadingWorkerMetadata):
    failed_jobs: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        failed = self.failed_jobs | getattr(other, "failed_jobs", set())
        return KVOffloadWorkerMetadata(merged.completed_jobs, merged.transfer_stats, failed)


@dataclass(frozen=True)
class _Load:
    req_id: str
    sync: bool


class KVOffloadConnector(OffloadingConnector):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        with _current(vllm_config):  # so that lower tiers see the model's revision
            super().__init__(vllm_config, role, kv_cache_config)
        self._num_groups = len(kv_cache_config.kv_cache_groups)
        self._num_workers = vllm_config.parallel_config.world_size
        self._per_layer = self.requires_piecewise_for_cudagraph(
            vllm_config.kv_transfer_config.kv_connector_extra_config  # type: ignore[union-attr]
        )
        self._layer_of: dict[str, int] = {}  # layer name -> its index in its offloaded group
        self._layer_jobs: list[int] = []  # this step's sync loads, waited for layer by layer
        # worker side
        self._loads: dict[int, _Load] = {}  # load job id -> its request, while in flight
        self._failed_jobs: set[int] = set()
        self._failed_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()
        # scheduler side: job id -> (is a store, its keys), until every worker reported it
        self._job_keys: dict[int, tuple[bool, tuple[OffloadKey, ...]]] = {}
        self._reports: Counter[int] = Counter()
        if self.connector_worker is not None:
            spec = self.connector_worker.spec
            if not isinstance(spec, KVOffloadSpec):
                raise ValueError(_NEEDS_SPEC.format(type(spec).__name__))
            for group in spec.config.groups:
                self._layer_of.update((name, j) for j, name in enumerate(group.layer_names))
        elif not isinstance(self.scheduler.manager, KVOffloadTieringManager):
            raise ValueError(_NEEDS_SPEC.format(type(self.scheduler.manager).__name__))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Per-layer waits run between attention layers: not inside a full CUDA graph."""
        return bool(extra_config.get(LAYER_KEY)) and bool(
            extra_config.get("sync_load_budget_bytes", 0)
        )

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        self._worker().recovering = True

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, OffloadingConnectorMetadata)
        sync = []
        for job_id, job in meta.load_jobs.items():
            load = _Load(job.req_id, bool(getattr(job, "sync", False)))
            self._loads[job_id] = load
            if load.sync:
                sync.append(job_id)
        if self._per_layer and sync:  # submitted now, waited for by each layer's attention
            worker = self._worker()
            worker.defer_waits = True
            try:
                super().start_load_kv(forward_context, **kwargs)
            finally:
                worker.defer_waits = False
            self._layer_jobs = sync
            return
        super().start_load_kv(forward_context, **kwargs)  # waits for (and retries) sync loads
        self._stop_if_failed(sync)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_of.get(layer_name)
        if not self._layer_jobs or layer is None:
            return
        engine = self._worker().engine
        for job_id in self._layer_jobs:
            if not engine.wait_layer(job_id, layer):
                engine.wait([job_id])  # the copy failed: retried once, whole, before this layer
                self._stop_if_failed([job_id])

    def _stop_if_failed(self, sync: list[int]) -> None:
        """On a model with several KV-cache groups a failed sync load cannot be recomputed: stop
        before attention reads it (one group: reported as invalid blocks after the step)."""
        if self._num_groups == 1:
            return
        errors = [e for e in map(self._worker().engine.error, sync) if e is not None]
        if errors:
            raise RuntimeError(_SYNC_FAILED.format(self._num_groups, "; ".join(errors)))

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._layer_jobs:  # every layer has been waited for; let the jobs finish
            jobs, self._layer_jobs = self._layer_jobs, []
            self._worker().engine.wait(jobs)
            self._stop_if_failed(jobs)
        sending, recving = self.get_finished(finished_req_ids)
        self._collect_failures()
        failed = self._failed_recving & set(recving or ())
        self._failed_recving -= failed
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        meta = super().build_connector_worker_meta()
        if not self._failed_jobs:
            return meta
        failed, self._failed_jobs = self._failed_jobs, set()
        if meta is None:
            return KVOffloadWorkerMetadata(failed_jobs=failed)
        return KVOffloadWorkerMetadata(meta.completed_jobs, meta.transfer_stats, failed)

    def _worker(self) -> KVOffloadWorker:
        assert self.connector_worker is not None
        worker = self.connector_worker.worker
        assert isinstance(worker, KVOffloadWorker)
        return worker

    def _collect_failures(self) -> None:
        for done in self._worker().take_done():
            load = self._loads.pop(done.job_id, None)
            if done.ok:
                continue
            self._failed_jobs.add(done.job_id)
            if load is None:  # a store
                continue
            if load.sync:  # one KV-cache group (start_load_kv stopped on several)
                self._invalid_blocks.update(done.blocks.tolist())
            else:
                self._failed_recving.add(load.req_id)

    # -- scheduler side -----------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, OffloadingConnectorMetadata)
        for jobs, is_store in ((meta.load_jobs, False), (meta.store_jobs, True)):
            for job_id, job in jobs.items():
                spec = job.dst_spec if is_store else job.src_spec
                if isinstance(spec, HostChunksSpec):
                    self._job_keys[job_id] = (is_store, spec.keys)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        manager = self.scheduler.manager
        assert isinstance(manager, KVOffloadTieringManager)
        if isinstance(meta, KVOffloadWorkerMetadata) and meta.failed_jobs:
            with _locked(manager):
                for job_id in meta.failed_jobs:
                    is_store, keys = self._job_keys.get(job_id, (False, ()))
                    if is_store:
                        manager.fail_stores(keys)
                    else:
                        manager.fail_loads(keys)
        super().update_connector_output(connector_output)
        if isinstance(meta, OffloadingWorkerMetadata):
            self._reports.update(meta.completed_jobs)
            for job_id in [j for j, n in self._reports.items() if n >= self._num_workers]:
                del self._reports[job_id]
                self._job_keys.pop(job_id, None)

    def reset_cache(self) -> bool | None:
        self._job_keys.clear()
        self._reports.clear()
        done: bool | None = super().reset_cache()
        return done


_NEEDS_SPEC = (
    "expected KVOffloadConnector with spec_name 'KVOffloadSpec' (spec_module_path "
    "'kvoffload.integrations.vllm'), got {}; vLLM's own specs run under vLLM's OffloadingConnector"
)
_SYNC_FAILED = (
    "kvoffload: a sync KV load (sync_load_budget_bytes > 0) failed on its copy and on its retry "
    "through a second copy path; vLLM cannot recompute it on a model with {} KV-cache groups "
    "(invalid_block_ids need one group), and the step would run on KV that was never loaded, so "
    "the engine stops here. Set sync_load_budget_bytes to 0 to make every failed load recoverable. "
    "Errors: {}"
)


def _current(vllm_config: VllmConfig) -> AbstractContextManager[Any]:
    if get_current_vllm_config_or_none() is not None:
        return nullcontext()
    context: AbstractContextManager[Any] = set_current_vllm_config(vllm_config)
    return context


def _locked(manager: Any) -> AbstractContextManager[Any]:
    lock: AbstractContextManager[Any] | None = getattr(manager, "lock", None)  # vLLM 0.33
    return nullcontext() if lock is None else lock
