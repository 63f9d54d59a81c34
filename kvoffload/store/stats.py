"""Counters a store keeps; cheap to update, copied out with ``snapshot``."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StoreStats:
    lookups: int = 0  # lookup calls
    hits: int = 0  # blocks found readable by lookup
    misses: int = 0  # blocks asked for by lookup and not found
    stores: int = 0  # blocks that became readable
    store_failures: int = 0  # blocks whose store was rolled back
    loads: int = 0  # blocks read out successfully
    load_failures: int = 0  # blocks whose load failed
    evictions: int = 0  # blocks evicted under pressure
    bytes_in: int = 0  # bytes written into this tier by successful stores
    bytes_out: int = 0  # bytes read out of this tier by successful loads

    def snapshot(self) -> dict[str, int]:
        return asdict(self)
