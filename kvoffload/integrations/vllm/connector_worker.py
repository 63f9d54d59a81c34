"""The worker half of ``KVOffloadConnector``: loads in flight, failed jobs, per-layer waits.

vLLM's ``OffloadingConnectorWorker`` asserts that every transfer succeeded. Beside it, this
class runs our ``KVOffloadWorker`` in ``recovering`` mode (failed jobs reach vLLM's bookkeeping
as finished, without bytes) and reports what failed:

- a failed *load* as failed: ``failed_recving`` for a request waiting on an asynchronous load;
  for a load the step waited on (vLLM's sync loads, ``sync_load_budget_bytes`` > 0), which the
  engine already retried through a second copy path (``engine.py``), its blocks as
  ``invalid_block_ids`` when the model has one KV-cache group. vLLM 0.33 cannot take invalid block
  ids from a model with several groups (its scheduler raises); there a sync load that failed twice
  raises here instead, with the reason (the step would otherwise run on KV that was never loaded);
- failed job ids of either direction in ``KVOffloadWorkerMetadata``, for the scheduler half.

With ``per_layer_loads`` (and ``sync_load_budget_bytes`` > 0) vLLM's wait for the step's sync
loads returns at once, and ``wait_for_layer_load`` (called by vLLM's attention before each layer)
waits for that layer only (``TransferEngine.wait_layer``), so the forward pass overlaps the rest of
the load. A layer that failed is retried (whole) before its attention runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)

from kvoffload.integrations.vllm.connector_common import NEEDS_SPEC, KVOffloadWorkerMetadata
from kvoffload.integrations.vllm.spec import KVOffloadSpec
from kvoffload.integrations.vllm.worker import KVOffloadWorker

SYNC_FAILED = (
    "kvoffload: a sync KV load (sync_load_budget_bytes > 0) failed on its copy and on its retry "
    "through a second copy path; vLLM cannot recompute it on a model with {} KV-cache groups "
    "(invalid_block_ids need one group), and the step would run on KV that was never loaded, so "
    "the engine stops here. Set sync_load_budget_bytes to 0 to make every failed load recoverable. "
    "Errors: {}"
)


@dataclass(frozen=True)
class _Load:
    req_id: str
    sync: bool


class KVOffloadConnectorWorker:
    """Beside vLLM's worker half ``vllm_worker`` (ValueError unless its spec is ours);
    ``num_groups``: the model's KV-cache groups; ``per_layer``: sync loads are waited for layer
    by layer."""

    def __init__(
        self, vllm_worker: OffloadingConnectorWorker, num_groups: int, per_layer: bool
    ) -> None:
        spec = vllm_worker.spec
        if not isinstance(spec, KVOffloadSpec):
            raise ValueError(NEEDS_SPEC.format(type(spec).__name__))
        self._vllm_worker = vllm_worker
        self.num_groups = num_groups
        self.per_layer = per_layer
        self._layer_of: dict[str, int] = {}  # layer name -> its index in its offloaded group
        for group in spec.config.groups:
            self._layer_of.update((name, j) for j, name in enumerate(group.layer_names))
        self._layer_jobs: list[int] = []  # this step's sync loads, waited for layer by layer
        self._loads: dict[int, _Load] = {}  # load job id -> its request, while in flight
        self._failed_jobs: set[int] = set()
        self._failed_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()

    @property
    def worker(self) -> KVOffloadWorker:
        worker = self._vllm_worker.worker
        assert isinstance(worker, KVOffloadWorker)
        return worker

    def registered(self) -> None:
        """vLLM's half has registered the KV caches (and built our worker)."""
        self.worker.recovering = True

    @contextmanager
    def starting_loads(self, meta: OffloadingConnectorMetadata) -> Iterator[None]:
        """Around vLLM's ``start_load_kv``: records the step's loads; with ``per_layer``, its
        sync loads are left for ``wait_for_layer_load``, else a failed one stops the step here."""
        sync = []
        for job_id, job in meta.load_jobs.items():
            load = _Load(job.req_id, bool(getattr(job, "sync", False)))
            self._loads[job_id] = load
            if load.sync:
                sync.append(job_id)
        if self.per_layer and sync:  # submitted now, waited for by each layer's attention
            self.worker.defer_waits = True
            try:
                yield
            finally:
                self.worker.defer_waits = False
            self._layer_jobs = sync
            return
        yield  # vLLM waits for (and our engine retries) the sync loads
        self._stop_if_failed(sync)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_of.get(layer_name)
        if not self._layer_jobs or layer is None:
            return
        engine = self.worker.engine
        for job_id in self._layer_jobs:
            if not engine.wait_layer(job_id, layer):
                engine.wait([job_id])  # the copy failed: retried once, whole, before this layer
                self._stop_if_failed([job_id])

    def finish_layer_loads(self) -> None:
        """Every layer has been waited for; let the step's sync loads finish."""
        if self._layer_jobs:
            jobs, self._layer_jobs = self._layer_jobs, []
            self.worker.engine.wait(jobs)
            self._stop_if_failed(jobs)

    def transfer_results(
        self, sending: set[str] | None, recving: set[str] | None
    ) -> KVConnectorTransferResults:
        """vLLM's finished requests (``get_finished``) plus the loads that failed among them."""
        self._collect_failures()
        failed = self._failed_recving & set(recving or ())
        self._failed_recving -= failed
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), failed)

    def take_invalid_blocks(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def worker_meta(self, meta: OffloadingWorkerMetadata | None) -> OffloadingWorkerMetadata | None:
        """vLLM's worker metadata for this step, with the jobs that failed since the last one."""
        if not self._failed_jobs:
            return meta
        failed, self._failed_jobs = self._failed_jobs, set()
        if meta is None:
            return KVOffloadWorkerMetadata(failed_jobs=failed)
        return KVOffloadWorkerMetadata(meta.completed_jobs, meta.transfer_stats, failed)

    def _stop_if_failed(self, sync: list[int]) -> None:
        """On a model with several KV-cache groups a failed sync load cannot be recomputed: stop
        before attention reads it (one group: reported as invalid blocks after the step)."""
        if self.num_groups == 1:
            return
        errors = [e for e in map(self.worker.engine.error, sync) if e is not None]
        if errors:
            raise RuntimeError(SYNC_FAILED.format(self.num_groups, "; ".join(errors)))

    def _collect_failures(self) -> None:
        for done in self.worker.take_done():
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
