"""``KVOffloadConnector``: vLLM 0.33's ``OffloadingConnector`` plus recovery from failed copies.

vLLM 0.33's offloading connector has no failure path: its worker half asserts that every
transfer succeeded, and its scheduler half marks every finished store readable. With the stock
connector a failed copy therefore stops the engine (loudly, never with wrong KV). This subclass
adds the missing path, and changes nothing else:

- worker side: a failed *load* is reported as failed (``failed_recving`` for a request waiting
  on an asynchronous load, ``get_block_ids_with_load_errors`` for a load the step waited on), so
  vLLM's scheduler recomputes those tokens (``kv_load_failure_policy="recompute"``; vLLM's
  default ``"fail"`` fails the request instead). Failed job ids of either direction travel back in
  ``KVOffloadWorkerMetadata``.
- scheduler side: once vLLM has retired a failed job, its chunks are dropped from the host tier,
  so a failed store never becomes a hit and a chunk that failed to load is not offered again.

It reads one internal of vLLM 0.33's scheduler half, ``OffloadingConnectorScheduler._jobs``
(job id -> keys), which is why the supported vLLM range is pinned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.outputs import KVConnectorOutput

from kvoffload.integrations.vllm.engine import JobDone
from kvoffload.integrations.vllm.manager import KVOffloadManager
from kvoffload.integrations.vllm.worker import KVOffloadWorker


@dataclass
class KVOffloadWorkerMetadata(OffloadingWorkerMetadata):
    failed_jobs: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        failed = self.failed_jobs | getattr(other, "failed_jobs", set())
        return KVOffloadWorkerMetadata(merged.completed_jobs, merged.transfer_stats, failed)


class _RecoveringWorker(OffloadingConnectorWorker):
    """``OffloadingConnectorWorker`` whose ``get_finished`` accepts failed transfers."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.failed_jobs: set[int] = set()
        self.failed_recving: set[str] = set()
        self.invalid_blocks: set[int] = set()
        self._failed_load_blocks: dict[int, list[int]] = {}

    def _init_worker(self, kv_caches: Any) -> None:
        super()._init_worker(kv_caches)
        if isinstance(self.worker, KVOffloadWorker):
            self.worker.on_finished = self._note

    def _note(self, done: JobDone) -> None:
        if not done.ok and done.direction == "load":
            self._failed_load_blocks[done.job_id] = done.blocks.tolist()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        assert self.worker is not None
        finished_recving: set[str] = set()
        for result in self.worker.get_finished():
            job_id = result.job_id
            is_load = job_id in self._load_jobs
            if result.success and result.transfer_size is not None:
                stats = self._connector_worker_meta.transfer_stats
                side = stats.load if is_load else stats.store
                side.record(result.transfer_size, result.transfer_time or 0.0)
            self._connector_worker_meta.mark_completed(job_id)
            req_id = self._load_jobs.pop(job_id, None)
            failed_blocks = self._failed_load_blocks.pop(job_id, None)
            if not result.success:
                self.failed_jobs.add(job_id)
            if req_id is not None:
                finished_recving.add(req_id)
                if not result.success:
                    self.failed_recving.add(req_id)
            elif failed_blocks is not None:  # a load this step waited on (sync)
                self.invalid_blocks.update(failed_blocks)
        return set(), finished_recving

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        meta = super().build_connector_worker_meta()
        if meta is None:
            return None
        failed, self.failed_jobs = self.failed_jobs, set()
        return KVOffloadWorkerMetadata(meta.completed_jobs, meta.transfer_stats, failed)


class KVOffloadConnector(OffloadingConnector):
    connector_worker: OffloadingConnectorWorker | None

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        stock: Any = self.connector_worker
        if stock is not None:
            self.connector_worker = _RecoveringWorker(stock.spec, vllm_config, kv_cache_config)
        self._failed_keys: dict[int, list[OffloadKey]] = {}  # failed job id -> its chunks

    # -- worker side --------------------------------------------------------------------------

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker = self._recovering_worker()
        sending, recving = worker.get_finished(finished_req_ids)
        failed = worker.failed_recving & recving
        worker.failed_recving -= failed
        return KVConnectorTransferResults(sending, recving, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._recovering_worker()
        invalid, worker.invalid_blocks = worker.invalid_blocks, set()
        return invalid

    def _recovering_worker(self) -> _RecoveringWorker:
        assert isinstance(self.connector_worker, _RecoveringWorker)
        return self.connector_worker

    # -- scheduler side -----------------------------------------------------------------------

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        jobs = self.scheduler._jobs  # vLLM 0.33: job id -> TransferJobStatus (keys)
        if isinstance(meta, KVOffloadWorkerMetadata):
            for job_id in meta.failed_jobs:
                if job_id in jobs:
                    self._failed_keys[job_id] = list(jobs[job_id].keys)
        super().update_connector_output(connector_output)
        retired = [job_id for job_id in self._failed_keys if job_id not in jobs]
        manager = self.scheduler.manager
        for job_id in retired:
            keys = self._failed_keys.pop(job_id)
            if isinstance(manager, KVOffloadManager):
                manager.drop(keys)
