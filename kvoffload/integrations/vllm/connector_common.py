"""What both halves of ``KVOffloadConnector`` share (as vLLM's ``offloading/common.py``): the
worker-to-scheduler metadata that carries failed job ids, and the error for a foreign spec."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)


@dataclass
class KVOffloadWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker metadata plus the ids of jobs that failed on this worker this step."""

    failed_jobs: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        failed = self.failed_jobs | getattr(other, "failed_jobs", set())
        return KVOffloadWorkerMetadata(merged.completed_jobs, merged.transfer_stats, failed)


NEEDS_SPEC = (
    "expected KVOffloadConnector with spec_name 'KVOffloadSpec' (spec_module_path "
    "'kvoffload.integrations.vllm'), got {}; vLLM's own specs run under vLLM's OffloadingConnector"
)
