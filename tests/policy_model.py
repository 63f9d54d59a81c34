"""The eviction policies in Python: the oracle the native ones (kvoffload/store/native/lru.c,
arc.c) are checked against, decision by decision (tests/index_model.py uses them).

A policy only orders keys. The store owns slots and reference counts and decides which candidates
it may actually evict (a block being read is skipped), then reports each eviction back with
``remove(key, evicted=True)``.

ARC (Megiddo & Modha, FAST 2003), adapted to a store with pinned blocks: T1 holds blocks seen
once, T2 blocks seen again; B1 and B2 remember keys recently evicted from each (ghosts, keys
only). A new block whose key is a B1 ghost means T1 was too small, so the target size ``p`` of
T1 grows; a B2 ghost shrinks it. Eviction prefers T1 while it is larger than ``p``; the store,
not the policy, decides when to evict, so ``candidates`` yields both lists in preference order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator
from itertools import chain


class EvictionPolicy(ABC):
    name: str = ""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"expected policy capacity > 0, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: bytes) -> None:
        """A block became readable (it was not tracked before)."""

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """A tracked block was used (a hit or a load)."""

    @abstractmethod
    def remove(self, key: bytes, evicted: bool) -> None:
        """A tracked block is gone: ``evicted`` for pressure, False for a delete or reset."""

    @abstractmethod
    def candidates(self) -> Iterator[bytes]:
        """Tracked keys, best victim first. Do not mutate the policy while iterating."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: bytes) -> bool: ...


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        self._order[key] = None

    def touch(self, key: bytes) -> None:
        self._order.move_to_end(key)

    def remove(self, key: bytes, evicted: bool) -> None:
        del self._order[key]

    def candidates(self) -> Iterator[bytes]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: bytes) -> bool:
        return key in self._order


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0  # target size of T1
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
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

    def touch(self, key: bytes) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def remove(self, key: bytes, evicted: bool) -> None:
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

    def candidates(self) -> Iterator[bytes]:
        if self._t1 and len(self._t1) > self.p:
            return chain(self._t1, self._t2)
        return chain(self._t2, self._t1)

    def state(self) -> tuple[list[bytes], list[bytes], list[bytes], list[bytes], list[bytes], int]:
        """As the native index's ``policy_state``: (victim order, T1, T2, B1, B2, p)."""
        lists = (self._t1, self._t2, self._b1, self._b2)
        return (list(self.candidates()), *(list(x) for x in lists), self.p)  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: bytes) -> bool:
        return key in self._t1 or key in self._t2


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"expected an eviction policy in {sorted(POLICIES)}, got {name!r}"
        ) from None
    return cls(capacity)
