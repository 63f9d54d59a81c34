"""``KVOffloadSpec``: kvoffload as an ``OffloadingSpec`` for vLLM 0.33's ``OffloadingConnector``.

vLLM loads it from ``kv_connector_extra_config`` (``spec_name`` + ``spec_module_path``), builds
one per process, and asks the scheduler's for a manager and each worker's for a worker. Both sides
size the host tier the same way, from vLLM's config alone::

    chunk_bytes = blocks_per_chunk * worker_kv_bytes_per_block
    num_chunks  = cpu_bytes_to_use // chunk_bytes        (at least 1, else ValueError)

Each worker then allocates ``num_chunks`` chunks of its own blocks (one slot per block and group:
its layers' unpadded pages), so ``cpu_bytes_to_use`` bounds every worker's host RAM. With tensor
parallelism every worker keeps its own shard under the same chunk id.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvoffload.integrations.vllm.manager import KVOffloadManager, metric_definitions
from kvoffload.integrations.vllm.options import CAPACITY_KEY, parse_options
from kvoffload.integrations.vllm.tier import HostTier
from kvoffload.integrations.vllm.worker import KVOffloadWorker
from kvoffload.transfer.backend import BackendFactory


class KVOffloadSpec(OffloadingSpec):
    # A copy backend to use instead of the configured one (set before the worker is built).
    backend_factory: BackendFactory | None = None

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.options = parse_options(self.extra_config)
        block_bytes = config.worker_kv_bytes_per_block
        if block_bytes <= 0:
            raise ValueError(
                f"expected vLLM to report KV bytes per block > 0 for sizing the host tier, "
                f"got {block_bytes}"
            )
        self.chunk_bytes = self.blocks_per_chunk * block_bytes
        self.num_chunks = self.options.cpu_bytes_to_use // self.chunk_bytes
        if self.num_chunks < 1:
            raise ValueError(
                f"expected {CAPACITY_KEY} of at least one chunk ({self.chunk_bytes} bytes: "
                f"{self.blocks_per_chunk} block(s) of {block_bytes} bytes), got "
                f"{self.options.cpu_bytes_to_use}"
            )
        self._manager: KVOffloadManager | None = None
        self._worker: KVOffloadWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            tier = HostTier(
                self.num_chunks,
                self.chunk_bytes,
                self.options.config.eviction_policy,
                events=self.kv_events_config.enable_kv_cache_events,
            )
            self._manager = KVOffloadManager(tier)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KVOffloadWorker(
                kv_caches,
                num_chunks=self.num_chunks,
                blocks_per_chunk=self.blocks_per_chunk,
                max_slot_bytes=self.config.worker_kv_bytes_per_block,
                block_size=self.tokens_per_block[0],
                config=self.options.config,
                backend_factory=self.backend_factory,
            )
        return self._worker
