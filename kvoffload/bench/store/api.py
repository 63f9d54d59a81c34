"""The public API's host cost per transfer (CPU): ``Offloader.schedule_*`` + ``TransferWorker
.submit`` + ``Offloader.complete`` (with ``get_finished``), and ``lookup`` before a load.

The worker runs the host backend copying in the caller's thread (64-byte blocks: real bytes, a
few ns each), so that no thread hand-off is timed. That copy is the data plane, which a real
backend runs off the engine's thread (the host backend's copy thread, the GPU's copy engines):
it is timed on its own (``copy``) and left out of ``api_us``, the Python the engine's thread runs
in our calls. ``total_us`` keeps it in (the figure earlier results reported). Keys come as a list
of bytes with block ids as a list of ints (what engines pass today), and as an (n, 16) uint8 array
with an int64 array of block ids. A least-squares line over the job sizes gives the cost per call
and per block, checked against issue 27's targets (``TARGETS``; ``met``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvoffload.config import OffloadConfig
from kvoffload.offload import TransferWorker, build_local
from kvoffload.store.arena import HostArena
from kvoffload.transfer.backend import CopyBackend, Pending
from kvoffload.transfer.host import HostBackend
from kvoffload.transfer.layout import KVLayout

API_BLOCKS = (1, 16, 256, 1024)
BLOCK_BYTES = 64
PHASES = ("schedule", "submit", "copy", "complete")
# Issue 27: schedule + submit + complete within 15 µs + 0.1 µs per block, lookup 0.05 µs per block;
# issue 25: a layer's wait (``TransferWorker.layer_waiter``'s waiter) within 3 µs
TARGETS = {
    "per_call_us": 15.0,
    "per_block_us": 0.1,
    "lookup_per_block_us": 0.05,
    "layer_wait_us": 3.0,
}
WAIT_LAYERS = 32  # Llama-3-8B's
MakeBackend = Callable[[KVLayout, HostArena], CopyBackend]


class Landed(Pending):
    """A copy that already ran: done, no error."""

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def error(self) -> BaseException | None:
        return None


class InlineHostBackend(HostBackend):
    """The host backend, its copy run at submit in the caller's thread and timed
    (``copy_seconds``: the last one)."""

    copy_seconds = 0.0

    def submit_checked(self, specs: Sequence[Any], **kw: Any) -> Pending:
        t0 = time.perf_counter()
        self.copy(specs)
        self.copy_seconds = time.perf_counter() - t0
        return Landed()


def _keys(rng: np.random.Generator, n: int, kind: str) -> Any:
    rows = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    return rows if kind == "array" else rows.view("V16").ravel().tolist()


def line(blocks: Sequence[int], us: Sequence[float]) -> dict[str, float]:
    """The least-squares line through (blocks, µs): per call (intercept) and per block (slope)."""
    slope, intercept = np.polyfit(blocks, us, 1)
    return {"per_call_us": float(intercept), "per_block_us": float(slope)}


def met(fit: dict[str, float], per_block_target: float, per_call: bool = True) -> dict[str, Any]:
    """``fit`` with ``met``: within the targets (per block only where ``per_call`` is False)."""
    ok = fit["per_block_us"] <= per_block_target
    if per_call:
        ok = ok and fit["per_call_us"] <= TARGETS["per_call_us"]
    return {**fit, "met": bool(ok)}


def inline_host(layout: KVLayout, arena: HostArena) -> CopyBackend:
    """The default backend: the host backend copying in the caller's thread."""
    return InlineHostBackend(layout, arena)


