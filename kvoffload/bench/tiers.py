"""``kvoffload bench tiers``: lower-tier throughput and latency on this machine, and the two design
choices they decided, measured side by side in one run.

At the Llama-3-8B block sizes (block size 16, bf16): a whole host slot (2 MiB, every layer's K and
V) and one layer's K+V page (64 KiB). Every section is repeated ``--rounds`` times, its variants
interleaved inside each round, and the median round is reported.

- ``format``: raw disk I/O with one file per block (create, write, rename; delete on eviction)
  against fixed records in a preallocated slab file (pwrite / pread at an offset). Writes are
  buffered (what the tier does; ``+sync`` adds one ``fsync``/``sync`` at the end), reads are
  warm (page cache) and cold (pages dropped with ``posix_fadvise(DONTNEED)``), in random order.
  Buffered writes run at memory speed only until the kernel's dirty-page limit; ``flushed``
  figures include the ``fsync`` that puts the bytes on the device (the sustained rate).
- ``disk`` and ``valkey``: the real tiers, ``put``/``get`` of one block per call (latency p50/p99)
  and of 16-block batches from 2 threads (throughput, as the mover drives them). Valkey runs on
  loopback (started here unless ``--valkey-url`` is given), so this is its best case: a network
  hop adds its round trip per batch.
- ``policy``: a full host tier streaming stores: write-behind (the implementation) against
  demote-on-evict (the evicted blocks are written to disk before their slots take the new store),
  as the engine sees it: store settle time per 16-block job, and the blocks that reached disk;
  back to back (stores as fast as the host copy goes) and, for write-behind, paced at
  ``PACE_MBPS`` (an engine whose prefill produces KV at that rate).
- ``sharing`` (``--cluster``; not in the default sections): ``--processes`` engine processes
  sharing prefixes through one server and through a cluster (3 primaries + 3 replicas started
  here unless ``--cluster-url`` is given), side by side: hit rate, MB/s, get latency per block
  (``tiers_sharing.py``).

A missing client, server or an unreachable ``--valkey-url`` ends the run with one line on stderr
and exit status 1, before anything is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import logging
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.bench.common import console, default_out, machine_info, progress, write_json

SIZES = {"slot_2MiB": 2 << 20, "page_64KiB": 64 << 10}  # Llama-3-8B, block size 16, bf16
FP = "0123456789abcdef0123456789abcdef"
SECTIONS = ("format", "disk", "valkey", "policy", "sharing")
DEFAULT_SECTIONS = ("format", "disk", "valkey", "policy")
BATCH = 16
PACE_MBPS = 200  # the paced policy run: stores at this rate, under the disk's sustained writes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure")
    p.add_argument("--valkey-url", default=None, help="server to use (default: start one)")
    p.add_argument("--mib", type=int, default=256, help="MiB moved per size and variant")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions")
    p.add_argument(
        "--sections",
        default=",".join(DEFAULT_SECTIONS),
        help=f"comma separated, from {','.join(SECTIONS)} (default: %(default)s)",
    )
    p.add_argument(
        "--cluster",
        action="store_true",
        help="only the sharing section: processes sharing prefixes, one server vs a cluster",
    )
    p.add_argument(
        "--cluster-url",
        default=None,
        help="redis+cluster://host:port,... for the sharing section (default: start one here)",
    )
    p.add_argument("--processes", type=int, default=4, help="sharing section: engine processes")
    p.add_argument("--out", type=Path, default=None, help="JSON result path")


# -- helpers -----------------------------------------------------------------------------------


def _blocks(n: int, size: int) -> np.ndarray:
    return np.random.default_rng(size).integers(0, 256, (n, size), dtype=np.uint8)


def _keys(n: int, tag: str) -> list[bytes]:
    return [f"{tag}:{i}".encode().ljust(16, b".") for i in range(n)]


def _mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def _lat(times: list[float]) -> dict[str, float]:
    arr = np.asarray(times) * 1e3
    return {"p50_ms": float(np.percentile(arr, 50)), "p99_ms": float(np.percentile(arr, 99))}


def _timed(fn: Callable[[int], object], n: int) -> tuple[float, list[float]]:
    each = []
    start = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        each.append(time.perf_counter() - t0)
    return time.perf_counter() - start, each


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per numeric field, the median over rounds (nested dicts too)."""
    out: dict[str, Any] = {}
    for key, first in rounds[0].items():
        values = [r[key] for r in rounds]
        if isinstance(first, dict):
            out[key] = _median_round(values)
        elif isinstance(first, (int, float)):
            out[key] = statistics.median(values)
        else:
            out[key] = first
    return out


