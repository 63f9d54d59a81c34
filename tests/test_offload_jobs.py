"""A job runs at most once, and a stuck load fails at its deadline without freeing what it writes.

Every test checks bytes: the host arena and the engine's KV tensors are snapshotted before a
refused call and compared after it.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from kvoffload import KVLayout, OffloadConfig, build_local, prefix_block_keys
from kvoffload.offload import JobResult, LocalOffload, Offloader, TransferWorker
from kvoffload.transfer.host import HostBackend

NUM_BLOCKS, BS = 16, 16


def make_kv(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2**16, (2, NUM_BLOCKS, BS, 2, 8), dtype=np.uint16) for _ in range(2)]


def layout_of(kv: list[np.ndarray]) -> KVLayout:
    return KVLayout.from_tensors(kv, block_size=BS, block_dim=1)


def block(kv: list[np.ndarray], b: int) -> list[np.ndarray]:
    return [t[:, b].copy() for t in kv]


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def run(local: LocalOffload, job) -> list[JobResult]:
    local.worker.submit(job)
    assert local.worker.wait([job.job_id], timeout=30) == set()
    results = local.worker.get_finished()
    local.offloader.complete(results)
    return results


def collect(worker: TransferWorker, ids: set[int], timeout: float = 30.0) -> list[JobResult]:
    """Poll ``get_finished`` until a result for each of ``ids`` came back."""
    results: list[JobResult] = []
    stop = threading.Event()
    for _ in range(int(timeout / 0.01)):
        results += worker.get_finished()
        if ids <= {r.job_id for r in results}:
            return results
        stop.wait(0.01)
    raise AssertionError(f"no result for {ids - {r.job_id for r in results}} in {timeout} s")


class Snapshot:
    """Every byte a replayed job could touch: the host arena and the engine's KV."""

    def __init__(self, local: LocalOffload, kv: list[np.ndarray]) -> None:
        self.local, self.kv = local, kv
        self.slots = local.arena.slots.copy()
        self.tensors = [t.copy() for t in kv]
        self.free = local.offloader.index.num_free
        self.pinned = local.offloader.index.num_pinned

    def unchanged(self) -> bool:
        index = self.local.offloader.index
        return (
            np.array_equal(self.local.arena.slots, self.slots)
            and same(self.kv, self.tensors)
            and (index.num_free, index.num_pinned) == (self.free, self.pinned)
        )


@pytest.fixture
def setup():
    kv = make_kv()
    local = build_local(layout_of(kv), OffloadConfig(host_capacity_blocks=2))
    yield kv, local
    local.close()


def test_replaying_a_finished_store_or_load_changes_no_byte(setup):
    """Used to copy a reused engine block into a slot that another readable key owns (store), and
    the slot's new owner's bytes into engine blocks (load): wrong KV with no error."""
    kv, local = setup
    off, worker = local.offloader, local.worker
    a, b, c = (prefix_block_keys(np.arange(i * 100, i * 100 + BS), BS)[0] for i in range(3))
    store_a = off.schedule_store("r1", [a], [0])
    run(local, store_a)
    load_a = off.schedule_load("r2", [a], [5])
    run(local, load_a)
    assert same(block(kv, 5), block(kv, 0))
    # Both slots go to other keys (a is evicted): a replay would now copy the wrong bytes.
    run(local, off.schedule_store("r3", [b], [1]))
    run(local, off.schedule_store("r4", [c], [2]))
    assert off.lookup([a]) == 0 and off.lookup([b]) == off.lookup([c]) == 1
    kv[0][:, 0] += 1  # the engine reused block 0 for something else
    before = Snapshot(local, kv)
    for job in (store_a, load_a):
        with pytest.raises(ValueError, match="runs at most once"):
            worker.submit(job)
        assert worker.wait([job.job_id], 5) == set() and worker.get_finished() == []
    assert before.unchanged()
    assert off.is_settled("r1") and off.is_settled("r2") and off.in_flight() == set()


def test_a_job_runs_once_even_before_complete(setup):
    kv, local = setup
    off, worker = local.offloader, local.worker
    (key,) = prefix_block_keys(np.arange(BS), BS)
    job = off.schedule_store("r", [key], [3])
    worker.submit(job)
    assert worker.wait([job.job_id], 30) == set()
    with pytest.raises(ValueError, match="already running"):
        worker.submit(job)  # finished but not collected yet
    (result,) = worker.get_finished()
    with pytest.raises(ValueError, match="already submitted"):
        worker.submit(job)  # collected, not completed
    off.complete([result])
    with pytest.raises(ValueError, match="has already completed"):
        worker.submit(job)
    assert off.lookup([key]) == 1 and off.is_settled("r")
    run(local, off.schedule_load("r2", [key], [9]))
    assert same(block(kv, 9), block(kv, 3))  # stored once, from block 3


