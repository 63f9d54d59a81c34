"""The host's memory bandwidth, measured in the same run as the copies it bounds: a STREAM-like
"copy" of ``nbytes`` split over ``threads`` threads (numpy copies release the GIL).

Each thread first writes its own source and destination (so, under Linux's first-touch rule,
its pages are on the node it runs on, as STREAM's parallel initialisation does), then all copy at
once, ``reps`` times after a warm-up. ``copied_GBps`` counts bytes copied; ``traffic_GBps`` counts
bytes read plus bytes written (STREAM's convention, 2x), which is the figure to compare a link's
bytes against: a store's DMA writes each byte to host memory once and a load's reads it once.
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np


def copy_rate(nbytes: int, threads: int, reps: int) -> dict[str, Any]:
    """One thread count: the median of ``reps`` timed parallel copies."""
    if threads <= 0 or nbytes < threads or reps <= 0:
        raise ValueError(
            f"expected threads > 0, nbytes >= threads and reps > 0, got {threads}, {nbytes}, {reps}"
        )
    part = nbytes // threads
    local = threading.local()  # each pool thread's own buffers, kept across repetitions
    barrier = threading.Barrier(threads)  # holds every task until all run: one per thread

    def init(i: int) -> None:
        barrier.wait()
        local.src = np.full(part, i % 251 + 1, dtype=np.uint8)
        local.dst = np.zeros(part, dtype=np.uint8)

    def copy(_: int) -> bool:
        barrier.wait()
        np.copyto(local.dst, local.src)
        return bool(local.dst[-1] == local.src[-1])

    times = []
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(init, range(threads)))
        for i in range(reps + 1):
            t0 = time.perf_counter()
            if not all(pool.map(copy, range(threads))):
                raise RuntimeError("host memory probe: a copy's last byte differs from its source")
            if i:  # the first is the warm-up
                times.append(time.perf_counter() - t0)
    copied = threads * part / statistics.median(times) / 1e9
    return {
        "threads": threads,
        "bytes": threads * part,
        "copied_GBps": copied,
        "traffic_GBps": 2 * copied,
    }


def probe(nbytes: int, thread_counts: list[int], reps: int) -> dict[str, Any]:
    """Every thread count of ``thread_counts``; ``traffic_GBps`` is the best of them."""
    rows = [copy_rate(nbytes, t, reps) for t in thread_counts]
    return {"rows": rows, "traffic_GBps": max(r["traffic_GBps"] for r in rows)}
