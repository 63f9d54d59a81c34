"""``KVOffloadSpec``: kvoffload as an ``OffloadingSpec`` for vLLM's ``OffloadingConnector``.

vLLM loads it from ``kv_connector_extra_config`` (``spec_name`` + ``spec_module_path``), builds
one per process, and asks the scheduler's for a manager and each worker's for a worker. Both sides
size the host tier the same way, from vLLM's config alone, with vLLM's meaning of
``cpu_bytes_to_use`` (all workers together, as vLLM's ``CPUOffloadingSpec``)::

    slot_bytes  = world_size * worker_kv_bytes_per_block     (one block of every rank)
    chunk_bytes = blocks_per_chunk * slot_bytes
    num_chunks  = cpu_bytes_to_use // chunk_bytes             (at least 1, else ValueError)

The host tier is one shared-memory region (``region.py``): each worker copies its shard in and out
with a kvoffload copy backend, and the scheduler's manager (``manager.py``: vLLM's tiering manager
over our host tier) reads whole chunks out of it for the lower tiers (``secondary.py``), enabled by
flat keys (``disk_path``, ``valkey_url``, ...) and/or vLLM-style ``secondary_tiers`` entries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvoffload.integrations.vllm.manager import (
    KVOffloadManager,
    KVOffloadTieringManager,
    metric_definitions,
)
from kvoffload.integrations.vllm.options import CAPACITY_KEY, parse_options
from kvoffload.integrations.vllm.region import RankArena, SharedRegion
from kvoffload.integrations.vllm.secondary import EVENTS_KEY
from kvoffload.integrations.vllm.tier import HostTier
from kvoffload.integrations.vllm.worker import KVOffloadWorker
from kvoffload.store.arena import HostArena, PinFn
from kvoffload.transfer.backend import BackendFactory

INFO_KEYS = ("kvoffload_host_chunks", "kvoffload_host_bytes", "kvoffload_eviction_policy")


def with_tiers(extra_config: dict[str, Any]) -> dict[str, Any]:
    """``extra_config`` with our flat tier keys as ``secondary_tiers`` entries (first); those
    emit KV events whenever vLLM's are on, as the host tier does."""
    tiers = [{**t, EVENTS_KEY: True} for t in parse_options(extra_config).tiers]
    theirs: list[dict[str, Any]] = extra_config.get("secondary_tiers", [])
    return {**extra_config, "secondary_tiers": [*tiers, *theirs]}


class KVOffloadSpec(OffloadingSpec):
    # Names how a host row's bytes are laid out (region.py), in the lower tiers' fingerprint.
    ROW_LAYOUT = "kvoffload-slot-major-1"
    # A copy backend to use instead of the configured one (set before the worker is built).
    backend_factory: BackendFactory | None = None

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        extra = with_tiers(extra_config)
        defs: dict[str, OffloadingMetricMetadata] = TieringOffloadingSpec.build_metric_definitions(
            extra
        )
        for cpu_only in CPUOffloadingSpec.build_metric_definitions(extra):
            defs.pop(cpu_only, None)  # vLLM's CPU primary tier's; ours reports its own
        defs.update(metric_definitions())
        return defs

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        keys = dict.fromkeys(INFO_KEYS)
        keys["tier"] = None  # vLLM's tiering manager labels each tier's series
        for entry in with_tiers(extra_config)["secondary_tiers"]:
            tier_cls = SecondaryTierFactory.get_tier_class(entry)
            keys.update(dict.fromkeys(tier_cls.config_info_keys(entry)))
        return tuple(keys)

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.options = parse_options(self.extra_config)
        block_bytes = config.worker_kv_bytes_per_block
        world = config.parallel.world_size
        if block_bytes <= 0 or world <= 0:
            raise ValueError(
                f"expected vLLM to report KV bytes per block > 0 and workers > 0 for sizing the "
                f"host tier, got {block_bytes} bytes and {world} workers"
            )
        self.block_bytes = block_bytes
        self.slot_bytes = world * block_bytes
        self.chunk_bytes: int = self.blocks_per_chunk * self.slot_bytes
        self.num_chunks: int = self.options.cpu_bytes_to_use // self.chunk_bytes
        if self.num_chunks < 1:
            raise ValueError(
                f"expected {CAPACITY_KEY} of at least one chunk ({self.chunk_bytes} bytes: "
                f"{self.blocks_per_chunk} block(s) of {block_bytes} bytes on each of {world} "
                f"worker(s)), got {self.options.cpu_bytes_to_use}"
            )
        self.tier_configs: list[dict[str, Any]] = with_tiers(dict(self.extra_config))[
            "secondary_tiers"
        ]
        self._manager: KVOffloadTieringManager | None = None
        self._worker: KVOffloadWorker | None = None

    @property
    def mappers(self) -> int:
        """Processes that map the host region: the scheduler (role 0) and every worker (role
        rank + 1) (region.py)."""
        workers: int = self.config.parallel.world_size
        return workers + 1

    @property
    def region_bytes(self) -> int:
        return self.num_chunks * self.chunk_bytes

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            region = SharedRegion(
                self.config.engine_id, self.region_bytes, mappers=self.mappers, role=0
            )
            rows = region.rows(self.num_chunks)
            tier = HostTier(
                self.num_chunks,
                self.chunk_bytes,
                self.options.config.eviction_policy,
                events=self.kv_events_config.enable_kv_cache_events,
                window=self.options.config.eviction_window,
            )
            host = KVOffloadManager(tier, rows, region, self._info())
            tiers: list[SecondaryTierManager] = []
            try:
                for entry in self.tier_configs:
                    tiers.append(
                        SecondaryTierFactory.create_secondary_tier(dict(entry), rows.data, self)
                    )
                self._manager = KVOffloadTieringManager(host, tiers)
            except BaseException:
                for built in tiers:
                    built.shutdown()
                region.close()
                raise
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            region = SharedRegion(
                self.config.engine_id,
                self.region_bytes,
                mappers=self.mappers,
                role=1 + self.config.parallel.rank,  # 0 is the scheduler's (shm.py)
            )
            try:
                self._worker = KVOffloadWorker(
                    kv_caches,
                    num_chunks=self.num_chunks,
                    blocks_per_chunk=self.blocks_per_chunk,
                    max_slot_bytes=self.block_bytes,
                    block_size=self.tokens_per_block[0],
                    config=self.options.config,
                    backend_factory=self.backend_factory,
                    arena=self._rank_arena(region),
                )
            except BaseException:
                region.close()
                raise
        return self._worker

    def _rank_arena(self, region: SharedRegion) -> Callable[[PinFn | None], HostArena]:
        rank = self.config.parallel.rank
        num_slots = self.num_chunks * self.blocks_per_chunk

        def arena(pin: PinFn | None) -> HostArena:
            return RankArena(
                region, num_slots, self.block_bytes, self.slot_bytes, rank * self.block_bytes, pin
            )

        return arena

    def _info(self) -> dict[str, Any]:
        return {
            "kvoffload_host_chunks": self.num_chunks,
            "kvoffload_host_bytes": self.region_bytes,
            "kvoffload_eviction_policy": self.options.config.eviction_policy,
        }
