"""The scheduler side: our host tier as the primary tier of vLLM's own tiering manager.

``KVOffloadSpec.get_manager`` returns ``KVOffloadTieringManager``: vLLM's
``TieringOffloadingManager`` (cascade of every stored chunk to the secondary tiers, promotion on
a lookup that misses the host, async lookups, backpressure, its ``vllm:kv_offload_tiering_*``
metrics) over ``KVOffloadManager``, our host tier (``HostTier``: kvoffload's ``BlockIndex`` and
eviction policy) in the place of vLLM's CPU primary tier. Without secondary tiers it is the same
manager with none.

``KVOffloadManager`` maps every ``OffloadingManager`` call one to one onto ``HostTier`` (see
``tier.py`` for the rules), plus the calls vLLM's tiering manager makes on its primary tier
(``prepare_read``/``complete_read`` around a cascade, ``prepare_write``/``complete_write`` around a
promotion, ``get_kv_memoryview``, ``_num_chunks``): an interface vLLM 0.32/0.33 use but do not
declare as an ABC, one reason the supported vLLM range is pinned.

The failure path of ``KVOffloadConnector`` lives here too: a chunk whose copy failed is reported
(``fail_stores`` / ``fail_loads``) before vLLM retires its job. A failed store then completes as
failed (rolled back, never readable, never cascaded to a lower tier); a failed load's chunks are
dropped from the host once the load is retired, so they are not offered again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.integrations.vllm.region import SharedRegion
from kvoffload.integrations.vllm.tier import HIT, MISS, HostTier

# vLLM 0.33 added OffloadingEvent.metadata_only (a failed store released its slots).
_HAS_METADATA_ONLY = "metadata_only" in {f.name for f in dataclasses.fields(OffloadingEvent)}
USAGE = "vllm:kvoffload_host_usage_perc"
# Our cumulative counters, reported to vLLM as increments: metric name -> StoreStats field. The
# "vllm:" prefix is what vLLM's LLM.get_metrics() keeps; host hits and queries are in vLLM's
# vllm:kv_offload_tiering_chunk_{hits,queries}{tier="0:primary"}.
COUNTERS = {
    "vllm:kvoffload_host_stored_chunks": "stores",
    "vllm:kvoffload_host_store_failed_chunks": "store_failures",
    "vllm:kvoffload_host_loaded_chunks": "loads",
    "vllm:kvoffload_host_load_failed_chunks": "load_failures",
    "vllm:kvoffload_host_evicted_chunks": "evictions",
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    defs: dict[str, OffloadingMetricMetadata] = {
        USAGE: OffloadingGaugeMetadata("Fraction of kvoffload host chunks in use (0.0 to 1.0).")
    }
    for name, field in COUNTERS.items():
        defs[name] = OffloadingCounterMetadata(f"kvoffload host tier: {field} (chunks).")
    return defs


class HostChunksSpec(CPULoadStoreSpec):
    """Host chunk ids in a kvoffload host tier, one per offload key, in key order.

    ``keys`` (the scheduler's, for ``KVOffloadConnector`` to name a failed job's chunks) are not
    sent to the workers."""

    def __init__(self, chunk_ids: Sequence[int], keys: Sequence[OffloadKey] = ()) -> None:
        super().__init__(list(chunk_ids))
        self.keys = tuple(keys)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "keys": ()}


class KVOffloadManager(OffloadingManager):
    """Our host tier, as vLLM's tiering manager's primary tier (``rows``: its chunks' bytes)."""

    def __init__(
        self,
        tier: HostTier,
        rows: np.ndarray,
        region: SharedRegion | None = None,
        info: dict[str, Any] | None = None,
    ) -> None:
        if rows.shape[0] != tier.num_chunks:
            raise ValueError(
                f"expected one row per host chunk ({tier.num_chunks}), got {rows.shape[0]}"
            )
        self.tier = tier
        self._num_chunks = tier.num_chunks  # read by vLLM's tiering manager
        self._rows = rows
        self._region = region
        self._info = info or {}
        self._reported = dict.fromkeys(COUNTERS.values(), 0)
        self._counters_sent = False  # the first get_stats sends every counter, zeros included
        self._failed_loads: set[OffloadKey] = set()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self.tier.lookup(key)
        if found == HIT:
            return LookupResult.HIT
        return LookupResult.MISS if found == MISS else LookupResult.HIT_PENDING

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> HostChunksSpec:
        keys = list(keys)
        return HostChunksSpec(self.tier.prepare_load(keys).tolist(), keys)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.tier.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        failed = self._failed_loads.intersection(keys)
        if not failed:
            self.tier.complete_load(keys)
            return
        self._failed_loads -= failed
        self.tier.complete_load(keys, success=False)
        self.tier.drop(failed)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        plan = self.tier.prepare_store(list(keys))
        if plan is None:
            return None
        stored = [OffloadKey(k) for k in plan.keys]
        return PrepareStoreOutput(
            keys_to_store=stored,
            store_spec=HostChunksSpec(plan.slots.tolist(), stored),
            evicted_keys=[OffloadKey(k) for k in plan.evicted],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.tier.complete_store(keys, success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def fail_loads(self, keys: Iterable[OffloadKey]) -> None:
        """These chunks failed to load: count it and drop them when their load completes."""
        self._failed_loads.update(keys)

    # -- what vLLM's tiering manager asks of its primary tier ---------------------------------

    def prepare_read(self, keys: Collection[OffloadKey], req_context: ReqContext) -> HostChunksSpec:
        keys = list(keys)
        return HostChunksSpec(self.tier.pin(keys).tolist(), keys)

    def complete_read(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.tier.unpin(keys)

    def prepare_write(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        return self.prepare_store(keys, req_context)

    def complete_write(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.complete_store(keys, req_context, success)

    def get_kv_memoryview(self) -> memoryview:
        return self._rows.data

    # -- events, reset, metrics ---------------------------------------------------------------

    def take_events(self) -> Iterable[OffloadingEvent]:
        for event in self.tier.take_events():
            keys = [OffloadKey(k) for k in event.keys]
            if not _HAS_METADATA_ONLY:  # vLLM 0.32: a failed store is announced as removed
                yield OffloadingEvent(keys=keys, medium=Medium.CPU, removed=event.removed)
                continue
            yield OffloadingEvent(
                keys=keys,
                medium=Medium.CPU,
                removed=event.removed,
                metadata_only=event.metadata_only,
            )

    def reset_cache(self) -> None:
        self.tier.reset()
        self._failed_loads.clear()

    def get_stats(self) -> OffloadingConnectorStats:
        stats = OffloadingConnectorStats()
        stats.set_gauge(USAGE, self.tier.usage())
        now: dict[str, Any] = self.tier.stats.snapshot()
        for name, field in COUNTERS.items():
            delta = now[field] - self._reported[field]
            if delta or not self._counters_sent:  # a series at 0 from the start (Prometheus)
                stats.increase_counter(name, delta)
                self._reported[field] = now[field]
        self._counters_sent = True
        return stats

    def config_info(self) -> list[dict[str, str | int | float | bool]]:
        return [dict(self._info)]

    def shutdown(self) -> None:
        if self._region is not None:
            self._region.close()
            self._region = None


class KVOffloadTieringManager(TieringOffloadingManager):
    """vLLM's tiering manager over ``KVOffloadManager``, plus the failure path (module doc)."""

    def __init__(self, host: KVOffloadManager, secondary_tiers: list[SecondaryTierManager]):
        super().__init__(host, secondary_tiers)
        self.host = host
        self._failed_stores: set[OffloadKey] = set()

    def fail_stores(self, keys: Iterable[OffloadKey]) -> None:
        """These chunks' copy into host failed: their store completes as failed."""
        self._failed_stores.update(keys)

    def fail_loads(self, keys: Iterable[OffloadKey]) -> None:
        self.host.fail_loads(keys)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        failed = self._failed_stores.intersection(keys)
        if failed:
            self._failed_stores -= failed
            success = False  # rolled back by the host tier, and never cascaded
        super().complete_store(keys, req_context, success)

    def reset_cache(self) -> None:
        super().reset_cache()
        self._failed_stores.clear()
