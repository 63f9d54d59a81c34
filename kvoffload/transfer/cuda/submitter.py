"""The submitter thread: enqueues a backend's copies off the caller's thread, in FIFO order.

Handing a job to a thread that sleeps in the kernel costs the *caller* the wake-up: measured
~93 us per ``submit`` on the lent H100 VM (``submit_parts`` in the benchmark JSON: 134 us with a
sleeping thread, 37 us when nobody waits on the queue). So after each job the thread polls its
queue every ``POLL_INTERVAL`` for ``POLL_WINDOW`` before it blocks: while an engine submits
transfers step after step, ``submit`` never pays the wake-up; after an idle spell the first one
does. The polling costs about one wake-up of this thread per ``POLL_INTERVAL`` while active.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

POLL_INTERVAL = 100e-6  # seconds between looks at the queue while active
POLL_WINDOW = 50e-3  # seconds of polling after the last job before blocking


class Submitter:
    def __init__(self, run: Callable[..., None], device: Any, name: str) -> None:
        self._run = run
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, args=(device,), name=name, daemon=True)
        self._thread.start()

    def put(self, job: tuple[Any, ...]) -> None:
        self._queue.put(job)

    def close(self) -> None:
        """Finish the queued jobs, then stop."""
        self._queue.put(None)
        self._thread.join()

    def _serve(self, device: Any) -> None:
        import torch

        torch.cuda.set_device(device)  # this thread's current context
        idle_since = time.perf_counter()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                if time.perf_counter() - idle_since < POLL_WINDOW:
                    time.sleep(POLL_INTERVAL)
                    continue
                job = self._queue.get()
            if job is None:
                return
            self._run(*job)
            idle_since = time.perf_counter()
