"""``read``: how fast one engine process reads (and writes) the shared tier, against what the
server's GETs alone reach in the same run.

Per target (one server, and with ``--cluster`` a cluster beside it), with blocks stored once:

- ``mover_<T>threads``: the engine's path. A ``TierMover`` with T threads reads every block into a
  host arena in 16-block ops (what a promotion submits), all ops submitted at once; GB/s over
  the wall time from the first submit to the last result, every byte compared afterwards.
- ``client_pipeline``: the path before the tier read values itself (the redis client's pipeline,
  a bytes object per value, then a copy into the slot), 2 threads of 16-block batches: the A/B.
- ``put``: the tier's writes, 2 threads of 16-block batches.
- ``server_get_limit`` (one server): raw pipelined GETs of the same values on 2 connections, 16 in
  flight on each, each read into its own arena row (as the tier's land) and nothing checked; and
  ``redis-benchmark`` GETs of one value of the same size (``-P 16``, 2 clients, one value read
  again and again: hot in the caches) where its binary is on PATH.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import threading
import time
from typing import Any

import numpy as np

from kvoffload.bench.tiers.common import BATCH, FP, keys, mbps
from kvoffload.offload.tiers import TierMover, TierOp
from kvoffload.store.arena import HostArena
from kvoffload.store.tiers import resp
from kvoffload.store.tiers.valkey import ValkeyTier

MOVER_THREADS = (1, 2, 4)
LIMIT_CONNECTIONS = 2


def read_round(urls: dict[str, str], data: np.ndarray) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for target, url in urls.items():
        tier = ValkeyTier(url, FP, data.shape[1], ttl_s=600, timeout_s=5.0, namespace=_namespace())
        try:
            out[target] = _target(tier, data, limit=target == "one_server")
        finally:
            tier.discard(keys(len(data), "read"))
            tier.close()
    return out


def _namespace() -> str:
    return "bench-read-" + secrets.token_hex(4)


def _target(tier: ValkeyTier, data: np.ndarray, limit: bool) -> dict[str, Any]:
    n, size = data.shape
    ks = keys(n, "read")
    views = [memoryview(row) for row in data]
    row: dict[str, Any] = {"blocks": n, "block_bytes": size}
    row["put_MBps"] = mbps(n * size, _two_threads(tier.put, ks, views))
    arena = HostArena(n, size)
    try:
        for threads in MOVER_THREADS:
            arena.slots[:] = 0
            row[f"mover_{threads}threads_MBps"] = mbps(n * size, _mover(tier, arena, ks, threads))
            if not np.array_equal(arena.slots, data):
                raise RuntimeError("bench tiers read: the mover read different bytes")
        arena.slots[:] = 0
        outs = [memoryview(r) for r in arena.slots]
        row["client_pipeline_MBps"] = mbps(
            n * size, _two_threads(lambda k, o: _via_client(tier, k, o), ks, outs)
        )
        if not np.array_equal(arena.slots, data):
            raise RuntimeError("bench tiers read: the client pipeline read different bytes")
        if limit and tier.endpoint.seeds:  # a TCP server (not a unix socket)
            names = [tier.key_name(k) for k in ks]
            row["server_get_limit_MBps"] = _raw_get_mbps(tier, names, arena.slots)
            row["redis_benchmark_get_MBps"] = _redis_benchmark(tier, size)
    finally:
        arena.close()
    return row


def _mover(tier: ValkeyTier, arena: HostArena, ks: list[bytes], threads: int) -> float:
    mover = TierMover(arena, [tier], threads)
    ops = [
        TierOp(i, "read", tier.name, tuple(ks[s : s + BATCH]), tuple(range(s, s + BATCH)))
        for i, s in enumerate(range(0, len(ks), BATCH))
    ]
    t0 = time.perf_counter()
    for op in ops:
        mover.submit(op)
    mover.wait_idle()
    seconds = time.perf_counter() - t0
    results = mover.get_finished()
    for pool in mover._pools.values():  # not mover.close(): that closes the tier too
        pool.shutdown()
    if not all(all(r.ok) for r in results):
        raise RuntimeError(f"bench tiers read: blocks missing ({tier.stats.snapshot()})")
    return seconds


def _via_client(tier: ValkeyTier, ks: list[bytes], outs: list[memoryview]) -> list[bool]:
    """The former read path: the client's pipeline returns bytes, copied into the slots."""
    replies = tier._pipeline([("getex", (tier.key_name(k),), {"ex": 600}) for k in ks], "get")
    if replies is None:
        return [False] * len(ks)
    return [tier._accept(k, v, o) for k, v, o in zip(ks, replies, outs, strict=True)]


def _two_threads(fn: Any, ks: list[bytes], bufs: list[memoryview]) -> float:
    def part(p: int) -> None:
        for s in range(p * BATCH, len(ks), 2 * BATCH):
            if not all(fn(ks[s : s + BATCH], bufs[s : s + BATCH])):
                raise RuntimeError("bench tiers read: a batch failed")

    threads = [threading.Thread(target=part, args=(p,)) for p in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _raw_get_mbps(tier: ValkeyTier, names: list[bytes], dest: np.ndarray) -> float:
    """Pipelined GETs on ``LIMIT_CONNECTIONS`` plain sockets, each value read into its row of
    ``dest`` (an arena, as the tier's reads land) and nothing checked."""
    host, port = tier.endpoint.seeds[0]
    total = [0] * LIMIT_CONNECTIONS

    def conn(c: int) -> None:
        sock = socket.create_connection((host, port), timeout=10)
        with sock:
            reader = resp.Reader(sock)
            mine = list(range(c, len(names), LIMIT_CONNECTIONS))
            for s in range(0, len(mine), BATCH):
                batch = mine[s : s + BATCH]
                sock.sendall(b"".join(resp.pack(b"GET", names[i]) for i in batch))
                for i in batch:
                    n = int(reader.line()[1:])
                    row = memoryview(dest[i])
                    reader.into(row[: min(n, len(row))])
                    reader.skip(n - min(n, len(row)))
                    reader.crlf()
                    total[c] += n

    threads = [threading.Thread(target=conn, args=(c,)) for c in range(LIMIT_CONNECTIONS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return mbps(sum(total), time.perf_counter() - t0)


def _redis_benchmark(tier: ValkeyTier, size: int) -> float | None:
    """GETs of one ``size``-byte value by ``redis-benchmark`` (``valkey-benchmark``), or None."""
    binary = shutil.which("valkey-benchmark") or shutil.which("redis-benchmark")
    if binary is None:
        return None
    host, port = tier.endpoint.seeds[0]
    requests = max(32, (256 << 20) // size)
    command = [binary, "-h", host, "-p", str(port), "-t", "set,get", "-d", str(size)]
    done = subprocess.run(
        [*command, "-n", str(requests), "-P", "16", "-c", "2", "--csv"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    for line in done.stdout.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if cells and cells[0] == "GET":
            return float(cells[1]) * size / 1e6
    return None
