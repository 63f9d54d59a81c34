"""The engine-neutral API end to end on CPU: Offloader + TransferWorker + host backend."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvoffload import KVLayout, OffloadConfig, build_local, prefix_block_keys
from kvoffload.offload import JobResult, TransferWorker
from kvoffload.transfer.host import HostBackend
from kvoffload.transfer.spec import TransferSpec

NUM_BLOCKS, BS = 32, 16


@pytest.fixture
def engine():
    gen = torch.Generator().manual_seed(0)
    kv = [
        torch.randint(-(2**15), 2**15, (2, NUM_BLOCKS, BS, 2, 32), dtype=torch.int16, generator=gen)
        for _ in range(3)
    ]
    layout = KVLayout.from_tensors(kv, block_size=BS, block_dim=1)
    local = build_local(layout, OffloadConfig(host_capacity_blocks=8))
    yield kv, local
    local.close()


def run(local, job):
    local.worker.submit(job)
    assert local.worker.wait([job.job_id], timeout=30) == set()
    return local.offloader.complete(local.worker.get_finished())


def blocks_of(kv, ids):
    return [t[:, ids].clone() for t in kv]


def test_store_lookup_load_round_trip(engine):
    kv, local = engine
    off = local.offloader
    keys = prefix_block_keys(np.arange(100), BS)  # 6 full blocks
    src = [4, 9, 1, 30, 2, 7]
    want = blocks_of(kv, src)
    assert off.lookup(keys) == 0
    job = off.schedule_store("a", keys, src)
    assert off.lookup(keys) == 0  # being written is not a hit yet
    (done,) = run(local, job)
    assert done.job_id == job.job_id and off.is_settled("a")
    assert off.lookup(keys) == 6 and off.lookup([*keys[:3], b"x", *keys[4:]]) == 3

    dst = [10, 11, 12, 13, 14, 15]
    run(local, off.schedule_load("b", keys, dst))
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(kv, dst), want, strict=True))
    s = off.index.stats
    assert (s.stores, s.loads, s.bytes_in, s.bytes_out) == (
        6,
        6,
        6 * off.slot_bytes,
        6 * off.slot_bytes,
    )


def test_store_skips_held_blocks_and_evicts_under_pressure(engine):
    _kv, local = engine
    off = local.offloader
    keys = prefix_block_keys(np.arange(16 * 12), BS)  # 12 blocks, capacity 8
    run(local, off.schedule_store("a", keys[:6], range(6)))
    job = off.schedule_store("a", keys[:8], range(8))
    assert job is not None and job.keys == tuple(keys[6:8])
    run(local, job)
    assert off.schedule_store("a", keys[:8], range(8)) is None
    run(local, off.schedule_store("b", keys[8:12], range(8, 12)))
    assert off.index.stats.evictions == 4 and off.lookup(keys[8:]) == 4


class BrokenCopyBackend(HostBackend):
    """The host backend whose stores fail half-way (the first block copied, then an error),
    the way a driver error would end a copy."""

    def _copy_region(self, spec, r):
        if spec.direction == "store":
            half = TransferSpec.of("store", spec.blocks[:1], spec.slots[:1], spec.group)
            super()._copy_region(half, r)
            raise IndexError("the copy failed half-way")
        super()._copy_region(spec, r)


def test_failed_copy_is_a_failed_job_and_rolls_back(engine):
    _kv, local = engine
    off = local.offloader
    worker = TransferWorker(BrokenCopyBackend(local.worker.backend.layout, local.arena), off)
    keys = prefix_block_keys(np.arange(32), BS)
    job = off.schedule_store("a", keys, [0, 1])
    worker.submit(job)
    worker.wait([job.job_id], 30)
    (result,) = worker.get_finished()
    assert not result.ok and "IndexError" in (result.error or "")
    off.complete([result])
    assert off.lookup(keys) == 0 and off.index.num_free == off.num_slots
    worker.close()


class GatedHostBackend(HostBackend):
    """The host backend, holding each copy at a gate until the test opens it (then real bytes)."""

    def __init__(self, layout, arena):
        super().__init__(layout, arena)
        self.started = threading.Event()
        self.gate = threading.Event()

    def copy(self, specs):
        self.started.set()
        assert self.gate.wait(30)
        super().copy(specs)


def test_abort_cancels_what_has_not_started_and_settles(engine):
    _kv, local = engine
    off = local.offloader
    gated = GatedHostBackend(local.worker.backend.layout, local.arena)
    worker = TransferWorker(gated, off)
    keys = prefix_block_keys(np.arange(64), BS)
    held = off.schedule_store("held", keys[:2], [0, 1])
    waiting = off.schedule_store("aborted", keys[2:4], [2, 3])
    try:
        worker.submit(held)
        assert gated.started.wait(10)  # `held` is copying now
        worker.submit(waiting)
        assert off.abort("aborted") == [waiting.job_id]
        assert worker.cancel(off.abort("aborted")) == [waiting.job_id]
        assert off.abort("held") == [held.job_id]
        assert worker.cancel([held.job_id]) == []  # already running: it must finish
        assert not off.is_settled("held")
    finally:
        gated.gate.set()
    assert worker.wait([held.job_id], 30) == set()
    results = worker.get_finished()
    assert {r.job_id: (r.ok, r.cancelled) for r in results} == {
        waiting.job_id: (False, True),
        held.job_id: (True, False),
    }
    off.complete(results)
    assert off.is_settled("aborted") and off.is_settled("held")
    assert off.lookup(keys[2:4]) == 0  # cancelled store left nothing readable
    assert off.lookup(keys[:2]) == 2  # the in-flight store finished: its KV is valid
    assert off.index.num_free == off.num_slots - 2
    gated.close()


def test_bad_calls(engine):
    _kv, local = engine
    off = local.offloader
    keys = prefix_block_keys(np.arange(32), BS)
    with pytest.raises(ValueError, match="one engine block per key"):
        off.schedule_store("a", keys, [0])
    with pytest.raises(ValueError, match="schedule_load: expected keys held on host"):
        off.schedule_load("a", keys, [0, 1])
    with pytest.raises(ValueError, match=r"unknown id\(s\) \[99\]"):
        off.complete([JobResult(99, True, 0, 0.0)])
    with pytest.raises(ValueError, match=r"unknown id\(s\) \[\[1\]\]"):
        off.complete([JobResult([1], True, 0, 0.0)])  # type: ignore[arg-type]
    for call in (local.worker.cancel, local.worker.wait):
        with pytest.raises(ValueError, match="expected int job ids, got"):
            call([[1]])
    job = off.schedule_store("a", keys, [0, 0])  # the same source block twice is allowed
    local.worker.submit(job)
    with pytest.raises(ValueError, match="already running"):
        local.worker.submit(job)


def test_capacity_smaller_than_one_block_is_an_error():
    kv = [torch.zeros(2, 4, 16, 8, 64, dtype=torch.bfloat16)]
    layout = KVLayout.from_tensors(kv, block_size=16, block_dim=1)
    with pytest.raises(ValueError, match="at least one block"):
        build_local(layout, OffloadConfig(host_capacity_bytes=1024))


def test_wait_on_orders_after_a_host_copy_and_touch_refreshes_recency(engine):
    kv, local = engine
    off, worker = local.offloader, local.worker
    keys = prefix_block_keys(np.arange(16 * 8), BS)  # 8 blocks: the host tier is full after this
    run(local, off.schedule_store("a", keys, range(8)))
    want = blocks_of(kv, [0])
    job = off.schedule_load("b", keys[:1], [20])
    worker.submit(job)
    worker.wait_on(job.job_id)  # CPU backend: returns once the copy is done
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(kv, [20]), want, strict=True))
    worker.wait_on(job.job_id)  # idempotent
    off.complete(worker.get_finished())
    worker.wait_on(job.job_id)  # already reported: nothing to wait for

    # one store's blocks go tail first (the prefix's head is the most recent): 7 is the oldest;
    # touched, it is the most recent of blocks 1..7
    off.touch(keys[7:8])
    off.touch([b"unknown"])
    run(local, off.schedule_store("c", prefix_block_keys(np.arange(1000, 1016), BS), [9]))
    assert off.lookup(keys[7:8]) == 1 and off.lookup(keys[6:7]) == 0  # 6 went first, not 7


def _state(off):
    ix = off.index
    return (ix.num_free, ix.num_writing, ix.num_readable, ix.num_pinned, off.in_flight())


def test_a_refused_schedule_leaves_nothing_behind(engine):
    """schedule_load(req, keys, [5, 5]) used to pin the slots and only fail at submit: the request
    never settled and the slots stayed pinned for good."""
    _kv, local = engine
    off = local.offloader
    keys = prefix_block_keys(np.arange(32), BS)
    run(local, off.schedule_store("s", keys, [0, 1]))
    before = _state(off)
    bad_loads = [
        (keys, [5, 5], 0, "distinct destination engine blocks"),
        (keys, [5, NUM_BLOCKS], 0, r"engine block id in \[0, 32\), got 32"),
        (keys, [-1, 5], 0, "got -1"),
        (keys, [5, 6], 1, r"group in \[0, 1\), got 1"),
        (keys, [5, 6], True, "int layer group"),
        (keys, [5.0, 6.0], 0, "int engine block ids"),
        (keys, [[5, 6]], 0, r"expected a 1-D array of engine block ids, got shape \(1, 2\)"),
        (keys, np.array([[5], [6]]), 0, r"1-D array of engine block ids, got shape \(2, 1\)"),
        (keys, 5, 0, r"1-D array of engine block ids, got shape \(\)"),
        (keys, [5], 0, "one engine block per key"),
        ([*keys, b"absent"], [5, 6, 7], 0, "expected keys held on host"),
    ]
    for ks, blocks, group, message in bad_loads:
        with pytest.raises(ValueError, match=message):
            off.schedule_load("r", ks, blocks, group)
        assert _state(off) == before and off.is_settled("r")
    with pytest.raises(ValueError, match="str req_id"):
        off.schedule_load(7, keys, [5, 6])
    new = prefix_block_keys(np.arange(100, 132), BS)
    for ks, blocks, message in [
        (new, [0, NUM_BLOCKS], "engine block id"),
        ([new[0], new[0]], [0, 1], "distinct keys"),
        (new, [0], "one engine block per key"),
        (new[:1], [[0]], r"expected a 1-D array of engine block ids, got shape \(1, 1\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            off.schedule_store("r", ks, blocks)
        assert _state(off) == before and off.is_settled("r")
    # Capacity is all there: a good load and a store that fills the host still work.
    run(local, off.schedule_load("r", keys, [5, 6]))
    job = off.schedule_store("t", prefix_block_keys(np.arange(200, 200 + 8 * BS), BS), range(8))
    assert job is not None and len(job.keys) == 8


def test_keys_must_be_bytes_or_ints(engine):
    _kv, local = engine
    off = local.offloader
    before = _state(off)
    for bad in (["abc"], [b""], [bytearray(b"k")], [1.5], [None], [True]):
        for call in (
            lambda ks: off.lookup(ks),
            lambda ks: off.lookup_tiers(ks),
            lambda ks: off.touch(ks),
            lambda ks: off.schedule_store("r", ks, [0]),
            lambda ks: off.schedule_load("r", ks, [0]),
        ):
            with pytest.raises(ValueError, match="expected keys as non-empty bytes"):
                call(bad)
            assert _state(off) == before and off.is_settled("r")
    with pytest.raises(ValueError, match="at position 1"):
        off.lookup([b"ok", "abc"])
    run(local, off.schedule_store("r", [123, 2**100], [0, 1]))  # the documented int form
    from kvoffload import as_block_key

    assert off.lookup([as_block_key(123), as_block_key(2**100)]) == 2 and off.lookup([123]) == 1


def test_complete_applies_every_known_result_then_names_the_unknown(engine):
    """complete([ok1, unknown, ok2]) used to stop at the unknown id: ok2's request never settled."""
    _kv, local = engine
    off, worker = local.offloader, local.worker
    k1, k2 = prefix_block_keys(np.arange(32), BS)
    j1, j2 = off.schedule_store("a", [k1], [0]), off.schedule_store("b", [k2], [1])
    for job in (j1, j2):
        worker.submit(job)
    assert worker.wait([j1.job_id, j2.job_id], 30) == set()
    r1, r2 = sorted(worker.get_finished(), key=lambda r: r.job_id)
    with pytest.raises(ValueError, match=r"unknown id\(s\) \[77, 'junk'\].*2 known"):
        off.complete([r1, JobResult(77, True, 0, 0.0), "junk", r2])
    assert off.is_settled("a") and off.is_settled("b") and off.lookup([k1, k2]) == 2
    with pytest.raises(ValueError, match=r"unknown id\(s\) \[" + str(j1.job_id)):
        off.complete([r1])  # twice is unknown the second time, and changes nothing
    assert off.lookup([k1, k2]) == 2 and off.index.num_readable == 2


