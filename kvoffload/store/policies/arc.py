"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), adapted to a store with pinned blocks.

T1 holds blocks seen once, T2 blocks seen again; B1 and B2 remember keys recently evicted from each
(ghosts, keys only). A new block whose key is a B1 ghost means T1 was too small, so the target size
``p`` of T1 grows; a B2 ghost shrinks it. Eviction prefers T1 while it is larger than ``p``.
Differences from the paper: the store, not the policy, decides when to evict and may skip pinned
candidates, so ``candidates`` yields both lists in preference order instead of one victim.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from itertools import chain

from kvoffload.store.keys import BlockKey
from kvoffload.store.policies.base import EvictionPolicy


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0  # target size of T1
        self._t1: OrderedDict[BlockKey, None] = OrderedDict()
        self._t2: OrderedDict[BlockKey, None] = OrderedDict()
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey) -> None:
        if key in self._b1:
            self.p = min(self.capacity, self.p + max(1, len(self._b2) // max(1, len(self._b1))))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.p = max(0, self.p - max(1, len(self._b1) // max(1, len(self._b2))))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def touch(self, key: BlockKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def remove(self, key: BlockKey, evicted: bool) -> None:
        if key in self._t1:
            del self._t1[key]
            ghosts = self._b1
        else:
            del self._t2[key]
            ghosts = self._b2
        if evicted:
            ghosts[key] = None
            self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)

    def candidates(self) -> Iterator[BlockKey]:
        if self._t1 and len(self._t1) > self.p:
            return chain(self._t1, self._t2)
        return chain(self._t2, self._t1)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._t1 or key in self._t2