def _drop_cache(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _fs_of(path: Path) -> dict[str, str]:
    best = ("", "", "", "")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype, opts = line.split()[:4]
            if str(path.resolve()).startswith(mnt) and len(mnt) >= len(best[1]):
                best = (dev, mnt, fstype, opts)
    return {"device": best[0], "mount": best[1], "fstype": best[2], "options": best[3]}


# -- format: one file per block vs slab ---------------------------------------------------------


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

    wt, wl = _timed(write, n)
    t0 = time.perf_counter()
    os.sync()
    sync_s = time.perf_counter() - t0
    order = random.Random(0).sample(range(n), n)
    warm, _ = _timed(lambda i: read(order[i]), n)
    for i in range(n):
        fd = os.open(root / f"{i}.blk", os.O_RDONLY)
        _drop_cache(fd)
        os.close(fd)
    cold, cl = _timed(lambda i: read(order[i]), n)
    _, dl = _timed(lambda i: os.unlink(root / f"{i}.blk"), n)
    return _format_row(n * size, wt, sync_s, warm, cold, wl, cl, statistics.median(dl) * 1e3)


def format_slab(root: Path, data: np.ndarray) -> dict[str, Any]:
    n, size = data.shape
    root.mkdir(parents=True, exist_ok=True)
    record = -(-(512 + size) // 4096) * 4096
    path = root / "slab.kvs"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.posix_fallocate(fd, 0, n * record)
    head = bytes(512)
    wt, wl = _timed(lambda i: os.pwritev(fd, [head, memoryview(data[i])], i * record), n)
    t0 = time.perf_counter()
    os.fsync(fd)
    sync_s = time.perf_counter() - t0
    buf, hbuf = bytearray(size), bytearray(512)
    order = random.Random(0).sample(range(n), n)
    warm, _ = _timed(lambda i: os.preadv(fd, [hbuf, buf], order[i] * record), n)
    _drop_cache(fd)
    cold, cl = _timed(lambda i: os.preadv(fd, [hbuf, buf], order[i] * record), n)
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
        "write_MBps": _mbps(total, write_s),
        "write_sync_MBps": _mbps(total, write_s + sync_s),
        "read_warm_MBps": _mbps(total, warm_s),
        "read_cold_MBps": _mbps(total, cold_s),
        "write": _lat(write_lat),
        "read_cold": _lat(cold_lat),
        "evict_delete_ms": delete_ms,
    }


# -- the real tiers -----------------------------------------------------------------------------


def tier_round(
    make: Callable[[int], Any], data: np.ndarray, cold: Callable[[Any], None]
) -> dict[str, Any]:
    """One round on a fresh tier: per-block put/get latency, then 2-thread batched throughput."""
    n, size = data.shape
    tier = make(size)
    views = [memoryview(row) for row in data]
    out = np.empty_like(data)
    outs = [memoryview(row) for row in out]
    ka, kb = _keys(n, "one"), _keys(n, "batch")
    pt, pl = _timed(lambda i: _all(tier.put([ka[i]], [views[i]]), tier, "put"), n)
    flush = _seconds(lambda: cold(tier))  # disk: until the bytes are on the device
    gt, gl = _timed(lambda i: _all(tier.get([ka[i]], [outs[i]]), tier, "get"), n)
    if not np.array_equal(out, data):
        raise RuntimeError(f"bench tiers: {tier.name} returned different bytes")

    def threaded(
        fn: Callable[[list[bytes], list[memoryview]], list[bool]], bufs: list[memoryview]
    ) -> float:
        def part(p: int) -> None:
            for s in range(p * BATCH, n, 2 * BATCH):
                _all(fn(kb[s : s + BATCH], bufs[s : s + BATCH]), tier, "batch")

        threads = [threading.Thread(target=part, args=(p,)) for p in range(2)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    bput = threaded(tier.put, views)
    bflush = _seconds(lambda: cold(tier))
    out[:] = 0
    bget = threaded(tier.get, outs)
    if not np.array_equal(out, data):
        raise RuntimeError(f"bench tiers: {tier.name} returned different bytes (batched)")
    tier.close()
    total = n * size
    return {
        "put_MBps": _mbps(total, pt),
        "put_flushed_MBps": _mbps(total, pt + flush),
        "get_MBps": _mbps(total, gt),
        "put_batched_2threads_MBps": _mbps(total, bput),
        "put_batched_2threads_flushed_MBps": _mbps(total, bput + bflush),
        "get_batched_2threads_MBps": _mbps(total, bget),
        "put": _lat(pl),
        "get": _lat(gl),
    }


def _all(ok: list[bool], tier: Any, what: str) -> None:
    """A tier that drops blocks mid-run (a server gone, out of memory) ends the run clearly."""
    if not all(ok):
        raise Fatal(
            f"the {tier.name} tier lost a {what} mid-run ({tier.stats.snapshot()}); is the "
            "server down or short of memory (maxmemory)?"
        )


class Fatal(SystemExit):
    """One line on stderr and exit status 1 (SystemExit prints its message)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"kvoffload bench tiers: {message}")


def disk_cold(tier: Any) -> None:
    for fd in tier._fds:
        _drop_cache(fd)


# -- policy: write-behind vs demote-on-evict ----------------------------------------------------


def policy_round(
    root: Path, size: int, host_blocks: int, jobs: int, demote: bool, pace_mbps: float = 0.0
) -> dict[str, Any]:
    from kvoffload.config import OffloadConfig
    from kvoffload.offload.local import build_local
    from kvoffload.store.keys import prefix_block_keys
    from kvoffload.transfer.layout import KVLayout

    kv = [np.random.default_rng(1).integers(0, 256, (BATCH * 2, size), dtype=np.uint8)]
    layout = KVLayout.from_tensors(kv, block_size=16, block_dim=0)
    config = OffloadConfig(
        host_capacity_blocks=host_blocks,
        model_id="bench",
        disk_path=str(root),
        disk_capacity_bytes=(jobs * BATCH + 8) * (size + 8192),
    )
    local = build_local(layout, config)
    off, worker = local.offloader, local.worker
    assert off.lower is not None and local.mover is not None
    disk = local.mover.tiers["disk"]
    if demote:  # nothing is written behind: blocks go down only when evicted
        off.lower.names = []
    keys = prefix_block_keys(np.arange(jobs * BATCH * 16), 16)
    settle = []
    t_all = time.perf_counter()
    for j in range(jobs):
        batch = keys[j * BATCH : (j + 1) * BATCH]
        t0 = time.perf_counter()
        if demote:
            need = len(batch) - off.index.num_free
            if need > 0:  # write the victims out, holding their slots, then free them
                free = (k for k in off.index.policy.candidates() if not off.index.readers(k))
                victims = list(itertools.islice(free, need))
                slots = off.index.prepare_load(victims)  # held until written
                disk.put(victims, [memoryview(local.arena.slots[s]) for s in slots.tolist()])
                off.index.complete_load(victims)
                off.index.remove(victims)
        job = off.schedule_store("r", batch, list(range((j % 2) * BATCH, (j % 2 + 1) * BATCH)))
        if job is not None:
            worker.submit(job)
            worker.wait([job.job_id], 60)
            off.complete(worker.get_finished())
        settle.append(time.perf_counter() - t0)
        if pace_mbps:  # an engine that produces KV at pace_mbps, not back to back
            due = t_all + (j + 1) * BATCH * size / (pace_mbps * 1e6)
            time.sleep(max(0.0, due - time.perf_counter()))
    elapsed = time.perf_counter() - t_all
    off.drain_tiers(120)
    on_disk = sum(bool(c) for c in disk.contains(keys))
    stored = off.index.stats.stores
    local.close()
    return {
        "store_settle": _lat(settle),
        "stores_MBps": _mbps(stored * size, elapsed),
        "blocks_stored": stored,
        "blocks_on_disk": on_disk,
        "blocks": len(keys),
    }


# -- run ----------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    sections = ["sharing"] if args.cluster else [x.strip() for x in args.sections.split(",")]
    sections = [x for x in sections if x]
    if not set(sections) <= set(SECTIONS) or args.mib <= 0 or args.rounds <= 0:
        raise Fatal(
            f"expected --sections from {list(SECTIONS)}, --mib > 0 and --rounds > 0, got "
            f"{args.sections!r}, {args.mib}, {args.rounds}"
        )
    if args.processes <= 0:
        raise Fatal(f"expected --processes > 0, got {args.processes}")
    shared = {"valkey", "sharing"} & set(sections)
    if shared and importlib.util.find_spec("redis") is None:
        raise Fatal(
            f"the {'/'.join(sorted(shared))} section needs the redis client: pip install -e "
            "'.[tiers]' in a checkout (or leave it out: --sections format,disk,policy)"
        )
    base = Path(tempfile.mkdtemp(prefix="kvoffload-bench-tiers-", dir=args.dir))
    result: dict[str, Any] = {"benchmark": "tiers", **machine_info(), "dir_fs": _fs_of(base)}
    result["params"] = {"mib": args.mib, "rounds": args.rounds, "batch_blocks": BATCH}
    try:
        with contextlib.ExitStack() as stack:
            urls = _servers(stack, sections, args, result) if shared else {}
            with progress() as bar:
                task = bar.add_task("tiers", total=len(sections) * len(SIZES) * args.rounds)
                for section in sections:
                    result[section] = {}
                    for label, size in SIZES.items():
                        bar.update(task, description=f"{section} {label}")
                        rounds = []
                        for r in range(args.rounds):
                            where = base / f"{section}-{label}-{r}"
                            rounds.append(_section(section, where, size, args, urls))
                            bar.advance(task)
                        result[section][label] = _median_round(rounds)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    _print(result)
    out = args.out or default_out("tiers", "cpu")
    console.print(f"wrote {write_json(out, result)}")
    return 0


def _servers(
    stack: contextlib.ExitStack,
    sections: list[str],
    args: argparse.Namespace,
    result: dict[str, Any],
) -> dict[str, str]:
    """The server (and, for sharing, the cluster) to measure: given, or started here and stopped
    by ``stack``. Each is checked once: unreachable or refusing is a ``Fatal`` now."""
    import redis
    from redis.utils import HIREDIS_AVAILABLE

    from kvoffload.store.tiers.local_server import LocalCluster, LocalServer, server_binary

    result["valkey_client"] = {"redis": redis.__version__, "hiredis": HIREDIS_AVAILABLE}
    urls = {"one_server": args.valkey_url}
    if "sharing" in sections:
        urls["cluster"] = args.cluster_url
    for name, url in urls.items():
        if url is None:
            try:
                started = LocalCluster() if name == "cluster" else LocalServer()
            except FileNotFoundError as e:
                raise Fatal(f"{e}; or give --valkey-url / --cluster-url of a running one") from None
            stack.enter_context(started)
            urls[name] = started.url
            shape = "3 primaries + 3 replicas" if name == "cluster" else "one server"
            result[f"valkey_{name}"] = f"{server_binary()}, {shape} on loopback (started here)"
        _reachable(urls[name])
    return {k: v for k, v in urls.items() if v is not None}


def _reachable(url: str) -> None:
    from kvoffload.store.tiers.base import TierStartupError
    from kvoffload.store.tiers.valkey import ValkeyTier

    quiet = logging.getLogger("kvoffload.store.tiers.valkey")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the one line below says it; not the tier's warning too
    try:
        tier = ValkeyTier(url, FP, 4096, timeout_s=5.0)
    except (TierStartupError, ValueError) as e:
        raise Fatal(str(e)) from None
    finally:
        quiet.setLevel(level)
    up = tier.up
    tier.close()
    if not up:
        raise Fatal(f"valkey at {url} is unreachable; start it, or give another URL")


def _section(
    section: str, root: Path, size: int, args: argparse.Namespace, urls: dict[str, str]
) -> dict[str, Any]:
    if section == "sharing":
        from kvoffload.bench.tiers_sharing import run_sharing

        total = args.mib << 20
        return {
            target: run_sharing(url, size, total, args.processes) for target, url in urls.items()
        }
    n = max(BATCH * 2, (args.mib << 20) // size)
    data = _blocks(n, size)
    if section == "format":
        files = format_files(root / "files", data)
        slab = format_slab(root / "slab", data)
        return {"file_per_block": files, "slab": slab}
    if section == "disk":
        from kvoffload.store.tiers.disk import DiskTier, record_bytes_for

        cap = (3 * n + 8) * record_bytes_for(size)
        return tier_round(lambda b: DiskTier(root, FP, b, cap), data, disk_cold)
    if section == "valkey":
        from kvoffload.store.tiers.valkey import ValkeyTier

        url = urls["one_server"]
        return tier_round(
            lambda b: ValkeyTier(url, FP, b, ttl_s=600, timeout_s=5.0), data, lambda t: None
        )
    host = max(BATCH * 4, n // 4)  # a host tier a quarter of what streams through it
    jobs = max(8, 2 * n // BATCH)  # twice the blocks of the other sections
    return {
        "write_behind": policy_round(root / "wb", size, host, jobs, demote=False),
        "demote_on_evict": policy_round(root / "de", size, host, jobs, demote=True),
        f"write_behind_paced_{PACE_MBPS}MBps": policy_round(
            root / "wbp", size, host, jobs, demote=False, pace_mbps=PACE_MBPS
        ),
    }


def _print(result: dict[str, Any]) -> None:
    from rich.table import Table

    for section in SECTIONS:
        if section not in result:
            continue
        table = Table(title=f"tiers: {section} (median of rounds)")
        table.add_column("size")
        table.add_column("variant")
        table.add_column("numbers")
        for label, row in result[section].items():
            variants = (
                row.items() if section in ("format", "policy", "sharing") else [("tier", row)]
            )
            for name, numbers in variants:
                flat = ", ".join(
                    f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in _flatten(numbers).items()
                )
                table.add_row(label, name, flat)
        console.print(table)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