def measure_api(
    blocks: Sequence[int],
    reps: int,
    make_index: Callable[[int, int, str], Any] | None = None,
    kinds: Sequence[str] = ("list", "array"),
    make_backend: MakeBackend = inline_host,
) -> dict[str, Any]:
    """The costs above; ``make_index(num_slots, slot_bytes, policy)`` puts another index with
    ``BlockIndex``'s API under the Offloader (the Python model, for the ratio);
    ``make_backend(layout, arena)`` another backend under the worker (``benchmarks/api_fake.py``:
    the native ``staged`` core over the CPU tests' fake CUDA driver). A backend without
    ``copy_seconds`` copies off the caller's thread: each job is waited for after ``submit``
    (``copy``: submit's return to done), so that nothing copies while the next phase is timed."""
    biggest = max(blocks)
    kv = np.zeros((2 * biggest, BLOCK_BYTES), np.uint8)
    layout = KVLayout.from_tensors([kv], block_size=16, block_dim=0)
    capacity = 2 * (reps + 1) * sum(blocks) + biggest
    local = build_local(layout, OffloadConfig(host_capacity_blocks=capacity))
    off = local.offloader
    if make_index is not None:
        off.index = make_index(off.num_slots, off.slot_bytes, off.config.eviction_policy)
    local.worker.close()
    backend = make_backend(layout, local.arena)
    worker = local.worker = TransferWorker(backend, off)
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"blocks": list(blocks), "block_bytes": BLOCK_BYTES, "targets": TARGETS}
    out["backend"] = backend.name or type(backend).__name__
    for part in ("phases_us", "total_us", "api_us", "total_cpu_us", "lookup_us"):
        out[part] = {}
    try:
        for kind in kinds:
            for n in blocks:
                ids: Any = np.arange(n, dtype=np.int64) if kind == "array" else list(range(n))
                stored = [_keys(rng, n, kind) for _ in range(reps + 1)]
                store = [_one(off, worker, "store", k, ids, r) for r, k in enumerate(stored)]
                load = [_one(off, worker, "load", k, ids, r) for r, k in enumerate(stored)]
                for direction, runs in (("store", store), ("load", load)):
                    name, timed = f"{kind}:{direction}", runs[1:]
                    phases = {p: statistics.median(t[p] for t in timed) for p in timed[0]}
                    phases.pop("cpu")
                    out["phases_us"].setdefault(name, {})[str(n)] = phases
                    total = statistics.median(sum(t[p] for p in PHASES) for t in timed)
                    out["total_us"].setdefault(name, {})[str(n)] = total
                    api = statistics.median(sum(t[p] for p in PHASES if p != "copy") for t in timed)
                    out["api_us"].setdefault(name, {})[str(n)] = api
                    cpu = statistics.median(t["cpu"] for t in timed)
                    out["total_cpu_us"].setdefault(name, {})[str(n)] = cpu
                lookups = [_lookup_us(off, k) for k in stored]
                out["lookup_us"].setdefault(kind, {})[str(n)] = statistics.median(lookups[1:])
    finally:
        local.close()
    out.update(fits(out))
    out["layer_wait"] = measure_layer_waits(reps)
    return out


def measure_layer_waits(reps: int) -> dict[str, Any]:
    """The per-layer wait of a load through ``TransferWorker.layer_waiter`` on the host backend
    (its copy thread, ``WAIT_LAYERS`` layers), every layer landed: the Python of one call (on a
    GPU each call also enqueues one stream wait; ``benchmarks/api_gpu.py`` times that)."""
    kv = [np.zeros((4, BLOCK_BYTES), np.uint8) for _ in range(WAIT_LAYERS)]
    layout = KVLayout.from_tensors(kv, block_size=16, block_dim=0)
    local = build_local(layout, OffloadConfig(host_capacity_blocks=2))
    off, worker = local.offloader, local.worker
    try:
        store = off.schedule_store("s", [b"k" * 16], [0])
        assert store is not None
        worker.submit(store)
        worker.wait([store.job_id])
        off.complete(worker.get_finished())
        load = off.schedule_load("l", [b"k" * 16], [1])
        worker.submit(load)
        worker.wait([load.job_id])  # landed, still in flight: the backend's own waiter
        waiter = worker.layer_waiter(load.job_id)
        per_call = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            for layer in range(WAIT_LAYERS):
                waiter(layer)
            per_call.append((time.perf_counter() - t0) / WAIT_LAYERS * 1e6)
        off.complete(worker.get_finished())
    finally:
        local.close()
    us = statistics.median(per_call[1:])
    return {"layers": WAIT_LAYERS, "per_call_us": us, "met": us <= TARGETS["layer_wait_us"]}


