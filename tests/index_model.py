"""The block index in Python: the oracle the native index (``kvoffload.store.index.BlockIndex``
over ``kvoffload/store/native/``) is checked against, call by call. Same contract (written once,
in ``kvoffload/store/index.py``), same results: slots handed out in the same order, the same
victims, the same counters. Two choices the native index fixed and this model follows: ``reset``
drops blocks in the policy's victim order, and ``remove`` drops a repeated key once.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence

import numpy as np

from kvoffload.store.index import FREE, READABLE, WRITING, StorePlan
from kvoffload.store.keys import BlockKey
from kvoffload.store.policies import WINDOW_SHARE, check_window
from kvoffload.store.stats import StoreStats
from tests.policy_model import EvictionPolicy, make_policy

__all__ = ["FREE", "READABLE", "WRITING", "ModelIndex", "choose_runs"]


def choose_runs(slots: Sequence[int], want: int) -> list[int]:
    """Of candidate ``slots`` in the policy's order (more than ``want``), the positions of the
    ``want`` victims, in the policy's order: the oldest candidate not yet taken, with the rest of
    its run of consecutive candidate slots, until enough are; of a run longer than what is still
    needed, the part ending at that oldest unless the part starting there is older (of a prefix
    in ascending slots, the tail). The rule of ``kvoffload/store/native/runs.c``, written again."""
    order = sorted(range(len(slots)), key=lambda i: slots[i])
    runs: list[list[int]] = []  # candidate positions, in slot order
    run_of: dict[int, int] = {}
    for at, i in enumerate(order):
        if not (at and slots[i] == slots[order[at - 1]] + 1):
            runs.append([])
        runs[-1].append(i)
        run_of[i] = len(runs) - 1
    take: set[int] = set()
    need = want
    for age in range(len(slots)):
        if need == 0:
            break
        if age in take:
            continue  # runs are taken whole but for the last
        run = runs[run_of[age]]
        if len(run) > need:  # the ``need`` ending at ``age``, unless those starting there are older
            j = run.index(age)
            down, up = run[max(j - need + 1, 0) :][:need], run[min(j, len(run) - need) :][:need]
            run = up if max(up) < max(down) else down
        take.update(run)
        need -= len(run)
    return sorted(take)


class ModelIndex:
    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        policy: str | EvictionPolicy = "lru",
        window: int = 1,
    ):
        if num_slots <= 0:
            raise ValueError(f"expected num_slots > 0, got {num_slots}")
        self.window = check_window(window)
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.policy = make_policy(policy, num_slots) if isinstance(policy, str) else policy
        self.stats = StoreStats()
        self._readable: dict[BlockKey, int] = {}
        self._writing: dict[BlockKey, int] = {}
        self._readers: dict[BlockKey, int] = {}  # only keys with readers > 0
        # Free slots as an int32 stack (4 bytes per slot instead of a list of Python ints).
        self._free = np.arange(num_slots - 1, -1, -1, dtype=np.int32)
        self._num_free = num_slots

    # -- queries ------------------------------------------------------------------------------

    def lookup(
        self,
        keys: Sequence[BlockKey],
        check: Callable[[Sequence[BlockKey]], Sequence[BlockKey]] | None = None,
    ) -> int:
        """Number of leading ``keys`` that are READABLE. Counts hits and misses in ``stats``.
        ``check`` runs where a key is missed (as ``BlockIndex.lookup``'s)."""
        n = self._leading(keys)
        if check is not None and n < len(keys):
            checked = check(keys)
            if checked is not keys:
                keys = checked
                n = self._leading(keys)
        self.stats.lookups += 1
        self.stats.hits += n
        self.stats.misses += len(keys) - n
        return n

    def _leading(self, keys: Sequence[BlockKey]) -> int:
        readable = self._readable
        n = 0
        for key in keys:
            if not _is_key(key) or key not in readable:
                break
            n += 1
        return n

    def state(self, key: BlockKey) -> int:
        if key in self._readable:
            return READABLE
        return WRITING if key in self._writing else FREE

    def slot_of(self, key: BlockKey) -> int | None:
        slot = self._readable.get(key)
        return self._writing.get(key) if slot is None else slot

    def readers(self, key: BlockKey) -> int:
        return self._readers.get(key, 0)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_readable(self) -> int:
        return len(self._readable)

    @property
    def num_writing(self) -> int:
        return len(self._writing)

    @property
    def num_pinned(self) -> int:
        """READABLE blocks with readers (being loaded or copied down): not evictable now."""
        return len(self._readers)

    # -- stores -------------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[BlockKey]) -> StorePlan:
        """Reserve slots for the keys not yet present (see the module docstring)."""
        bad = [i for i, k in enumerate(keys) if not _is_key(k)]
        if bad:
            raise ValueError(
                "prepare_store: expected keys as non-empty bytes, got "
                f"{_show(keys[bad[0]])} at position {bad[0]}"
            )
        _check_unique(keys, "prepare_store")
        readable, writing = self._readable, self._writing
        positions = [i for i, k in enumerate(keys) if k not in readable and k not in writing]
        new = [keys[i] for i in positions]
        evicted: list[BlockKey] = []
        if len(new) > self._num_free:  # never evict a block of this same call
            evicted = self._evict(len(new) - self._num_free, set(keys), self.window)
        fit = min(len(new), self._num_free)
        new, dropped = new[:fit], len(new) - fit
        slots = np.sort(self._pop_free(fit))  # ascending, as the native index hands them
        self._writing.update(zip(new, slots.tolist(), strict=True))
        skipped = len(keys) - len(new) - dropped
        if len(positions) < len(keys):  # keys held already count as used
            self.touch(keys)
        chosen = np.asarray(positions[:fit], dtype=np.int64)
        return StorePlan(new, slots, evicted, skipped, dropped, chosen)

    def reserve(self, keys: Sequence[BlockKey], evicted_keys: bool = True) -> tuple[object, ...]:
        """``prepare_store`` as ``BlockIndex.reserve`` returns it (positions None: all; no
        evicted keys unless asked for, the evictions counted all the same)."""
        plan = self.prepare_store(keys)
        present, full = plan.skipped_present, plan.skipped_full
        positions = None if not present and not full else plan.positions
        evicted = plan.evicted if evicted_keys else []
        return plan.keys, plan.slots, positions, evicted, present, full

    def complete_store(
        self, keys: Iterable[BlockKey], success: bool = True, slots: object = None
    ) -> None:
        """``slots`` (the native index's shortcut) changes nothing here: the model's answer is
        the one by keys."""
        keys = list(keys)
        _check_unique(keys, "complete_store")
        missing = [k for k in keys if k not in self._writing]
        if missing:
            raise ValueError(
                f"complete_store: expected keys prepared for store, got {len(missing)} that are "
                f"not being written (first: {_show(missing[0])})"
            )
        slots = [self._writing.pop(k) for k in keys]
        if success:
            self._readable.update(zip(keys, slots, strict=True))
            for key in reversed(keys):  # last key first: a prefix's head is the most recent
                self.policy.insert(key)
            self.stats.stores += len(keys)
            self.stats.bytes_in += len(keys) * self.slot_bytes
        else:
            self._push_free(slots)
            self.stats.store_failures += len(keys)

    # -- loads --------------------------------------------------------------------------------

    def prepare_load(self, keys: Sequence[BlockKey]) -> np.ndarray:
        """Pin READABLE ``keys`` against eviction and return their slots (int64)."""
        self._acquire(keys, "prepare_load")
        for key in reversed(keys):
            self.policy.touch(key)
        return np.fromiter((self._readable[k] for k in keys), dtype=np.int64, count=len(keys))

    def complete_load(
        self, keys: Iterable[BlockKey], success: bool = True, slots: object = None
    ) -> None:
        keys = list(keys)
        self._release(keys, "complete_load: expected keys prepared for load")
        if success:
            self.stats.loads += len(keys)
            self.stats.bytes_out += len(keys) * self.slot_bytes
        else:
            self.stats.load_failures += len(keys)

    def pin(self, keys: Iterable[BlockKey]) -> None:
        """Hold READABLE ``keys`` against eviction (a reader that is not a load); see ``unpin``."""
        self._acquire(list(keys), "pin")

    def _acquire(self, keys: Sequence[BlockKey], where: str) -> None:
        """Add one reader to each key; ValueError, changing nothing, if one is not READABLE."""
        absent = [k for k in keys if not _is_key(k) or k not in self._readable]
        if absent:
            raise ValueError(
                f"{where}: expected READABLE keys, got {len(absent)} that are not "
                f"(first: {_show(absent[0])})"
            )
        readers = self._readers
        for key in keys:
            readers[key] = readers.get(key, 0) + 1

    def unpin(self, keys: Iterable[BlockKey]) -> None:
        """Release one ``pin`` of each key; counts nothing."""
        self._release(list(keys), "unpin: expected pinned keys")

    def _release(self, keys: list[BlockKey], expected: str) -> None:
        """Drop one reader of each key (a key may repeat); ValueError, changing nothing, if a key
        has fewer readers than asked."""
        short = [k for k, n in Counter(keys).items() if self._readers.get(k, 0) < n]
        if short:
            raise ValueError(
                f"{expected}, got {len(short)} with fewer readers than released "
                f"(first: {_show(short[0])})"
            )
        for key in keys:
            left = self._readers[key] - 1
            if left:
                self._readers[key] = left
            else:
                del self._readers[key]

    def touch(self, keys: Iterable[BlockKey]) -> None:
        for key in reversed(list(keys)):
            if key in self._readable:
                self.policy.touch(key)

    # -- eviction -----------------------------------------------------------------------------

    def evict(self, n: int) -> list[BlockKey]:
        """Evict up to ``n`` unpinned READABLE blocks in policy order; returns their keys."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"evict: expected a block count >= 0, got {n!r}")
        return self._evict(n, protect=())

    def remove(self, keys: Iterable[BlockKey]) -> list[BlockKey]:
        """Drop the given unpinned READABLE keys (not an eviction); returns those dropped."""
        gone = [k for k in dict.fromkeys(keys) if k in self._readable and k not in self._readers]
        self._drop(gone, evicted=False)
        return gone

    def reset(self) -> int:
        """Drop every unpinned READABLE block; blocks being read or written stay."""
        return len(self.remove(list(self.policy.candidates())))

    def _evict(self, n: int, protect: Collection[BlockKey], window: int = 1) -> list[BlockKey]:
        readers = self._readers
        evictable = (k for k in self.policy.candidates() if k not in readers and k not in protect)
        room = n + min(n * (window - 1), self.num_slots // WINDOW_SHARE)
        victims = list(itertools.islice(evictable, room))
        if len(victims) > n:
            slots = [self._readable[k] for k in victims]
            victims = [victims[i] for i in choose_runs(slots, n)]
        self._drop(victims, evicted=True)
        return victims

    def _drop(self, keys: list[BlockKey], evicted: bool) -> None:
        slots = [self._readable.pop(k) for k in keys]
        for key in keys:
            self.policy.remove(key, evicted)
        self._push_free(slots)
        if evicted:
            self.stats.evictions += len(keys)

    # -- free list ----------------------------------------------------------------------------

    def _pop_free(self, n: int) -> np.ndarray:
        top = self._num_free
        slots = self._free[top - n : top][::-1].astype(np.int64)
        self._num_free = top - n
        return slots

    def _push_free(self, slots: Sequence[int]) -> None:
        """Slots freed together come back out of ``_pop_free`` in the order they were freed (a
        run of consecutive slots stays an ascending run), as the native index does."""
        top = self._num_free
        self._free[top : top + len(slots)] = np.asarray(slots, dtype=self._free.dtype)[::-1]
        self._num_free = top + len(slots)

    # -- checking -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping contradicts itself (for tests; O(num_slots))."""
        free = self._free[: self._num_free]
        used = list(self._readable.values()) + list(self._writing.values())
        every = np.concatenate([free.astype(np.int64), np.asarray(used, dtype=np.int64)])
        if len(every) != self.num_slots or not np.array_equal(
            np.sort(every), np.arange(self.num_slots)
        ):
            raise AssertionError("slots are not partitioned into free / writing / readable")
        if self._readable.keys() & self._writing.keys():
            raise AssertionError("a key is both readable and being written")
        if not self._readers.keys() <= self._readable.keys():
            raise AssertionError("a key being read is not readable")
        if len(self.policy) != len(self._readable) or any(
            k not in self.policy for k in self._readable
        ):
            raise AssertionError("the policy does not track exactly the readable keys")


def _is_key(key: object) -> bool:
    """A key the index can hold: non-empty ``bytes`` exactly (anything else is never found)."""
    return type(key) is bytes and len(key) > 0


def _check_unique(keys: Sequence[BlockKey], where: str) -> None:
    if len(set(keys)) != len(keys):
        raise ValueError(
            f"{where}: expected distinct keys, got {len(keys) - len(set(keys))} repeats"
        )


def _show(key: object) -> str:
    return key.hex() if isinstance(key, bytes) else repr(key)
