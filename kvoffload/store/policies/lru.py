"""Least recently used: an OrderedDict, oldest first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvoffload.store.keys import BlockKey
from kvoffload.store.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey) -> None:
        self._order[key] = None

    def touch(self, key: BlockKey) -> None:
        self._order.move_to_end(key)

    def remove(self, key: BlockKey, evicted: bool) -> None:
        del self._order[key]

    def candidates(self) -> Iterator[BlockKey]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._order
