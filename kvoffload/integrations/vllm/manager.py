"""``KVOffloadManager``: vLLM's ``OffloadingManager`` on a kvoffload ``HostTier`` (scheduler side).

Every call maps one to one onto ``HostTier`` (see ``tier.py`` for the rules); this file only
converts to and from vLLM's types, and reports our counters through vLLM's connector stats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
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
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.integrations.vllm.tier import HIT, MISS, HostTier

# vLLM 0.33 added OffloadingEvent.metadata_only (a failed store released its slots).
_HAS_METADATA_ONLY = "metadata_only" in {f.name for f in dataclasses.fields(OffloadingEvent)}
USAGE = "kvoffload:host_usage_perc"
# Our cumulative counters, reported to vLLM as increments: metric name -> StoreStats field.
COUNTERS = {
    "kvoffload:lookup_hits": "hits",
    "kvoffload:lookup_misses": "misses",
    "kvoffload:stored_chunks": "stores",
    "kvoffload:store_failed_chunks": "store_failures",
    "kvoffload:loaded_chunks": "loads",
    "kvoffload:load_failed_chunks": "load_failures",
    "kvoffload:evicted_chunks": "evictions",
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    defs: dict[str, OffloadingMetricMetadata] = {
        USAGE: OffloadingGaugeMetadata("Fraction of kvoffload host chunks in use (0.0 to 1.0).")
    }
    for name, field in COUNTERS.items():
        defs[name] = OffloadingCounterMetadata(f"kvoffload host tier: {field} (chunks).")
    return defs


class HostChunksSpec(BlockIDsLoadStoreSpec):
    """Host chunk ids in a kvoffload host tier, one per offload key, in key order."""


class KVOffloadManager(OffloadingManager):
    def __init__(self, tier: HostTier) -> None:
        self.tier = tier
        self._reported = dict.fromkeys(COUNTERS.values(), 0)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self.tier.lookup(key)
        if found == HIT:
            return LookupResult.HIT
        return LookupResult.MISS if found == MISS else LookupResult.HIT_PENDING

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> HostChunksSpec:
        return HostChunksSpec(self.tier.prepare_load(list(keys)).tolist())

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.tier.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.tier.complete_load(keys)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        plan = self.tier.prepare_store(list(keys))
        if plan is None:
            return None
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in plan.keys],
            store_spec=HostChunksSpec(plan.slots.tolist()),
            evicted_keys=[OffloadKey(k) for k in plan.evicted],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.tier.complete_store(keys, success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drop(self, keys: Collection[OffloadKey]) -> None:
        """Forget chunks whose copy failed (used by ``KVOffloadConnector``)."""
        self.tier.drop(keys)

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

    def get_stats(self) -> OffloadingConnectorStats:
        stats = OffloadingConnectorStats()
        stats.set_gauge(USAGE, self.tier.usage())
        now: dict[str, Any] = self.tier.stats.snapshot()
        for name, field in COUNTERS.items():
            delta = now[field] - self._reported[field]
            if delta:
                stats.increase_counter(name, delta)
                self._reported[field] = now[field]
        return stats