def test_closed_objects_say_so_before_touching_state():
    """One contract for a closed object, like the backends': ValueError "expected an open ...,
    got a closed one", before any state is touched."""
    kv = [torch.zeros(2, NUM_BLOCKS, BS, 2, 32, dtype=torch.int16)]
    local = build_local(
        KVLayout.from_tensors(kv, BS, block_dim=1), OffloadConfig(host_capacity_blocks=4)
    )
    off, worker = local.offloader, local.worker
    keys = prefix_block_keys(np.arange(32), BS)
    run(local, off.schedule_store("a", keys, [0, 1]))
    job = off.schedule_store("b", prefix_block_keys(np.arange(100, 116), BS), [2])
    assert job is not None
    local.close()
    local.close()  # idempotent
    assert local.closed and off.closed
    before = _state(off)
    for call in (
        lambda: off.lookup(keys),
        lambda: off.schedule_store("c", prefix_block_keys(np.arange(200, 216), BS), [3]),
        lambda: off.schedule_load("c", keys, [4, 5]),
        lambda: off.touch(keys),
        lambda: off.complete([]),
        lambda: off.abort("b"),
        lambda: off.lookup_tiers(keys),
        lambda: off.poll_tiers(),
        lambda: off.drain_tiers(1.0),
    ):
        with pytest.raises(ValueError, match="expected an open Offloader, got a closed one"):
            call()
    with pytest.raises(ValueError, match="expected an open TransferWorker, got a closed one"):
        worker.submit(job)
    with pytest.raises(ValueError, match="expected an open LocalOffload, got a closed one"):
        local.serve_metrics(0)
    assert _state(off) == before
    assert worker.cancel([job.job_id]) == []  # close settled it: nothing is left to cancel
    assert off.is_settled("b") and off.is_settled("a") and worker.get_finished() == []


def test_a_worker_closed_alone_refuses_jobs_that_still_settle(engine):
    _kv, local = engine
    off, worker = local.offloader, local.worker
    worker.close()
    keys = prefix_block_keys(np.arange(16), BS)
    job = off.schedule_store("a", keys, [0])
    assert job is not None
    with pytest.raises(ValueError, match="expected an open TransferWorker, got a closed one"):
        worker.submit(job)
    assert worker.cancel(off.abort("a")) == [job.job_id]
    off.complete(worker.get_finished())
    assert off.is_settled("a") and off.index.num_free == off.num_slots