def test_foreign_jobs_are_refused_before_touching_memory(setup):
    kv, local = setup
    other = Offloader(OffloadConfig(host_capacity_blocks=2), local.offloader.slot_bytes)
    (key,) = prefix_block_keys(np.arange(BS), BS)
    foreign = other.schedule_store("x", [key], [0])
    assert foreign is not None and foreign.owner == other.token != local.offloader.token
    before = Snapshot(local, kv)
    with pytest.raises(ValueError, match="did not create"):
        local.worker.submit(foreign)
    assert before.unchanged() and local.worker.pending_count() == 0
    # A copy of an in-flight job is not the job: only the object schedule_* returned runs.
    import dataclasses

    mine = local.offloader.schedule_store("y", [key], [0])
    assert mine is not None
    with pytest.raises(ValueError, match="did not create"):
        local.worker.submit(dataclasses.replace(mine, specs=foreign.specs))
    run(local, mine)
    assert local.offloader.lookup([key]) == 1


def test_a_worker_runs_only_jobs_of_the_offloader_built_for_its_backend():
    """One mechanism: a worker is built with its Offloader (there is no unpaired worker), and
    only with one whose checks cover its backend's (so every job goes to submit_checked)."""
    kv = make_kv()
    layout = layout_of(kv)
    local = build_local(layout, OffloadConfig(host_capacity_blocks=2))
    backend = HostBackend(layout, local.arena)
    config = OffloadConfig(host_capacity_blocks=2)
    try:
        for offloader, message in [
            (Offloader(config, layout.slot_bytes), r"engine_blocks=\[16\].*got engine_blocks=None"),
            (Offloader(config, layout.slot_bytes, [NUM_BLOCKS + 1]), "got engine_blocks=.17"),
            (Offloader(config, layout.slot_bytes + 1, [NUM_BLOCKS]), "slot_bytes="),
            (
                Offloader(OffloadConfig(host_capacity_blocks=3), layout.slot_bytes, [NUM_BLOCKS]),
                "at most 2 host slots",
            ),
            (None, "expected the Offloader whose jobs this worker runs, got NoneType"),
        ]:
            with pytest.raises(ValueError, match=message):
                TransferWorker(backend, offloader)  # type: ignore[arg-type]
        other = Offloader(config, layout.slot_bytes, [NUM_BLOCKS])
        with pytest.raises(ValueError, match="TransferWorker built with this Offloader"):
            LocalOffload(other, local.worker, local.arena)
    finally:
        backend.close()
        local.close()


def test_cancel_settles_a_job_never_submitted_and_it_can_never_run(setup):
    kv, local = setup
    off, worker = local.offloader, local.worker
    (key,) = prefix_block_keys(np.arange(BS), BS)
    job = off.schedule_store("r", [key], [2])
    assert not off.is_settled("r")
    assert worker.cancel(off.abort("r")) == [job.job_id]
    before = Snapshot(local, kv)
    with pytest.raises(ValueError, match="already submitted or cancelled"):
        worker.submit(job)
    assert before.unchanged()
    (result,) = worker.get_finished()
    assert result.cancelled and not result.ok
    off.complete([result])
    assert off.is_settled("r") and off.lookup([key]) == 0
    assert off.index.num_free == off.num_slots


class RefusingBackend(HostBackend):
    def submit_checked(self, specs, **kw):
        raise ValueError("the backend refused the job")


def test_a_backend_refusal_leaves_the_job_cancellable(setup):
    kv, local = setup
    off = local.offloader
    worker = TransferWorker(RefusingBackend(local.worker.backend.layout, local.arena), off)
    (key,) = prefix_block_keys(np.arange(BS), BS)
    job = off.schedule_store("r", [key], [2])
    before = Snapshot(local, kv)
    with pytest.raises(ValueError, match="the backend refused the job"):
        worker.submit(job)
    assert before.unchanged()
    assert worker.cancel(off.abort("r")) == [job.job_id]
    off.complete(worker.get_finished())
    assert off.is_settled("r") and off.index.num_free == off.num_slots
    worker.close()


def test_a_job_cannot_change_after_it_was_checked(setup):
    """The worker runs a job without checking it again: its block and slot ids are read-only."""
    _kv, local = setup
    (key,) = prefix_block_keys(np.arange(BS), BS)
    job = local.offloader.schedule_store("r", [key], [2])
    for ids in (job.specs[0].slots, job.specs[0].blocks):
        with pytest.raises(ValueError, match="read-only"):
            ids[0] = 99
    run(local, job)
    assert local.offloader.lookup([key]) == 1


