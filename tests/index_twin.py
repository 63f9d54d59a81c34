"""The native index and its Python model side by side: ``TwinIndex`` takes every call, makes it
on both, and fails the test at the first call whose results differ (return values, the refusal
and its message, the counters). ``assert_same`` compares their whole state: every key's state,
slot and readers, the counts, and the policy's lists (for ARC its ghosts and target too)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from kvoffload.store.index import BlockIndex, StorePlan
from tests.index_model import ModelIndex


def _same(a: object, b: object) -> bool:
    if isinstance(a, StorePlan) and isinstance(b, StorePlan):
        return (
            a.keys == b.keys
            and np.array_equal(a.slots, b.slots)
            and a.evicted == b.evicted
            and (a.skipped_present, a.skipped_full) == (b.skipped_present, b.skipped_full)
            and np.array_equal(a.positions, b.positions)
        )
    if isinstance(a, tuple) and isinstance(b, tuple):  # reserve's plan
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a == b


def _copy(arg: Any) -> Any:
    """A key iterable made a list (each index consumes its own); other arguments as given."""
    if isinstance(arg, Iterable) and not isinstance(arg, (bytes, str, np.ndarray)):
        return list(arg)
    return arg


class TwinIndex:
    """A ``BlockIndex`` that is the native index and the model at once (the native one answers)."""

    def __init__(
        self, num_slots: int, slot_bytes: int, policy: str = "lru", window: int = 1
    ) -> None:
        self.native = BlockIndex(num_slots, slot_bytes, policy, window)
        self.model = ModelIndex(num_slots, slot_bytes, policy, window)
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        self.calls = 0

    @property
    def stats(self) -> Any:
        return self.native.stats

    def _both(self, name: str, *args: Any) -> Any:
        self.calls += 1
        out: list[tuple[str, Any]] = []
        for ix in (self.native, self.model):
            copied = [_copy(a) for a in args]
            method: Callable[..., Any] = getattr(ix, name)
            try:
                out.append(("ok", method(*copied)))
            except ValueError as err:
                out.append(("refused", str(err)))
        (kind_n, got_n), (kind_m, got_m) = out
        assert kind_n == kind_m and _same(got_n, got_m), f"{name}{args}: {out}"
        assert self.native.stats == self.model.stats, f"{name}: counters differ"
        if kind_n == "refused":
            raise ValueError(got_n)
        return got_n

    def __getattr__(self, name: str) -> Any:
        if name in ("num_free", "num_writing", "num_readable", "num_pinned"):
            a, b = getattr(self.native, name), getattr(self.model, name)
            assert a == b, f"{name}: {a} != {b}"
            return a
        if name in _CALLS:
            return lambda *args: self._both(name, *args)
        raise AttributeError(name)

    def check_invariants(self) -> None:
        self.native.check_invariants()
        self.model.check_invariants()

    def assert_same(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            n, m = self.native, self.model
            got = (n.state(key), n.slot_of(key), n.readers(key))
            want = (m.state(key), m.slot_of(key), m.readers(key))
            assert got == want, f"{key.hex()}: native {got}, model {want}"
        for name in ("num_free", "num_writing", "num_readable", "num_pinned"):
            getattr(self, name)
        order, t1, t2, b1, b2, p = self.native.policy_state()
        policy = self.model.policy
        assert order == list(policy.candidates()), "the victim order differs"
        if self.model.policy.name == "arc":
            mt1, mt2, mb1, mb2, mp = policy.state()[1:]  # type: ignore[attr-defined]
            ghosts = ([_ghost(k) for k in mb1], [_ghost(k) for k in mb2])
            assert (t1, t2, b1, b2, p) == (mt1, mt2, *ghosts, mp), "ARC's lists differ"


def _ghost(key: bytes) -> bytes | None:
    """A ghost as the native index shows it: a long key keeps only its digest (None)."""
    inline = len(key) <= 16 or (len(key) == 17 and key[:1] == b"-")
    return key if inline else None


_CALLS = {
    *("lookup", "state", "slot_of", "readers", "prepare_store", "reserve", "complete_store"),
    *("prepare_load", "complete_load", "pin", "unpin", "touch", "evict", "remove", "reset"),
}
