"""``format``: raw disk I/O with one file per block (create, write, rename; delete on eviction)
against fixed records in a preallocated slab file (pwrite / pread at an offset).

Writes are buffered (what the tier does; the ``sync`` figures add one ``fsync``/``sync`` at the
end), reads are warm (page cache) and cold (pages dropped with ``posix_fadvise(DONTNEED)``), in
random order. Buffered writes run at memory speed only until the kernel's dirty-page limit;
``write_sync_MBps`` includes the ``fsync`` that puts the bytes on the device (the sustained rate).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.bench.tiers.common import drop_cache, lat, mbps, timed


def format_files(root: Path, data: np.ndarray) -> dict[str, Any]:
    n, size = data.shape
    root.mkdir(parents=True, exist_ok=True)

    def write(i: int) -> None:
        tmp, final = root / f"{i}.tmp", root / f"{i}.blk"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, memoryview(data[i]))
        os.close(fd)
        os.replace(tmp, final)

    buf = bytearray(size)

    def read(i: int) -> None:
        fd = os.open(root / f"{i}.blk", os.O_RDONLY)
        os.readv(fd, [buf])
        os.close(fd)

    wt, wl = timed(write, n)
    t0 = time.perf_counter()
    os.sync()
    sync_s = time.perf_counter() - t0
    order = random.Random(0).sample(range(n), n)
    warm, _ = timed(lambda i: read(order[i]), n)
    for i in range(n):
        fd = os.open(root / f"{i}.blk", os.O_RDONLY)
        drop_cache(fd)
        os.close(fd)
    cold, cl = timed(lambda i: read(order[i]), n)
    _, dl = timed(lambda i: os.unlink(root / f"{i}.blk"), n)
    return _format_row(n * size, wt, sync_s, warm, cold, wl, cl, statistics.median(dl) * 1e3)


def format_slab(root: Path, data: np.ndarray) -> dict[str, Any]:
    n, size = data.shape
    root.mkdir(parents=True, exist_ok=True)
    record = -(-(512 + size) // 4096) * 4096
    path = root / "slab.kvs"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.posix_fallocate(fd, 0, n * record)
    head = bytes(512)
    wt, wl = timed(lambda i: os.pwritev(fd, [head, memoryview(data[i])], i * record), n)
    t0 = time.perf_counter()
    os.fsync(fd)
    sync_s = time.perf_counter() - t0
    buf, hbuf = bytearray(size), bytearray(512)
    order = random.Random(0).sample(range(n), n)
    warm, _ = timed(lambda i: os.preadv(fd, [hbuf, buf], order[i] * record), n)
    drop_cache(fd)
    cold, cl = timed(lambda i: os.preadv(fd, [hbuf, buf], order[i] * record), n)
    os.close(fd)
    path.unlink()
    # evicting a slab record is a free-list push: no delete
    return _format_row(n * size, wt, sync_s, warm, cold, wl, cl, 0.0)


def _format_row(
    total: int,
    write_s: float,
    sync_s: float,
    warm_s: float,
    cold_s: float,
    write_lat: list[float],
    cold_lat: list[float],
    delete_ms: float,
) -> dict[str, Any]:
    """One on-disk format's row: MB/s of each phase and the per-block latencies."""
    return {
        "write_MBps": mbps(total, write_s),
        "write_sync_MBps": mbps(total, write_s + sync_s),
        "read_warm_MBps": mbps(total, warm_s),
        "read_cold_MBps": mbps(total, cold_s),
        "write": lat(write_lat),
        "read_cold": lat(cold_lat),
        "evict_delete_ms": delete_ms,
    }
