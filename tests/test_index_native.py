"""The native index on what only it takes: keys as arrays, every key form, its memory, and a
random workload checked call by call against the Python model (tests/index_twin.py)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from kvoffload import KVLayout, OffloadConfig, build_local
from kvoffload.store.index import READABLE, WRITING, BlockIndex
from tests.index_twin import TwinIndex

FORMS = {
    "short": lambda i: i.to_bytes(3, "big"),
    "16": lambda i: i.to_bytes(16, "big"),
    "negative": lambda i: b"-" + i.to_bytes(16, "big"),
    "sha256+group": lambda i: i.to_bytes(32, "little") + b"\x00\x00\x00\x02",
    "17 not negative": lambda i: b"+" + i.to_bytes(16, "big"),
}


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 16), dtype=np.uint8)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_key_form_round_trips(form):
    ix = BlockIndex(8, 1)
    keys = [FORMS[form](i) for i in range(12)]
    plan = ix.prepare_store(keys)
    assert plan.keys == keys[:8] and plan.skipped_full == 4
    ix.complete_store(plan.keys)
    assert ix.lookup(keys) == 8 and ix.state(keys[3]) == READABLE
    # evicts the 4 oldest, their keys as given: one store's keys go in last key first, so its
    # tail is the oldest (a prefix's head outlives it)
    plan = ix.prepare_store(keys[8:])
    assert plan.evicted == keys[7:3:-1]
    assert ix.evict(2) == [keys[3], keys[2]] and ix.remove([keys[1]]) == [keys[1]]
    ix.check_invariants()


def test_keys_that_share_their_padded_bytes_stay_apart():
    ix = BlockIndex(8, 1)
    near = [b"\x01", b"\x01\x00", b"\x00\x01", b"-" + bytes(15) + b"\x01", bytes(15) + b"\x01"]
    near += [b"-" + bytes(16), bytes(16), bytes(17), bytes(32), bytes(33)]
    near = near[:8]
    ix.complete_store(ix.prepare_store(near).keys)
    assert ix.num_readable == 8 and ix.lookup(near) == 8
    assert ix.lookup([b"\x01\x00\x00"]) == 0 and ix.lookup([bytes(18)]) == 0
    assert {ix.slot_of(k) for k in near} == set(range(8))


def test_an_array_of_keys_is_the_list_of_its_rows():
    arr = rows(40)
    as_list = [bytes(r) for r in arr]
    a, b = BlockIndex(32, 1, "arc"), BlockIndex(32, 1, "arc")
    pa, pb = a.prepare_store(arr), b.prepare_store(as_list)
    assert isinstance(pa.keys, np.ndarray) and np.array_equal(pa.keys, arr[:32])  # its rows
    assert pb.keys == as_list[:32] and np.array_equal(pa.slots, pb.slots)
    a.complete_store(arr[:32])
    b.complete_store(as_list[:32])
    assert a.lookup(arr) == b.lookup(as_list) == 32
    assert a.lookup(arr.reshape(-1)) == 32  # a flat buffer of 16-byte keys
    assert np.array_equal(a.prepare_load(arr[:5]), b.prepare_load(as_list[:5]))
    a.complete_load(arr[:5])
    # loads are uses, last key first: newest in T2, the first key the most recent
    assert a.policy_state()[0][-5:] == as_list[4::-1]
    assert a.stats.loads == 5 and a.stats.hits == 64


@pytest.mark.parametrize(
    "bad",
    [np.zeros((2, 8), np.uint8), np.zeros((2, 16), np.int32), np.zeros(20, np.uint8), b"x" * 32],
)
def test_a_malformed_key_array_is_refused_and_changes_nothing(bad):
    ix = BlockIndex(4, 1)
    ix.complete_store(ix.prepare_store([b"a"]).keys)
    with pytest.raises(ValueError, match="expected"):
        ix.prepare_store(bad)
    assert (ix.num_free, ix.num_writing, ix.num_readable) == (3, 0, 1)


def test_a_key_array_of_2_to_the_31_rows_is_refused_before_it_is_read(tmp_path):
    """2**31 - 1 keys (32 GiB, a sparse file mapped read-only: nothing is read) in one call:
    refused as too many, as a list of them would be, and the index is unchanged."""
    n = 2**31 - 1
    path = tmp_path / "keys"
    with open(path, "wb") as f:
        f.truncate(n * 16)
    keys = np.memmap(path, dtype=np.uint8, mode="r", shape=(n, 16))
    ix = BlockIndex(4, 1)
    for call in (ix.prepare_store, ix.lookup):
        with pytest.raises(ValueError, match=rf"fewer than 2\*\*31 keys in one call, got {n}"):
            call(keys)
    assert (ix.num_free, ix.num_writing, ix.num_readable) == (4, 0, 0)
    del keys


@pytest.mark.parametrize("form", ["list", "array"])
def test_prepare_store_out_of_memory_at_any_allocation_leaves_no_slot_reserved(form):
    """Each Python allocation of the call made to fail in turn (CPython's test hooks): the call
    either succeeds or raises MemoryError with no slot left WRITING and the index consistent."""
    testcapi = pytest.importorskip("_testcapi")
    keys: Any = rows(8, seed=3)
    if form == "list":
        keys = [bytes(r) for r in keys]
    failed = 0
    for start in range(80):
        ix = BlockIndex(16, 1)
        try:
            testcapi.set_nomemory(start, start + 1)
            try:
                plan = ix.prepare_store(keys)
            finally:
                testcapi.remove_mem_hooks()
        except MemoryError:
            failed += 1
            assert (ix.num_writing, ix.num_free) == (0, 16), start
            assert ix._ix.check() is None
            continue
        assert ix.num_writing == 8
        ix.complete_store(plan.keys)
    assert failed > 3  # the sweep reached the call's allocations


def test_prepare_store_refuses_what_is_not_a_key():
    ix = BlockIndex(4, 1)
    with pytest.raises(ValueError, match="non-empty bytes, got 'abc' at position 1"):
        ix.prepare_store([b"a", "abc"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="non-empty bytes"):
        ix.prepare_store([b""])
    assert ix.num_free == 4 and ix.num_writing == 0


def test_memory_per_block_is_the_native_allocation():
    n = 100_000
    ix = BlockIndex(n, 1)
    for i in range(0, n, 10_000):
        ix.complete_store(ix.prepare_store(rows(10_000, i)).keys)
    assert ix.num_readable == n and ix.nbytes() / n <= 64


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_random_workload_matches_the_model_call_by_call(policy):
    rng = random.Random(policy)
    keys = [FORMS[sorted(FORMS)[i % 5]](i) for i in range(200)]
    twin = TwinIndex(40, 8, policy)
    reading: list[list[bytes]] = []
    for _ in range(3000):
        op = rng.random()
        some = rng.sample(keys, rng.randint(1, 30))
        try:
            if op < 0.35:
                plan = twin.prepare_store(some)
                twin.complete_store(plan.keys, rng.random() < 0.8)
            elif op < 0.55:
                held = some[: twin.lookup(some)]
                if held:
                    twin.prepare_load(held)
                    reading.append(held)
            elif op < 0.7 and reading:
                twin.complete_load(reading.pop(rng.randrange(len(reading))), rng.random() < 0.5)
            elif op < 0.8:
                twin.touch(some)
            elif op < 0.87:
                twin.evict(rng.randint(0, 10))
            elif op < 0.94:
                twin.remove(some)
            elif op < 0.96:
                twin.reset()
            else:
                twin.unpin(some)  # mostly refused: not pinned
        except ValueError:
            pass  # refused on both alike (TwinIndex asserted it); nothing changed
        twin.assert_same(keys)
    twin.check_invariants()
    assert twin.native.stats.evictions > 0 and twin.native.stats.hits > 0


def test_the_offloader_takes_arrays_of_keys_and_block_ids():
    kv = np.random.default_rng(1).integers(0, 256, (32, 256), dtype=np.uint8)
    layout = KVLayout.from_tensors([kv], block_size=16, block_dim=0)
    local = build_local(layout, OffloadConfig(host_capacity_blocks=16))
    off, worker = local.offloader, local.worker
    try:
        keys = rows(10, 7)
        src = np.array([3, 1, 4, 15, 9, 2, 6, 5, 30, 8], dtype=np.int32)
        want = kv[src].copy()
        job = off.schedule_store("a", keys, src)
        assert job is not None and isinstance(job.keys, np.ndarray)
        assert np.array_equal(job.keys, keys) and not job.keys.flags.writeable
        worker.submit(job)
        worker.wait([job.job_id], 30)
        off.complete(worker.get_finished())
        assert off.lookup(keys) == 10 and off.lookup([bytes(r) for r in keys]) == 10
        again = off.schedule_store("b", np.concatenate([keys[:4], rows(2, 99)]), np.arange(6))
        assert again is not None and np.array_equal(again.keys, rows(2, 99))
        assert np.array_equal(again.specs[0].blocks, [4, 5])
        worker.cancel(off.abort("b"))
        off.complete(worker.get_finished())
        dst = np.arange(20, 30)
        job = off.schedule_load("c", keys, dst)
        worker.submit(job)
        worker.wait([job.job_id], 30)
        off.complete(worker.get_finished())
        assert np.array_equal(kv[dst], want) and off.is_settled("c")
        with pytest.raises(ValueError, match=r"uint8 array of shape \(n, 16\), got int64"):
            off.schedule_load("d", keys.astype(np.int64), dst)
        assert off.is_settled("d") and off.index.num_pinned == 0
        assert off.index.state(bytes(keys[0])) == READABLE != WRITING
    finally:
        local.close()


def test_slots_freed_together_come_back_as_the_same_ascending_run() -> None:
    """A run evicted together is handed out again in the order it was freed, so a prefix stored
    in one job is a run of consecutive slots (one 2D copy per layer slice in the native core)."""
    from kvoffload.store.index import BlockIndex

    index = BlockIndex(16, 64)
    first = [bytes([i]) * 16 for i in range(8)]
    plan = index.prepare_store(first)
    assert list(plan.slots) == list(range(8))
    index.complete_store(first)
    assert index.evict(8) == first[::-1]  # least recent first: one store's tail
    again = [bytes([100 + i]) * 16 for i in range(12)]
    plan = index.prepare_store(again)
    assert list(plan.slots[:8]) == list(range(8))  # the freed run, ascending
    assert list(plan.slots[8:]) == list(range(8, 12))


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_under_pressure_a_prefix_loses_its_tail_first_and_keeps_its_head(policy):
    """A stored prefix goes in last key first, and a load touches it last key first: the head,
    which every longer prefix needs, is the most recent, so eviction shortens a hit from its end
    instead of cutting it to nothing."""
    twin = TwinIndex(8, 64, policy)
    prefix = [bytes([1, i]) * 8 for i in range(8)]
    twin.complete_store(twin.prepare_store(prefix).keys)
    twin.complete_store(twin.prepare_store([b"new-1", b"new-2"]).keys)
    assert twin.lookup(prefix) == 6  # blocks 6 and 7 went
    twin.complete_load(prefix[:6], True, twin.prepare_load(prefix[:6]))
    twin.complete_store(twin.prepare_store([b"new-3"]).keys)
    assert twin.lookup(prefix) == 6  # a new key's first victim is not the loaded prefix
    twin.assert_same([*prefix, b"new-1", b"new-2", b"new-3"])


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_keys_offered_again_count_as_used(policy):
    """A store that offers keys held already refreshes them: a block in the middle of a prefix
    stored long ago by another request does not go before the new blocks around it (a hole there
    would stop every later hit; bench e2e docs)."""
    twin = TwinIndex(8, 64, policy)
    old = [bytes([2, i]) * 8 for i in range(4)]
    newer = [bytes([3, i]) * 8 for i in range(4)]
    twin.complete_store(twin.prepare_store(old).keys)
    twin.complete_store(twin.prepare_store(newer).keys)
    plan = twin.prepare_store(old)  # all held: nothing to write, but they were used
    assert plan.skipped_present == 4 and plan.keys == []
    twin.complete_store(twin.prepare_store([bytes([4, i]) * 8 for i in range(4)]).keys)
    assert twin.lookup(old) == 4 and twin.lookup(newer) == 0
    twin.assert_same([*old, *newer])


@pytest.mark.parametrize("as_array", [False, True])
def test_a_store_that_wants_no_evicted_keys_still_evicts_and_counts_them(as_array):
    """``reserve(keys, evicted_keys=False)``: the same plan and the same evictions as with the
    keys asked for (two indexes side by side), only ``evicted`` is empty; stats count them."""
    a, b = BlockIndex(8, 64), BlockIndex(8, 64)
    for step in range(5):
        batch = rows(5, seed=step)
        keys: Any = batch if as_array else [bytes(r) for r in batch]
        plan_a = a.reserve(keys)
        plan_b = b.reserve(keys, evicted_keys=False)
        assert plan_b[3] == []
        assert np.array_equal(plan_a[1], plan_b[1])  # the same slots
        for plan, ix in ((plan_a, a), (plan_b, b)):
            ix.complete_store(plan[0], True, plan[1])
        assert a.stats.evictions == b.stats.evictions
    assert a.stats.evictions == 5 * 5 - 8
    assert a.candidates() == b.candidates()  # the same keys held, in the same eviction order
    a.check_invariants()
    b.check_invariants()
