"""A job's end by the slots the index gave it (``complete_store``/``complete_load`` with
``slots``): the same state and counters as by keys, and slots that are not the job's refused as
the keys would be, changing nothing. The Offloader passes them (its state machine runs them
against the Python model: tests/test_index_state_machine.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.store.index import READABLE, WRITING, BlockIndex
from tests.index_twin import TwinIndex


def keys(n: int, start: int = 0) -> list[bytes]:
    return [i.to_bytes(16, "big") for i in range(start, start + n)]


@pytest.mark.parametrize("success", [True, False])
def test_a_store_ends_by_slots_as_by_keys(success: bool) -> None:
    twin = TwinIndex(16, 64)
    plan = twin.prepare_store(keys(5))
    twin.complete_store(plan.keys, success, plan.slots)
    twin.assert_same(keys(5))
    twin.check_invariants()
    assert twin.native.state(keys(1)[0]) == (READABLE if success else 0)


def test_a_load_ends_by_slots_as_by_keys_repeats_included() -> None:
    twin = TwinIndex(16, 64)
    twin.complete_store(*(lambda p: (p.keys, True, p.slots))(twin.prepare_store(keys(4))))
    ks = [*keys(4), keys(1)[0]]  # a key read twice in one load
    slots = twin.prepare_load(ks)
    assert twin.native.readers(ks[0]) == 2
    twin.complete_load(ks, True, slots)
    twin.assert_same(keys(4))
    assert twin.native.num_pinned == 0 and twin.native.stats.loads == 5


def test_slots_that_are_not_the_jobs_are_refused_as_the_keys_are() -> None:
    ix = BlockIndex(16, 64)
    plan = ix.prepare_store(keys(3))
    slots = plan.slots
    bad = [
        np.array([slots[0], slots[0], slots[1]], dtype=np.int64),  # a repeat
        np.array([slots[0], slots[1], 99], dtype=np.int64),  # no such slot
        np.array([slots[0], slots[1], 15], dtype=np.int64),  # a FREE slot
    ]
    for wrong in bad:  # the keys are right: the keys' call completes them after all
        ix2 = BlockIndex(16, 64)
        p2 = ix2.prepare_store(keys(3))
        ix2.complete_store(p2.keys, True, wrong)
        assert all(ix2.state(k) == READABLE for k in keys(3))
        ix2.check_invariants()
    # wrong keys and wrong slots: the keys' refusal, nothing changed
    with pytest.raises(ValueError, match="complete_store: expected keys prepared for store"):
        ix.complete_store(keys(3, 100), True, bad[2])
    assert all(ix.state(k) == WRITING for k in keys(3)) and ix.num_writing == 3
    ix.complete_store(plan.keys, True, slots)
    loaded = ix.prepare_load(keys(1))
    with pytest.raises(ValueError, match="complete_load: expected keys prepared for load"):
        ix.complete_load(keys(2), True, np.array([loaded[0], loaded[0]], dtype=np.int64))
    assert ix.readers(keys(1)[0]) == 1 and ix.num_pinned == 1
    ix.complete_load(keys(1), True, loaded)
    assert ix.readers(keys(1)[0]) == 0 and ix.num_pinned == 0
    ix.check_invariants()


def test_slots_must_be_int64() -> None:
    ix = BlockIndex(4, 64)
    plan = ix.prepare_store(keys(1))
    with pytest.raises(ValueError, match="int64"):
        ix._ix.complete_store_slots(plan.slots.astype(np.int32), True)
    assert ix.num_writing == 1


def test_reserve_is_prepare_store_as_a_tuple() -> None:
    twin = TwinIndex(6, 64)
    plan_keys, slots, positions, evicted, present, full = twin.reserve(keys(3))
    assert plan_keys == keys(3) and positions is None and (present, full) == (0, 0)
    assert not slots.flags.writeable and evicted == []
    twin.complete_store(plan_keys, True, slots)
    got = twin.reserve(keys(5, 1))  # 1 and 2 are held; 3, 4, 5 fit, then the index is full
    assert got[0] == keys(3, 3) and got[2] is not None and got[2].tolist() == [2, 3, 4]
    assert (got[4], got[5]) == (2, 0)
    # full: the oldest unpinned readable are evicted. 0..2 went in tail first (2 oldest); 1 and 2,
    # offered again, count as used (last key first): 0 is the oldest, then 2
    plan = twin.prepare_store(keys(2, 10))
    assert plan.positions.tolist() == [0, 1] and plan.evicted == [keys(3)[0], keys(3)[2]]
