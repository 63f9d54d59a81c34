"""The CUDA backends' submitter without a GPU: jobs run in FIFO order, inline in the caller's
thread when the lane is idle, on the lane's thread otherwise, and no thread exists (or wakes)
while nothing needs one."""

from __future__ import annotations

import threading

import pytest

from kvoffload.transfer.cuda import submitter as sub


@pytest.fixture(autouse=True)
def no_cuda_device(monkeypatch):
    """The lane thread sets its CUDA device first; without a GPU, make that a no-op."""
    import torch

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)


class Recorder:
    def __init__(self) -> None:
        self.order: list[int] = []
        self.threads: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def run(self, n: int) -> None:
        self.entered.set()
        assert self.gate.wait(10)
        self.order.append(n)
        self.threads.append(threading.current_thread().name)


def test_an_idle_lane_runs_jobs_inline_and_starts_no_thread():
    rec = Recorder()
    s = sub.Submitter(rec.run, None, "lane")
    for n in range(5):
        s.put((n,))
    assert rec.order == [0, 1, 2, 3, 4]
    assert set(rec.threads) == {threading.current_thread().name}
    assert s._thread is None and s.inline_jobs == 5
    s.close()


def test_a_large_job_goes_to_the_thread_and_keeps_fifo_order():
    rec = Recorder()
    s = sub.Submitter(rec.run, None, "lane")
    rec.gate.clear()
    s.put((0,), inline=False)  # runs on the thread, held at the gate
    assert rec.entered.wait(10)
    s.put((1,))  # the lane is busy: queued behind job 0, although it could run inline
    s.put((2,))
    rec.gate.set()
    s.close()  # finishes the queued jobs
    assert rec.order == [0, 1, 2]
    assert set(rec.threads) == {"lane"}
    assert s.thread_jobs == 3


def test_jobs_queued_during_an_inline_job_run_on_the_thread_after_it():
    rec = Recorder()
    s = sub.Submitter(rec.run, None, "lane")
    rec.gate.clear()
    caller = threading.Thread(target=s.put, args=((0,),), name="caller")
    caller.start()
    assert rec.entered.wait(10)  # job 0 runs inline in "caller"
    s.put((1,), inline=True)  # another thread submits meanwhile: queued
    rec.gate.set()
    caller.join(10)
    s.close()
    assert rec.order == [0, 1]
    assert rec.threads == ["caller", "lane"]


def test_the_idle_thread_sleeps_instead_of_polling(monkeypatch):
    """After its job the lane thread blocks on its condition: it wakes only when a job arrives."""
    rec = Recorder()
    s = sub.Submitter(rec.run, None, "lane")
    waits = []
    real_wait = s._wake.wait

    def counted_wait(timeout=None):
        waits.append(timeout)
        return real_wait(timeout)

    monkeypatch.setattr(s._wake, "wait", counted_wait)
    s.put((0,), inline=False)
    s.close()
    assert rec.order == [0]
    assert all(t is None for t in waits)  # never a timed (polling) wait
    assert len(waits) <= 2


def test_put_after_close_is_refused():
    s = sub.Submitter(Recorder().run, None, "lane")
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.put((0,))
