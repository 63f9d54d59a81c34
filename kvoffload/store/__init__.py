"""Torch-free bookkeeping: keys, the host arena, the block index and eviction policies."""

from kvoffload.store.arena import HostArena, slots_for_capacity
from kvoffload.store.index import FREE, READABLE, WRITING, BlockIndex, StorePlan
from kvoffload.store.keys import BlockKey, as_block_key, as_block_keys, prefix_block_keys
from kvoffload.store.policies import POLICIES
from kvoffload.store.stats import StoreStats

__all__ = [
    "FREE",
    "POLICIES",
    "READABLE",
    "WRITING",
    "BlockIndex",
    "BlockKey",
    "HostArena",
    "StorePlan",
    "StoreStats",
    "as_block_key",
    "as_block_keys",
    "prefix_block_keys",
    "slots_for_capacity",
]
