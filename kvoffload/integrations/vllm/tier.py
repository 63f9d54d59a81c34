"""The scheduler half without vLLM: vLLM's ``OffloadingManager`` calls on a ``BlockIndex``.

Keys are vLLM's ``OffloadKey`` bytes (block hash + 4-byte group index), used as they are: one key
names one chunk of one KV-cache group, and one index slot is one host chunk (``chunk_bytes``).
The two-phase protocol is the index's (see ``kvoffload.store.index``); what this class adds:

- ``lookup`` answers per key: HIT (readable), PENDING (being written), MISS.
- ``prepare_store`` returns None when keys needed a slot and none could be freed (every block
  pinned by a reader or being written), so vLLM retries the store on a later step.
- ``reset`` forgets everything, blocks being read or written included: vLLM discards the
  completions of jobs in flight at a reset and fences the workers before new stores begin (its
  tiering manager drains the lower tiers' jobs first).
- ``pin``/``unpin`` hold a readable chunk while a lower tier copies it out (vLLM's cascade).
- Events (stored, removed) are recorded when asked for, for vLLM's KV-cache events.
- Within one prefix the tail is given up first: a request's chunks enter the eviction policy,
  and are touched, from the last to the first, so the head of a prefix (which every later hit on
  any part of it needs) outlives its tail. vLLM hands ``complete_store`` an unordered set, so the
  order of ``prepare_store`` is remembered until then.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from kvoffload.store.index import WRITING, BlockIndex, StorePlan
from kvoffload.store.keys import BlockKey

HIT, PENDING, MISS = "hit", "pending", "miss"


@dataclass(frozen=True)
class TierEvent:
    keys: list[BlockKey]
    removed: bool  # False: the keys became readable
    metadata_only: bool = False  # a failed store released its slots (never announced stored)


class HostTier:
    def __init__(
        self,
        num_chunks: int,
        chunk_bytes: int,
        policy: str = "lru",
        events: bool = False,
        window: int = 1,
    ) -> None:
        self.num_chunks = num_chunks
        self.chunk_bytes = chunk_bytes
        self.policy = policy
        self.window = window  # OffloadConfig.eviction_window
        self.index = BlockIndex(num_chunks, chunk_bytes, policy, window)
        self.stats = self.index.stats  # cumulative, kept across resets
        self.store_refusals = 0  # prepare_store calls that found no slot at all
        self._events: list[TierEvent] | None = [] if events else None
        self._ticket = itertools.count()
        self._store_order: dict[BlockKey, int] = {}  # key being written -> prepare order

    def lookup(self, key: BlockKey) -> str:
        if self.index.state(key) == WRITING:
            return PENDING
        return HIT if self.index.lookup([key]) else MISS  # counts the hit or the miss

    def prepare_load(self, keys: Sequence[BlockKey]) -> np.ndarray:
        """Pin ``keys`` (all readable) and return their host chunks, in order. The index touches
        them last key first: of a prefix the head is the most recent, the tail goes first."""
        return self.index.prepare_load(keys)

    def complete_load(self, keys: Collection[BlockKey], success: bool = True) -> None:
        self.index.complete_load(keys, success)

    def pin(self, keys: Sequence[BlockKey]) -> np.ndarray:
        """Hold readable ``keys`` while a lower tier copies them out; their host chunks, in order
        (``unpin`` releases them). Pins neither count as loads nor touch the policy."""
        return self.index.pin(keys)

    def unpin(self, keys: Collection[BlockKey]) -> None:
        self.index.unpin(keys)

    def touch(self, keys: Collection[BlockKey]) -> None:
        self.index.touch(keys)  # last key first (the index's rule)

    def prepare_store(self, keys: Sequence[BlockKey]) -> StorePlan | None:
        plan = self.index.prepare_store(keys)
        if plan.evicted:
            self._record(TierEvent(plan.evicted, removed=True))
        if not plan.keys and plan.skipped_full:
            self.store_refusals += 1
            return None
        self._store_order.update((k, next(self._ticket)) for k in plan.keys)
        return plan

    def complete_store(self, keys: Collection[BlockKey], success: bool = True) -> None:
        order = self._store_order
        # in prepare order: the index makes them readable last key first (the tail oldest)
        ordered = sorted(keys, key=lambda k: order.get(k, -1))
        self.index.complete_store(ordered, success)
        for key in ordered:
            del order[key]
        self._record(TierEvent(ordered, removed=not success, metadata_only=not success))

    def drop(self, keys: Collection[BlockKey]) -> list[BlockKey]:
        """Forget readable, unpinned ``keys`` (their copy failed); returns those dropped."""
        gone = self.index.remove(keys)
        self._record(TierEvent(gone, removed=True))
        return gone

    def reset(self) -> None:
        stats = self.stats
        self.index = BlockIndex(self.num_chunks, self.chunk_bytes, self.policy, self.window)
        self.index.stats = stats
        self._store_order.clear()

    def take_events(self) -> list[TierEvent]:
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    def usage(self) -> float:
        """Fraction of host chunks holding or receiving a block."""
        return 1.0 - self.index.num_free / self.num_chunks

    def _record(self, event: TierEvent) -> None:
        if self._events is not None and event.keys:
            self._events.append(event)
