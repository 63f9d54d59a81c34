"""Only the results the worker reported count: a forged or early result never makes a key readable.

Found through the public API: ``complete`` accepted a result for a store never submitted (a forged
``ok=True`` made a key readable whose slot held zeros, and a later load returned ok with wrong
bytes), and a ``final=False`` result for a store (the real result was then dropped: the store was
lost). Each test checks the bytes a load returns against the engine block the key was stored from.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvoffload import KVLayout, OffloadConfig, build_local, prefix_block_keys
from kvoffload.offload import JobResult, LocalOffload, TransferWorker
from kvoffload.transfer.host import HostBackend

BLOCKS, PAGE = 16, 256


class StoreGate(HostBackend):
    """The host backend with stores held at a gate until the test opens it; then real bytes."""

    def __init__(self, layout: KVLayout, arena) -> None:
        super().__init__(layout, arena)
        self.gate = threading.Event()
        self.started = threading.Event()

    def copy(self, specs):
        if specs[0].direction == "store":
            self.started.set()
            assert self.gate.wait(60)
        super().copy(specs)


@pytest.fixture
def engine():
    kv = np.random.default_rng(7).integers(0, 256, (BLOCKS, PAGE), dtype=np.uint8)
    layout = KVLayout.from_tensors([kv], block_size=16, block_dim=0)
    local = build_local(layout, OffloadConfig(host_capacity_blocks=4))
    local.worker.close()
    backend = StoreGate(layout, local.arena)
    local.worker = TransferWorker(backend, local.offloader)
    yield kv, local, backend
    backend.gate.set()
    local.close()


def finish(local: LocalOffload, job_id: int) -> list[JobResult]:
    assert local.worker.wait([job_id], 30) == set()
    return local.worker.get_finished()


def load_bytes(kv: np.ndarray, local: LocalOffload, key: bytes, dst: int) -> np.ndarray:
    job = local.offloader.schedule_load("reader", [key], [dst])
    local.worker.submit(job)
    (result,) = finish(local, job.job_id)
    assert result.ok
    local.offloader.complete([result])
    out: np.ndarray = kv[dst].copy()
    return out


def test_a_forged_ok_never_makes_a_key_readable(engine):
    kv, local, backend = engine
    off, worker = local.offloader, local.worker
    (key,) = prefix_block_keys(np.arange(16), 16)
    job = off.schedule_store("s", [key], [3])
    assert job is not None
    forged = JobResult(job.job_id, True, job.nbytes, 0.0)
    with pytest.raises(ValueError, match=rf"job ids this Offloader submitted, got id\(s\) \[{0}\]"):
        off.complete([forged])  # never submitted
    assert off.lookup([key]) == 0 and not off.is_settled("s")
    worker.submit(job)
    assert backend.started.wait(10)  # the copy runs and has written nothing yet
    with pytest.raises(ValueError, match="that its worker did not report"):
        off.complete([forged])  # submitted, not finished
    assert off.lookup([key]) == 0 and not off.is_settled("s")
    backend.gate.set()
    (real,) = finish(local, job.job_id)
    assert real.ok and real != forged  # the worker's own timing differs from the forgery
    with pytest.raises(ValueError, match="that its worker did not report"):
        off.complete([forged])  # finished: only the reported result counts
    assert off.complete([real]) == [job]
    assert off.lookup([key]) == 1 and off.is_settled("s")
    assert np.array_equal(load_bytes(kv, local, key, 9), kv[3])
    with pytest.raises(ValueError, match=r"unknown id\(s\)"):
        off.complete([real])  # once


def test_a_forged_ok_for_a_failed_copy_leaves_nothing_readable(engine):
    _kv, local, backend = engine
    off = local.offloader
    broken = BrokenStores(backend.layout, local.arena)
    worker = TransferWorker(broken, off)
    (key,) = prefix_block_keys(np.arange(100, 116), 16)
    job = off.schedule_store("s", [key], [5])
    assert job is not None
    worker.submit(job)
    assert worker.wait([job.job_id], 30) == set()
    (real,) = worker.get_finished()
    assert not real.ok
    with pytest.raises(ValueError, match=r"did not report.*1 known"):
        off.complete([JobResult(job.job_id, True, job.nbytes, real.seconds), real])
    assert off.lookup([key]) == 0 and off.is_settled("s")
    assert off.index.num_free == off.num_slots  # the store rolled back
    worker.close()


class BrokenStores(HostBackend):
    def copy(self, specs):
        raise OSError("the copy failed")


def test_a_not_final_result_for_a_store_is_refused_and_its_real_result_counts(engine):
    kv, local, backend = engine
    off, worker = local.offloader, local.worker
    (key,) = prefix_block_keys(np.arange(200, 216), 16)
    job = off.schedule_store("s", [key], [6])
    assert job is not None
    worker.submit(job)
    early = JobResult(job.job_id, False, 0, 0.1, "TimeoutError", timed_out=True, final=False)
    with pytest.raises(ValueError, match="did not report"):
        off.complete([early])
    assert not off.is_settled("s") and off.snapshot()["loads_late"] == 0
    backend.gate.set()
    (real,) = finish(local, job.job_id)
    assert off.complete([real]) == [job]  # not dropped: the store is kept
    assert off.lookup([key]) == 1
    assert np.array_equal(load_bytes(kv, local, key, 10), kv[6])
