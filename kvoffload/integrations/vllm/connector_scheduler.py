"""The scheduler half of ``KVOffloadConnector``: which chunks each job moves, until every worker
reported it, so that a failed job's chunks reach the manager before vLLM retires the job.

vLLM's ``OffloadingConnectorScheduler`` marks every finished store readable. Here the chunks of a
job (the keys our manager put into its host spec) are recorded when vLLM builds the step's
metadata; when a worker reports the job failed (``KVOffloadWorkerMetadata.failed_jobs``) they go
to the manager first: a failed store then completes as failed (never readable, never written to a
lower tier), a failed load's chunks are dropped from the host once the load is retired.
"""

from __future__ import annotations

from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.outputs import KVConnectorOutput

from kvoffload.integrations.vllm.connector_common import NEEDS_SPEC, KVOffloadWorkerMetadata
from kvoffload.integrations.vllm.manager import HostChunksSpec, KVOffloadTieringManager


class KVOffloadConnectorScheduler:
    """Beside vLLM's scheduler half; ``manager`` is its ``OffloadingConnectorScheduler.manager``
    (ValueError unless ours), ``num_workers`` how many workers report each job."""

    def __init__(self, manager: Any, num_workers: int) -> None:
        if not isinstance(manager, KVOffloadTieringManager):
            raise ValueError(NEEDS_SPEC.format(type(manager).__name__))
        self.manager = manager
        self.num_workers = num_workers
        # job id -> (is a store, its keys), until every worker reported it
        self._job_keys: dict[int, tuple[bool, tuple[OffloadKey, ...]]] = {}
        self._reports: Counter[int] = Counter()

    def record_jobs(self, meta: OffloadingConnectorMetadata) -> None:
        """The step's jobs, as vLLM built them: remember the chunks each one moves."""
        for jobs, is_store in ((meta.load_jobs, False), (meta.store_jobs, True)):
            for job_id, job in jobs.items():
                spec = job.dst_spec if is_store else job.src_spec
                if isinstance(spec, HostChunksSpec):
                    self._job_keys[job_id] = (is_store, spec.keys)

    def report_failures(self, output: KVConnectorOutput) -> None:
        """Before vLLM retires the step's jobs: tell the manager which chunks failed."""
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, KVOffloadWorkerMetadata) or not meta.failed_jobs:
            return
        with _locked(self.manager):
            for job_id in meta.failed_jobs:
                is_store, keys = self._job_keys.get(job_id, (False, ()))
                if is_store:
                    self.manager.fail_stores(keys)
                else:
                    self.manager.fail_loads(keys)

    def retire(self, output: KVConnectorOutput) -> None:
        """After vLLM retired them: forget the jobs every worker has reported."""
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, OffloadingWorkerMetadata):
            return
        self._reports.update(meta.completed_jobs)
        for job_id in [j for j, n in self._reports.items() if n >= self.num_workers]:
            del self._reports[job_id]
            self._job_keys.pop(job_id, None)

    def reset(self) -> None:
        self._job_keys.clear()
        self._reports.clear()


def _locked(manager: Any) -> AbstractContextManager[Any]:
    lock: AbstractContextManager[Any] | None = getattr(manager, "lock", None)  # vLLM 0.33
    return nullcontext() if lock is None else lock
