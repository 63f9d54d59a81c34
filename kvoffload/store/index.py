"""The block index: which key lives in which host slot, and in what state.

Lifecycle of a block (the one place it is written down)::

    (absent) --prepare_store--> WRITING --complete_store(success=True)--> READABLE
                                   |                                        |   ^
                                   +--complete_store(success=False)--> (absent) |
                                                                            |   |
             READABLE --prepare_load--> READABLE, readers += 1 --complete_load--+
             READABLE, readers == 0 --evict (pressure, reset, remove)--> (absent)
             READABLE --pin--> READABLE, readers += 1 --unpin--> (a reader that is not a load)

- A slot is exactly one of FREE, WRITING (its key is not readable: ``lookup`` stops there) or
  READABLE. Every slot that is not FREE has exactly one key, and every key has exactly one slot.
- ``prepare_store`` hands out slots for the keys not already present, evicting unpinned READABLE
  blocks when the free list runs dry. Keys that do not fit are dropped from the plan from the first
  one that does not fit (a later block of a prefix is useless without the earlier ones).
- A READABLE block with readers (between ``prepare_load`` and ``complete_load``, or ``pin`` and
  ``unpin``) is never evicted. ``pin`` is for copies out of a host slot that are not engine loads
  (a lower tier writing the block down): it counts no load and does not touch the policy.
- A failed store (``complete_store(success=False)``) leaves nothing readable and frees its slots.
- Recency is kept per call, last key first: ``complete_store`` makes its keys readable, and
  ``prepare_load`` and ``touch`` mark them used, from the last key to the first, so of a prefix
  the head (which every longer prefix needs) is the most recent and the tail is evicted first, as
  in vLLM's offloading managers. ``prepare_store`` marks the keys it finds READABLE used too (the
  engine has just offered them again): a block stored long ago in the middle of a prefix stored
  now would otherwise be evicted before the blocks around it and cut every later hit there.
- ``reset`` drops the unpinned READABLE blocks in the policy's victim order.

The per-block work is native (``kvoffload/store/native/``, the extension
``kvoffload.store._index``): keys are held as fixed-size values (16 bytes and a tag; the 17-byte
negative-int form of ``keys.py`` too; any other length by a digest, with its bytes kept and
compared on a match), the index is an open-addressing table, the eviction policies
(``policies.py``: LRU, ARC) are lists threaded through per-slot arrays. No Python object is kept
per block, so a host of millions of blocks costs tens of bytes each and gives the garbage
collector nothing to walk. Every call here does O(1) Python work whatever the number of keys:
keys come as a list or tuple of ``bytes`` (any other iterable is made a list), or as a
C-contiguous uint8 array of shape (n, 16) (one 16-byte key per row); slots come back as int64
arrays. A Python model of the same index is the test oracle (``tests/index_model.py``); there is
no Python fallback in the library: where the extension was not built, ``BlockIndex`` raises
ImportError saying so (wheels carry it).

The index deals in keys and integer slot ids only: no bytes, no torch. Calls are atomic (the
native index runs under the GIL and never releases it), but the scheduler that owns it calls it
from one thread or under its lock (the ``Offloader`` holds its lock around every call). Keys are
non-empty ``bytes``: the caller's boundary checks that (``Offloader`` through ``checked_keys``);
``prepare_store`` refuses others, the other calls treat them as keys never stored. Every call that
refuses its input (a key in the wrong state, a repeated key, a bad count) raises ValueError
before it changes anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvoffload.store.keys import BlockKey
from kvoffload.store.policies import POLICIES, check_window
from kvoffload.store.stats import StoreStats

try:
    import kvoffload.store._index as _index
except ImportError as err:  # an install without a C compiler: say so when an index is built
    _index = None  # type: ignore[assignment]
    _MISSING = str(err)

FREE, WRITING, READABLE = 0, 1, 2
Keys = Sequence[BlockKey] | np.ndarray
PolicyState = tuple[list[bytes], list[bytes], list[bytes], list[Any], list[Any], int]
Reserved = tuple[
    list[BlockKey] | np.ndarray, np.ndarray, np.ndarray | None, list[BlockKey], int, int
]


def _no_positions() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, init=False)
class StorePlan:
    """What ``prepare_store`` decided: write ``keys`` into ``slots`` (same order)."""

    # an array's rows where the keys came as an array (that array itself where all were new)
    keys: list[BlockKey] | np.ndarray
    slots: np.ndarray  # int64, one per key
    evicted: list[BlockKey] = field(default_factory=list)
    skipped_present: int = 0  # keys already WRITING or READABLE
    skipped_full: int = 0  # keys that found no slot
    positions: np.ndarray = field(default_factory=_no_positions)  # of ``keys`` in the call's keys

    def __init__(
        self,
        keys: list[BlockKey] | np.ndarray,
        slots: np.ndarray,
        evicted: list[BlockKey] | None = None,
        skipped_present: int = 0,
        skipped_full: int = 0,
        positions: np.ndarray | None = None,
    ) -> None:
        # written out: one is made per store on the engine's thread (see kvoffload.offload.jobs)
        d = self.__dict__
        d["keys"], d["slots"] = keys, slots
        d["evicted"] = [] if evicted is None else evicted
        d["skipped_present"], d["skipped_full"] = skipped_present, skipped_full
        d["positions"] = _no_positions() if positions is None else positions


def native_index() -> Any:
    """The extension module; ImportError, saying how to get it, where it was not built."""
    if _index is None:
        raise ImportError(
            f"kvoffload's native block index is not built ({_MISSING}); install a kvoffload "
            "wheel, or reinstall with a C compiler present (gcc or clang)"
        )
    return _index


class BlockIndex:
    def __init__(self, num_slots: int, slot_bytes: int, policy: str = "lru", window: int = 1):
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots <= 0:
            raise ValueError(f"expected num_slots > 0, got {num_slots}")
        if policy not in POLICIES:
            raise ValueError(f"expected an eviction policy in {sorted(POLICIES)}, got {policy!r}")
        check_window(window)
        native = native_index()
        if num_slots > native.MAX_SLOTS:
            raise ValueError(f"expected num_slots <= {native.MAX_SLOTS}, got {num_slots}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.policy = policy
        self.window = window
        self.stats = StoreStats()
        self._ix = native.Index(num_slots, policy, window)
        self._refused = native.Refused

    # -- queries ------------------------------------------------------------------------------

    def lookup(self, keys: Keys, check: Callable[[Keys], Keys] | None = None) -> int:
        """Number of leading ``keys`` that are READABLE. Counts hits and misses in ``stats``.

        ``check``: the caller's check of ``keys`` it has not run yet (ValueError for a bad key;
        keys it converts come back as a new list), run only where a key is missed: a key found
        was non-empty ``bytes`` (the index finds no other), so a full hit needs no check."""
        if type(keys) is not list:
            keys = _sequence(keys)
        n, total = self._ix.lookup(keys)
        if check is not None and n < total:
            checked = check(keys)
            if checked is not keys:
                n, total = self._ix.lookup(_sequence(checked))
        stats = self.stats
        stats.lookups += 1
        stats.hits += n
        stats.misses += total - n
        return int(n)

    def state(self, key: BlockKey) -> int:
        return int(self._ix.find(key)[0])

    def slot_of(self, key: BlockKey) -> int | None:
        slot = self._ix.find(key)[1]
        return None if slot < 0 else int(slot)

    def readers(self, key: BlockKey) -> int:
        return int(self._ix.find(key)[2])

    @property
    def num_free(self) -> int:
        return int(self._ix.counts()[0])

    @property
    def num_writing(self) -> int:
        return int(self._ix.counts()[1])

    @property
    def num_readable(self) -> int:
        return int(self._ix.counts()[2])

    @property
    def num_pinned(self) -> int:
        """READABLE blocks with readers (being loaded or copied down): not evictable now."""
        return int(self._ix.counts()[3])

    def candidates(self) -> list[BlockKey]:
        """Every READABLE key, best victim first (pinned ones included); O(n), for tools."""
        return list(self._ix.policy_state()[0])

    # -- stores -------------------------------------------------------------------------------

    def prepare_store(self, keys: Keys) -> StorePlan:
        """Reserve slots for the keys not yet present (see the module docstring)."""
        plan_keys, slots, positions, evicted, present, full = self.reserve(keys)
        try:
            if positions is None:
                positions = np.arange(len(slots), dtype=np.int64)
            return StorePlan(plan_keys, slots, evicted, present, full, positions)
        except BaseException:  # out of memory or interrupted here: the reserved slots go back
            self._ix.complete_store(plan_keys, False)
            raise

    def reserve(self, keys: Keys, evicted_keys: bool = True) -> Reserved:
        """``prepare_store``'s plan as a tuple, for a caller that makes one per store (the
        Offloader): (keys, slots, positions, evicted, skipped_present, skipped_full), positions
        None where every key got a slot, in order. ``evicted_keys=False``: ``evicted`` is empty
        (the evictions still counted in ``stats``), for a caller no lower tier takes them from:
        no key object is made per evicted block (1,000 evictions: 146 -> 132 us p10, this VM)."""
        if type(keys) is not list:
            keys = _sequence(keys)
        try:
            result = self._ix.prepare_store(keys, evicted_keys)
        except self._refused as refusal:
            raise self._refusal("prepare_store", keys, refusal) from None
        try:
            new, pos, slots, evicted, present, full = result
            if isinstance(evicted, int):  # its count: the keys were not asked for
                self.stats.evictions += evicted
                evicted = []
            elif evicted:
                self.stats.evictions += len(evicted)
            positions = None if not present and not full else _ids(pos)
            plan_keys = new
            if new is None:  # keys as an array: the plan's keys are its rows (all: itself)
                rows = np.asarray(keys)
                if rows.ndim != 2:  # a flat buffer of 16 * n bytes
                    rows = rows.reshape(-1, 16)
                plan_keys = rows if positions is None else rows[positions]
            return plan_keys, _ids(slots), positions, evicted, present, full
        except BaseException:  # out of memory or interrupted here: the reserved slots go back
            new, pos = result[0], result[1]
            reserved = new if new is not None else np.asarray(keys).reshape(-1, 16)[_ids(pos)]
            self._ix.complete_store(reserved, False)
            raise

    def complete_store(
        self,
        keys: Iterable[BlockKey] | np.ndarray,
        success: bool = True,
        slots: np.ndarray | None = None,
    ) -> None:
        """``slots``: the int64 slots ``prepare_store`` gave these keys, same order (a job's own
        record): the index then finds none of the keys again (~0.03 µs a block less); a slot
        not WRITING is refused by the keys, as without them."""
        n = self._by_slots(keys, slots, self._ix.complete_store_slots, success)
        if n is None:
            keys = _sequence(keys)
            try:
                n = self._ix.complete_store(keys, success)
            except self._refused as refusal:
                raise self._refusal("complete_store", keys, refusal) from None
        stats = self.stats
        if success:
            stats.stores += n
            stats.bytes_in += n * self.slot_bytes
        else:
            stats.store_failures += n

    # -- loads --------------------------------------------------------------------------------

    def prepare_load(self, keys: Keys) -> np.ndarray:
        """Pin READABLE ``keys`` against eviction and return their slots (int64)."""
        if type(keys) is not list:
            keys = _sequence(keys)
        try:
            return _ids(self._ix.prepare_load(keys))
        except self._refused as refusal:
            raise self._refusal("prepare_load", keys, refusal) from None

    def complete_load(
        self,
        keys: Iterable[BlockKey] | np.ndarray,
        success: bool = True,
        slots: np.ndarray | None = None,
    ) -> None:
        """``slots``: the slots ``prepare_load`` gave these keys, same order, as for
        ``complete_store``."""
        n = self._by_slots(keys, slots, self._ix.release_slots)
        if n is None:
            n = self._release(keys, "complete_load: expected keys prepared for load")
        stats = self.stats
        if success:
            stats.loads += n
            stats.bytes_out += n * self.slot_bytes
        else:
            stats.load_failures += n

    def pin(self, keys: Iterable[BlockKey] | np.ndarray) -> np.ndarray:
        """Hold READABLE ``keys`` against eviction (a reader that is not a load); see ``unpin``.
        Returns their slots (int64)."""
        keys = _sequence(keys)
        try:
            return _ids(self._ix.pin(keys))
        except self._refused as refusal:
            raise self._refusal("pin", keys, refusal) from None

    def unpin(self, keys: Iterable[BlockKey] | np.ndarray) -> None:
        """Release one ``pin`` of each key; counts nothing."""
        self._release(keys, "unpin: expected pinned keys")

    def _release(self, keys: Iterable[BlockKey] | np.ndarray, expected: str) -> int:
        """Drop one reader of each key (a key may repeat); ValueError, changing nothing, if a key
        has fewer readers than asked. Returns the number of keys."""
        keys = _sequence(keys)
        try:
            return int(self._ix.release(keys))
        except self._refused as refusal:
            raise self._refusal(expected, keys, refusal) from None

    def _by_slots(
        self, keys: object, slots: np.ndarray | None, call: Callable[..., int], *args: object
    ) -> int | None:
        """``call(slots, *args)`` (the native index by a job's own slots) where ``slots`` match
        ``keys`` one for one; None where they are not given or the index refused them (nothing
        changed: the caller's call by keys then says what is wrong)."""
        if slots is None or type(keys) not in _SIZED or len(slots) != len(keys):  # type: ignore[arg-type]
            return None
        try:
            return int(call(slots, *args))
        except self._refused:
            return None

    def touch(self, keys: Iterable[BlockKey] | np.ndarray) -> None:
        self._ix.touch(_sequence(keys))

    # -- eviction -----------------------------------------------------------------------------

    def evict(self, n: int) -> list[BlockKey]:
        """Evict up to ``n`` unpinned READABLE blocks in policy order; returns their keys."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"evict: expected a block count >= 0, got {n!r}")
        victims: list[BlockKey] = self._ix.evict(min(n, self.num_slots))
        self.stats.evictions += len(victims)
        return victims

    def remove(self, keys: Iterable[BlockKey] | np.ndarray) -> list[BlockKey]:
        """Drop the given unpinned READABLE keys (not an eviction); returns those dropped."""
        gone: list[BlockKey] = self._ix.remove(_sequence(keys))
        return gone

    def reset(self) -> int:
        """Drop every unpinned READABLE block; blocks being read or written stay."""
        return int(self._ix.reset())

    # -- checking -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping contradicts itself (for tests; O(num_slots))."""
        bad = self._ix.check()
        if bad is not None:
            raise AssertionError(bad)

    def nbytes(self) -> int:
        """Bytes the native index holds (its allocator's own count)."""
        return int(self._ix.nbytes())

    def policy_state(self) -> PolicyState:
        """(victim order, T1, T2, B1, B2, p): LRU has T1 only; long ARC ghosts read None. Tests."""
        state: PolicyState = self._ix.policy_state()
        return state

    def _refusal(self, where: str, keys: Keys, refusal: BaseException) -> ValueError:
        native = native_index()
        code, count, first = refusal.args
        key = _show(_key_at(keys, first)) if first >= 0 else ""
        if code == native.REPEATS:
            return ValueError(f"{where}: expected distinct keys, got {count} repeats")
        if code == native.BAD_KEY:
            return ValueError(
                f"{where}: expected keys as non-empty bytes, got {key} at position {first}"
            )
        if code == native.NOT_WRITING:
            return ValueError(
                f"{where}: expected keys prepared for store, got {count} that are not being "
                f"written (first: {key})"
            )
        if code == native.NOT_READABLE:
            return ValueError(
                f"{where}: expected READABLE keys, got {count} that are not (first: {key})"
            )
        return ValueError(f"{where}, got {count} with fewer readers than released (first: {key})")


def _sequence(keys: Iterable[BlockKey] | np.ndarray) -> Keys:
    """``keys`` as the native index takes them without a Python loop: lists, tuples and arrays
    as they are, any other iterable as a list."""
    if isinstance(keys, np.ndarray):
        return np.ascontiguousarray(keys)  # the native index reads rows in place
    if isinstance(keys, (list, tuple)):
        return keys
    return list(keys)


_INT64 = np.dtype(np.int64)  # given positionally: frombuffer parses a dtype= keyword ~2x slower
_SIZED = (tuple, list, np.ndarray)  # keys a job's slots are counted against


def _ids(raw: bytes) -> np.ndarray:
    """The native index's int64 ids, read-only (a job's ids cannot change once checked)."""
    return np.frombuffer(raw, _INT64)


def _key_at(keys: Keys, i: int) -> object:
    if isinstance(keys, np.ndarray):
        rows = keys.reshape(-1, 16)
        return bytes(rows[i])
    return keys[i]


def _show(key: object) -> str:
    return key.hex() if isinstance(key, bytes) else repr(key)
