"""The eviction-policy contract: which readable block to give up first.

A policy only orders keys. The store owns slots and reference counts and decides which candidates
it may actually evict (a block being read is skipped), then reports each eviction back with
``remove(key, evicted=True)``. All methods are O(1) except ``candidates``, which is lazy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

from kvoffload.store.keys import BlockKey


class EvictionPolicy(ABC):
    name: str = ""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"expected policy capacity > 0, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: BlockKey) -> None:
        """A block became readable (it was not tracked before)."""

    @abstractmethod
    def touch(self, key: BlockKey) -> None:
        """A tracked block was used (a hit or a load)."""

    @abstractmethod
    def remove(self, key: BlockKey, evicted: bool) -> None:
        """A tracked block is gone: ``evicted`` for pressure, False for a delete or reset."""

    @abstractmethod
    def candidates(self) -> Iterator[BlockKey]:
        """Tracked keys, best victim first. Do not mutate the policy while iterating."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: BlockKey) -> bool: ...
