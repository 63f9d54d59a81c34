"""The index's protocol, each test run against the native index and its Python model."""

import pytest

from kvoffload.store.index import FREE, READABLE, WRITING
from kvoffload.store.index import BlockIndex as NativeIndex
from tests.index_model import ModelIndex


@pytest.fixture(params=["native", "model"])
def BlockIndex(request):
    return NativeIndex if request.param == "native" else ModelIndex


def keys(n: int, start: int = 0) -> list[bytes]:
    return [i.to_bytes(8, "big") for i in range(start, start + n)]


def test_store_then_lookup(BlockIndex):
    ix = BlockIndex(8, 100)
    ks = keys(4)
    plan = ix.prepare_store(ks)
    assert plan.keys == ks and sorted(plan.slots.tolist()) == [0, 1, 2, 3]
    assert ix.lookup(ks) == 0  # being written is not readable
    assert ix.state(ks[0]) == WRITING
    ix.complete_store(ks)
    assert ix.lookup(ks) == 4 and ix.state(ks[0]) == READABLE
    assert ix.lookup([*ks[:2], b"missing", ks[3]]) == 2
    assert ix.stats.stores == 4 and ix.stats.bytes_in == 400
    assert ix.stats.hits == 6 and ix.stats.misses == 6
    ix.check_invariants()


def test_present_keys_are_not_stored_again(BlockIndex):
    ix = BlockIndex(8, 1)
    ix.complete_store(ix.prepare_store(keys(2)).keys)
    plan = ix.prepare_store(keys(4))
    assert plan.keys == keys(2, 2) and plan.skipped_present == 2


def test_failed_store_leaves_nothing_readable(BlockIndex):
    ix = BlockIndex(4, 1)
    plan = ix.prepare_store(keys(3))
    ix.complete_store(plan.keys, success=False)
    assert ix.lookup(keys(3)) == 0 and ix.num_free == 4 and ix.state(keys(1)[0]) == FREE
    assert ix.stats.store_failures == 3
    ix.check_invariants()


def test_eviction_skips_blocks_being_read(BlockIndex):
    ix = BlockIndex(4, 1)
    ix.complete_store(ix.prepare_store(keys(4)).keys)
    ix.prepare_load(keys(2))  # pin 0 and 1 (the LRU end)
    plan = ix.prepare_store(keys(2, 10))
    assert set(plan.evicted) == set(keys(2, 2))
    assert ix.lookup(keys(2)) == 2
    ix.check_invariants()


def test_store_never_evicts_its_own_prefix(BlockIndex):
    ix = BlockIndex(3, 1)
    ix.complete_store(ix.prepare_store(keys(3)).keys)
    plan = ix.prepare_store([*keys(3), *keys(2, 100)])  # present prefix + 2 new
    assert plan.keys == [] and plan.skipped_full == 2 and plan.evicted == []
    assert ix.lookup(keys(3)) == 3


def test_store_drops_the_tail_that_does_not_fit(BlockIndex):
    ix = BlockIndex(3, 1)
    ix.complete_store(ix.prepare_store(keys(2)).keys)
    ix.prepare_load(keys(2))
    plan = ix.prepare_store(keys(3, 10))
    assert plan.keys == keys(1, 10) and plan.skipped_full == 2


def test_load_protocol_errors(BlockIndex):
    ix = BlockIndex(4, 1)
    ks = keys(2)
    ix.prepare_store(ks)
    with pytest.raises(ValueError, match="expected READABLE keys"):
        ix.prepare_load(ks)  # still being written
    ix.complete_store(ks)
    with pytest.raises(ValueError, match="expected keys prepared for load"):
        ix.complete_load(ks)
    slots = ix.prepare_load(ks)
    assert slots.tolist() == [ix.slot_of(k) for k in ks]
    ix.complete_load(ks)
    assert ix.stats.loads == 2


def test_complete_store_of_unprepared_key_is_an_error(BlockIndex):
    ix = BlockIndex(4, 1)
    with pytest.raises(ValueError, match="not being written"):
        ix.complete_store(keys(1))


def test_duplicate_keys_in_one_store_are_an_error(BlockIndex):
    ix = BlockIndex(4, 1)
    with pytest.raises(ValueError, match="distinct keys"):
        ix.prepare_store([b"a", b"a"])


def test_reset_keeps_pinned_blocks(BlockIndex):
    ix = BlockIndex(4, 1)
    ix.complete_store(ix.prepare_store(keys(4)).keys)
    ix.prepare_load(keys(1))
    assert ix.reset() == 3
    assert ix.lookup(keys(1)) == 1 and ix.num_readable == 1
    ix.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_both_policies_evict_under_pressure(BlockIndex, policy):
    ix = BlockIndex(16, 1, policy)
    for start in range(0, 200, 8):
        plan = ix.prepare_store(keys(8, start))
        ix.complete_store(plan.keys)
        ix.check_invariants()
    assert ix.num_readable == 16 and ix.stats.evictions == 200 - 16


def test_zero_slots_is_an_error(BlockIndex):
    with pytest.raises(ValueError, match="num_slots > 0"):
        BlockIndex(0, 1)


def test_refused_calls_change_nothing(BlockIndex):
    """Each refusal used to leave state behind: a repeated key in prepare_store or in
    complete_store popping one slot before failing, a negative evict count."""
    ix = BlockIndex(4, 1)
    ix.complete_store(ix.prepare_store(keys(2)).keys)
    writing = ix.prepare_store(keys(1, 10)).keys

    def state():
        return (ix.num_free, ix.num_writing, ix.num_readable, ix.num_pinned, ix.stats.snapshot())

    before = state()
    with pytest.raises(ValueError, match="distinct keys"):
        ix.prepare_store([b"new", b"new"])
    with pytest.raises(ValueError, match="distinct keys"):
        ix.complete_store([*writing, *writing])
    with pytest.raises(ValueError, match="block count >= 0"):
        ix.evict(-1)
    with pytest.raises(ValueError, match=r"expected READABLE keys, got 1 .*'abc'"):
        ix.pin([keys(1)[0], "abc"])
    with pytest.raises(ValueError, match="fewer readers"):
        ix.unpin(keys(1))
    assert state() == before
    ix.check_invariants()
    ix.pin(keys(2))
    assert ix.num_pinned == 2
    ix.unpin(keys(2))
    assert ix.num_pinned == 0


def test_ci_builds_the_index_extension():
    """CI installs the package with a C compiler present: the native index must be there."""
    import os

    from kvoffload.store.index import native_index

    if os.environ.get("KVOFFLOAD_REQUIRE_NATIVE") != "1":
        pytest.skip("KVOFFLOAD_REQUIRE_NATIVE=1 is set by .ci/run")
    assert native_index().ABI == 1
