"""FIFO submission of one direction's transfers: on a thread that sleeps when idle, or inline.

A job may be enqueued in the caller's thread when nothing of that direction is queued or being
enqueued and the backend allows it (``inline_bytes``; the default sends every job to the thread,
see ``base.INLINE_BYTES`` for the measurement). Other jobs go to the lane's thread, which
sleeps on a condition when it has nothing to do: an idle backend costs no host time at all (no
polling). An earlier version polled its queue every 100 us for 50 ms after each job to spare the
caller the wake-up; while an engine ran that meant ~10,000 wake-ups a second, each taking the GIL
from the engine's own Python thread (see docs/transfer.md, "Host time").
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any


class Submitter:
    def __init__(self, run: Callable[..., None], device: Any, name: str) -> None:
        self._run = run
        self._device = device
        self._name = name
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._jobs: collections.deque[tuple[Any, ...]] = collections.deque()
        self._busy = False  # a job is being enqueued (inline or by the thread), or jobs wait
        self._inline = False  # the job being enqueued runs in a caller's thread
        self._closed = False
        self._thread: threading.Thread | None = None
        self.inline_jobs = 0  # how many jobs ran in the caller's thread (for the benchmark)
        self.thread_jobs = 0

    def put(self, job: tuple[Any, ...], inline: bool = True) -> None:
        """Run ``job`` (``run(*job)``) after every job put before it: in this thread when the lane
        is idle and ``inline``, else on the lane's thread."""
        with self._lock:
            if self._closed:
                raise ValueError(f"{self._name}: expected an open submitter, got a closed one")
            run_here = inline and not self._busy
            self._busy = True
            if not run_here:
                self._jobs.append(job)
                if not self._inline:  # else the inline runner hands over when it is done
                    self._start_or_wake()
                return
            self._inline = True
        self.inline_jobs += 1
        try:
            self._run(*job)
        finally:
            with self._lock:  # jobs queued meanwhile (other threads) go to the lane's thread
                self._inline = False
                if self._jobs:
                    self._start_or_wake()
                else:
                    self._busy = False

    def close(self) -> None:
        """Finish the queued jobs, then stop the thread (if one was started)."""
        with self._lock:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _start_or_wake(self) -> None:  # called with the lock held
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()
        else:
            self._wake.notify()

    def _serve(self) -> None:
        import torch

        torch.cuda.set_device(self._device)  # this thread's current context
        while True:
            with self._lock:
                while not self._jobs and not self._closed:
                    self._wake.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            self.thread_jobs += 1
            self._run(*job)
            with self._lock:
                if not self._jobs:
                    self._busy = False