def fits(out: dict[str, Any]) -> dict[str, Any]:
    """Per call + per block lines: ``api_fits`` (what the targets apply to: the engine thread's
    Python, the copy left out), ``fits`` (the copy kept in, as before; cpu_*: this thread's CPU
    time), ``phase_fits`` per phase, ``lookup_fits``; each with ``met``."""
    blocks = out["blocks"]

    def us(by_n: dict[str, float]) -> list[float]:
        return [by_n[str(n)] for n in blocks]

    res: dict[str, Any] = {"api_fits": {}, "fits": {}, "phase_fits": {}, "lookup_fits": {}}
    for name in out["total_us"]:
        res["api_fits"][name] = met(line(blocks, us(out["api_us"][name])), TARGETS["per_block_us"])
        total = met(line(blocks, us(out["total_us"][name])), TARGETS["per_block_us"])
        cpu = line(blocks, us(out["total_cpu_us"][name]))
        total.update({f"cpu_{k}": v for k, v in cpu.items()})
        res["fits"][name] = total
        phases = out["phases_us"][name]
        res["phase_fits"][name] = {
            p: line(blocks, [phases[str(n)][p] for n in blocks]) for p in phases[str(blocks[0])]
        }
    for kind, by_n in out["lookup_us"].items():
        fit = line(blocks, us(by_n))
        res["lookup_fits"][kind] = met(fit, TARGETS["lookup_per_block_us"], per_call=False)
    return res


def _lookup_us(off: Any, keys: Any) -> float:
    t0 = time.perf_counter()
    off.lookup(keys)
    return (time.perf_counter() - t0) * 1e6


def _one(off: Any, worker: Any, direction: str, keys: Any, ids: Any, r: int) -> dict[str, float]:
    """One transfer through the public API, each phase timed (µs; submit without the copy)."""
    req = f"{direction}{r}"
    c0 = time.thread_time()
    t0 = time.perf_counter()
    if direction == "store":
        job = off.schedule_store(req, keys, ids)
    else:
        job = off.schedule_load(req, keys, ids)
    t1 = time.perf_counter()
    worker.submit(job)
    t2 = time.perf_counter()
    copy = getattr(worker.backend, "copy_seconds", None)
    if copy is None:  # copied off this thread: wait for it, untimed but for ``copy``
        c1 = time.thread_time()
        _spin(worker, job.job_id)
        t2w = time.perf_counter()
        copy, c0 = t2w - t2, c0 + time.thread_time() - c1
    else:
        t2w, t2 = t2, t2 - copy
    done = off.complete(worker.get_finished())
    t3 = time.perf_counter()
    cpu = (time.thread_time() - c0) * 1e6
    if len(done) != 1 or not off.is_settled(req):
        raise RuntimeError(f"bench store: {direction} job {job.job_id} did not settle")
    phases = {"schedule": t1 - t0, "submit": t2 - t1, "copy": copy, "complete": t3 - t2w}
    native = getattr(worker.backend, "native_seconds", None)  # of submit, where a backend says
    if native is not None:
        phases["submit_native"] = native
    return {**{p: t * 1e6 for p, t in phases.items()}, "cpu": cpu}


def _spin(worker: Any, job_id: int) -> None:
    """Wait for a job without sleeping: a thread that sleeps ~0.4 ms between calls runs the next
    ones ~2-3x slower on the shared VMs (its core clocks down or is given away; measured with the
    host backend: schedule_store 9.5 us in a loop, 31.5 us with a 0.4 ms sleep between), and the
    host backend's inline copy never sleeps. ``time.sleep(0)`` lets the copying thread have the
    GIL."""
    deadline = time.perf_counter() + 60.0
    while worker.wait([job_id], 0.0):
        if time.perf_counter() > deadline:
            raise RuntimeError(f"bench store: job {job_id} did not finish in 60 s")
        time.sleep(0)