# -- the load deadline ---------------------------------------------------------------------------


class BlockingBackend(HostBackend):
    """The host backend, with loads held at a gate until the test opens it; then real bytes."""

    def __init__(self, layout, arena):
        super().__init__(layout, arena)
        self.gate = threading.Event()
        self.started = threading.Event()

    def copy(self, specs):
        if specs[0].direction == "load":
            self.started.set()
            assert self.gate.wait(60)
        super().copy(specs)


def gated_local(kv, timeout_s: float, host_blocks: int = 4) -> tuple[LocalOffload, BlockingBackend]:
    layout = layout_of(kv)
    config = OffloadConfig(host_capacity_blocks=host_blocks, load_timeout_s=timeout_s)
    local = build_local(layout, config)
    local.worker.backend.close()
    backend = BlockingBackend(layout, local.arena)
    local.worker = TransferWorker(backend, local.offloader, config.load_timeout_s)
    return local, backend


def test_a_stuck_load_fails_at_its_deadline_and_holds_its_blocks_until_it_ends(caplog):
    kv = make_kv()
    local, backend = gated_local(kv, timeout_s=0.2)
    off, worker = local.offloader, local.worker
    keys = prefix_block_keys(np.arange(2 * BS), BS)
    try:
        run(local, off.schedule_store("s", keys, [1, 2]))
        want = block(kv, 1) + block(kv, 2)
        caplog.set_level(logging.ERROR, logger="kvoffload.offload.worker")
        first = off.schedule_load("a", keys[:1], [10])
        second = off.schedule_load("b", keys[1:], [11])
        worker.submit(first)
        worker.submit(second)
        assert backend.started.wait(10)
        assert worker.wait([first.job_id, second.job_id], timeout=30) == set()  # at the deadline
        early = worker.get_finished()
        assert {(r.job_id, r.ok, r.timed_out, r.final) for r in early} == {
            (first.job_id, False, True, False),
            (second.job_id, False, True, False),
        }
        assert "TimeoutError" in (early[0].error or "")
        assert [j.job_id for j in off.complete(early)] == [r.job_id for r in early]
        # Reported failed, but the copies may still write: nothing is released.
        assert not off.is_settled("a") and not off.is_settled("b")
        assert off.index.num_pinned == 2 and off.in_flight() == {first.job_id, second.job_id}
        assert off.snapshot()["loads_late"] == 2
        # The pinned slots survive a store that needs every free slot and more.
        more = prefix_block_keys(np.arange(1000, 1000 + 4 * BS), BS)
        job = off.schedule_store("c", more, [3, 4, 5, 6])
        assert job is not None and len(job.keys) == 2  # only the 2 unpinned slots were free
        worker.submit(job)  # queued behind the stuck loads (one copy thread): cancel it
        assert worker.cancel(off.abort("c")) == [job.job_id]
        assert off.lookup(keys) == 2
        off.complete(worker.get_finished())  # the cancelled store; no second report of a load
        assert off.is_settled("c") and off.in_flight() == {first.job_id, second.job_id}
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "load_timeout_s=0.2" in errors[0].getMessage()

        backend.gate.set()  # the copies end now, moving the real bytes
        final = collect(worker, {first.job_id, second.job_id})
        assert sorted((r.job_id, r.ok, r.timed_out, r.final) for r in final) == [
            (first.job_id, False, True, True),
            (second.job_id, False, True, True),
        ]
        off.complete(final)
        assert off.is_settled("a") and off.is_settled("b") and off.index.num_pinned == 0
        assert same(block(kv, 10) + block(kv, 11), want)  # what the late copies wrote
        stats = off.index.stats
        assert (stats.loads, stats.load_failures) == (0, 2)  # the engine recomputed both
        assert worker.snapshot()["load"]["timed_out"] == 2
    finally:
        backend.gate.set()
        local.close()


def test_a_load_that_ends_in_time_is_not_a_timeout():
    kv = make_kv()
    local, backend = gated_local(kv, timeout_s=30.0)
    backend.gate.set()
    off = local.offloader
    keys = prefix_block_keys(np.arange(BS), BS)
    try:
        run(local, off.schedule_store("s", keys, [1]))
        (result,) = run(local, off.schedule_load("a", keys, [12]))
        assert result.ok and not result.timed_out and result.final
        assert same(block(kv, 12), block(kv, 1)) and off.is_settled("a")
    finally:
        local.close()
