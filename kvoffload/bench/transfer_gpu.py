# mypy: disable-error-code="no-untyped-call"
"""``kvoffload bench transfer`` on a GPU: every method side by side, next to the link limit.

One run measures: the link limit (1 GiB contiguous H2D, D2H, both at once; warmed up, repeated,
with the spread); per model shape x engine layout x block size x blocks per transfer, store and
load GB/s of ``staged``, ``dma`` (one descriptor per piece, as vLLM does) and ``sm`` (12 programs,
8 KiB chunks, vLLM's constants), with host submit and enqueue time; store+load at once; the
slowdown of a bf16 8192^3 GEMM stream while each method transfers in both directions (baseline and
loaded windows interleaved); the host time of a cuMemcpyBatchAsync call through ctypes and through
cuda-python. Every transfer's bytes are checked after its round trip.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from kvoffload.bench.common import progress
from kvoffload.bench.gpu_timing import Sleeper, measure_link, spread, time_transfers
from kvoffload.bench.transfer import case_blocks, parse_cases
from kvoffload.store.arena import HostArena
from kvoffload.transfer.cuda.base import CudaBackend
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.pinning import cuda_pin
from kvoffload.transfer.shapes import MODELS, engine_tensors
from kvoffload.transfer.spec import TransferSpec

METHODS = ("staged", "dma", "sm", "auto")
LATENCY_BLOCKS = 16  # transfers up to this many blocks also get a p50/p99 latency


def make(method: str, kv: KVLayout, arena: HostArena) -> Any:
    from kvoffload.transfer.cuda.dma import DmaBackend
    from kvoffload.transfer.cuda.sm import SmBackend
    from kvoffload.transfer.cuda.staged import StagedBackend
    from kvoffload.transfer.registry import make_backend

    if method == "staged":
        return StagedBackend(kv, arena)
    if method == "dma":
        return DmaBackend(kv, arena, merge=False)  # one descriptor per piece, as vLLM does
    if method == "sm":
        return SmBackend(kv, arena)
    if method == "auto":  # the planner, as users get it (calibration table if one was made)
        return make_backend("auto", kv, arena)
    raise ValueError(f"expected a method in {METHODS}, got {method!r}")


def gpu_info() -> dict[str, Any]:
    import triton

    from kvoffload.doctor import staged_enqueue
    from kvoffload.transfer.cuda.driver import CudaDriver

    drv = CudaDriver.load()
    props = torch.cuda.get_device_properties(0)
    try:
        from cuda import bindings

        cuda_python = str(bindings.__version__)
    except ImportError:
        cuda_python = None
    return {
        "device": torch.cuda.get_device_name(),
        "sms": props.multi_processor_count,
        "driver": drv.version,
        "batch_entry_resolved": drv.batch_resolved,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton.__version__,
        "cuda_python": cuda_python,
        "staged_enqueue": staged_enqueue(),
    }


class Engine:
    """One model x layout x block size: random KV tensors on the GPU (bf16, or uint8 bytes for an
    fp8 shape)."""

    def __init__(self, model: str, layout: str, block_size: int, pool: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(1)
        shape = MODELS[model]

        def alloc(s: tuple[int, ...]) -> torch.Tensor:
            if shape.dtype_bytes == 1:
                return torch.randint(0, 256, s, device="cuda", generator=gen, dtype=torch.uint8)
            return torch.randn(s, device="cuda", generator=gen, dtype=torch.bfloat16)

        self.tensors, block_dim = engine_tensors(shape, layout, pool, block_size, alloc)
        self.kv = KVLayout.from_tensors(self.tensors, block_size=block_size, block_dim=block_dim)
        self.block_dim = block_dim
        self.pool = pool

    def slot_images(self, blocks: np.ndarray) -> torch.Tensor:
        """The host slot image of each of ``blocks`` ([n, slot bytes] uint8 on the GPU), built
        with torch indexing by the layout's rule (a block's regions back to back in tensor
        order): the oracle a store is checked against."""
        index = torch.from_numpy(np.asarray(blocks)).cuda()
        return torch.cat(
            [
                t.index_select(self.block_dim, index)
                .movedim(self.block_dim, 0)
                .contiguous()
                .view(torch.uint8)
                .reshape(len(index), -1)
                for t in self.tensors
            ],
            dim=1,
        )

    def same_blocks(self, a: np.ndarray, b: np.ndarray) -> bool:
        ia = torch.from_numpy(a).cuda()
        ib = torch.from_numpy(b).cuda()
        return all(
            torch.equal(
                t.index_select(self.block_dim, ia).view(torch.uint8),
                t.index_select(self.block_dim, ib).view(torch.uint8),
            )
            for t in self.tensors
        )


def submitter(backend: Any, *specs: list[TransferSpec]) -> Callable[[Any], list[Any]]:
    """``stream -> pendings``: submit each of ``specs``, ordered after ``stream``."""

    def submit(stream: Any) -> list[Any]:
        return [backend.submit(s, order_after=stream) for s in specs]

    return submit


def measure_config(
    sleeper: Sleeper,
    engine: Engine,
    arena: HostArena,
    backends: dict[str, CudaBackend],
    n: int,
    reps: int,
    rng: np.random.Generator,
    latency_reps: int = 30,
) -> list[dict[str, Any]]:
    """Store then load ``n`` random blocks to random slots with each backend, timed end to end
    and copies alone (``time_transfers``); transfers of up to ``LATENCY_BLOCKS`` blocks are
    repeated ``latency_reps`` times for p50/p99. Every row is checked byte for byte: the stored
    slots against ``Engine.slot_images`` (the host backend's layout rule, built by torch), the
    loaded blocks against their sources."""
    rows = []
    group = engine.kv.groups[0]
    nbytes = n * group.slot_bytes
    for method, backend in backends.items():
        perm = rng.permutation(engine.pool)
        src, dst = perm[:n], perm[n : 2 * n]
        slots = rng.permutation(arena.num_slots)[:n]
        store = [TransferSpec.of("store", src, slots)]
        load = [TransferSpec.of("load", dst, slots)]
        times = {}
        for direction, spec in (("store", store), ("load", load)):
            for lead in (False, True):
                times[direction, lead] = time_transfers(
                    sleeper,
                    submitter(backend, spec),
                    latency_reps if n <= LATENCY_BLOCKS and not lead else reps,
                    lead=lead,
                )
            if direction == "store":
                stored = torch.from_numpy(arena.slots[slots, : group.slot_bytes]).cuda()
                if not torch.equal(stored, engine.slot_images(src)):
                    raise RuntimeError(f"{method}: stored slots differ from the oracle")
        if not engine.same_blocks(src, dst):
            raise RuntimeError(f"{method}: round trip corrupted bytes")
        rows.append(
            transfer_row(method, n, group.regions[0].page_bytes, len(group.regions), nbytes, times)
        )
    return rows


def transfer_row(
    method: str,
    n: int,
    piece_bytes: int,
    regions: int,
    nbytes: int,
    times: dict[tuple[str, bool], dict[str, Any]],
) -> dict[str, Any]:
    """One row of the sweep from ``time_transfers`` results per (direction, lead)."""
    row: dict[str, Any] = {
        "method": method,
        "blocks": n,
        "piece_bytes": piece_bytes,
        "pieces": n * regions,
        "slot_bytes": nbytes // n,
    }
    for direction in ("store", "load"):
        e2e, gpu = times[direction, False], times[direction, True]
        # GBps: end to end, from submit on an idle GPU to the copy's completion event.
        row[f"{direction}_GBps"] = nbytes / statistics.median(e2e["gpu_s"]) / 1e9
        row[f"{direction}_GBps_spread"] = spread([nbytes / x / 1e9 for x in e2e["gpu_s"]])
        row[f"{direction}_p50_us"] = float(np.percentile(e2e["gpu_s"], 50)) * 1e6
        row[f"{direction}_p99_us"] = float(np.percentile(e2e["gpu_s"], 99)) * 1e6
        # gpu_GBps: the copies alone, the host's enqueue hidden behind a GPU sleep.
        row[f"{direction}_gpu_GBps"] = nbytes / statistics.median(gpu["gpu_s"]) / 1e9
        row[f"{direction}_submit_us"] = statistics.median(e2e["submit_s"] + gpu["submit_s"]) * 1e6
        row[f"{direction}_wake_us"] = statistics.median(e2e["wake_s"]) * 1e6
        row[f"{direction}_enqueue_us"] = (
            statistics.median(e2e["enqueue_s"] + gpu["enqueue_s"]) * 1e6
        )
    return row


def measure_both(
    sleeper: Sleeper,
    engine: Engine,
    arena: HostArena,
    backend: CudaBackend,
    n: int,
    reps: int,
    rng: np.random.Generator,
) -> float:
    """GB/s (both directions summed) of a store and a load of ``n`` blocks each, at once."""
    perm = rng.permutation(engine.pool)
    slots = rng.permutation(arena.num_slots)
    store = [TransferSpec.of("store", perm[:n], slots[:n])]
    load = [TransferSpec.of("load", perm[n : 2 * n], slots[n : 2 * n])]
    t = time_transfers(
        sleeper,
        submitter(backend, store, load),
        reps,
    )
    return float(2 * n * engine.kv.slot_bytes / statistics.median(t["gpu_s"]) / 1e9)


def measure_gemm(
    engine: Engine,
    arena: HostArena,
    backends: dict[str, CudaBackend],
    n: int,
    reps: int,
    gemms: int,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """Slowdown of a bf16 8192^3 GEMM stream while each method stores and loads continuously.

    Repetitions interleave a baseline window (GEMMs alone) with one loaded window per method; the
    slowdown is the median over repetitions of loaded / mean(adjacent baselines) - 1. The
    baseline's own spread is reported as the noise floor.
    """
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    comp = torch.cuda.Stream()
    perm = rng.permutation(engine.pool)
    slots = rng.permutation(arena.num_slots)
    store = [TransferSpec.of("store", perm[:n], slots[:n])]
    load = [TransferSpec.of("load", perm[n : 2 * n], slots[n : 2 * n])]
    transfer_s = {}

    def window(backend: CudaBackend | None) -> float:
        torch.cuda.synchronize()
        pend = []
        if backend is not None:
            pend = [backend.submit(store, order_after=None), backend.submit(load, order_after=None)]
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(comp):
            e0.record()
            for _ in range(gemms):
                torch.mm(a, b)
            e1.record()
        e1.synchronize()
        for p in pend:
            p.wait(120)
        return float(e0.elapsed_time(e1) / 1e3)

    for backend in [None, *backends.values()]:  # warm-up
        window(backend)
    for name, backend in backends.items():
        torch.cuda.synchronize()
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        p = [backend.submit(store, order_after=None), backend.submit(load, order_after=None)]
        for x in p:
            x.wait_on()
        e.record()
        e.synchronize()
        transfer_s[name] = s.elapsed_time(e) / 1e3
    base: list[float] = []
    loaded: dict[str, list[float]] = {m: [] for m in backends}
    ratios: dict[str, list[float]] = {m: [] for m in backends}
    prev = window(None)
    base.append(prev)
    for _ in range(reps):
        row = {m: window(bk) for m, bk in backends.items()}
        nxt = window(None)
        base.append(nxt)
        for m, t in row.items():
            loaded[m].append(t)
            ratios[m].append(t / ((prev + nxt) / 2) - 1)
        prev = nxt
    bmed = statistics.median(base)
    return {
        "gemm": "bf16 8192x8192x8192",
        "gemms_per_window": gemms,
        "window_s": spread(base),
        "baseline_noise": (max(base) - min(base)) / bmed,
        "transfer_pair_s": transfer_s,
        "blocks_per_transfer": n,
        "slowdown": {m: statistics.median(r) for m, r in ratios.items()},
        "slowdown_spread": {m: spread(r) for m, r in ratios.items()},
    }


def measure_binding(counts: tuple[int, ...], reps: int = 15) -> dict[str, Any]:
    """Host time of one cuMemcpyBatchAsync call of ``count`` 4 KiB D2H descriptors: through ctypes
    (numpy arrays passed as three pointers) and through cuda-python (lists of CUdeviceptr)."""
    import time

    from kvoffload.transfer.cuda.driver import CudaDriver

    drv = CudaDriver.load()
    stream = torch.cuda.Stream()
    out: dict[str, Any] = {}
    try:
        from cuda.bindings import driver as cbd
    except ImportError as missing:
        cbd = None
        out["cuda_python_error"] = str(missing)
    for count in counts:
        dev = torch.empty(count * 4096, dtype=torch.uint8, device="cuda")
        host = torch.empty(count * 4096, dtype=torch.uint8, pin_memory=True)
        table = np.stack(
            [
                dev.data_ptr() + np.arange(count, dtype=np.int64) * 4096,
                host.data_ptr() + np.arange(count, dtype=np.int64) * 4096,
                np.full(count, 4096, dtype=np.int64),
            ]
        )
        res: dict[str, Any] = {}
        ct = []
        for _ in range(reps):
            stream.synchronize()
            t0 = time.perf_counter()
            drv.memcpy_batch(table, int(stream.cuda_stream))
            ct.append(time.perf_counter() - t0)
        res["ctypes_us"] = statistics.median(ct) * 1e6
        if cbd is not None:
            try:
                attr = cbd.CUmemcpyAttributes()
                attr.srcAccessOrder = cbd.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
                full, call = [], []
                for _ in range(reps):
                    stream.synchronize()
                    t0 = time.perf_counter()
                    srcs = [cbd.CUdeviceptr(int(x)) for x in table[0].tolist()]
                    dsts = [cbd.CUdeviceptr(int(x)) for x in table[1].tolist()]
                    sizes = table[2].tolist()
                    t1 = time.perf_counter()
                    (err,) = cbd.cuMemcpyBatchAsync(
                        dsts,
                        srcs,
                        sizes,
                        count,
                        [attr],
                        [0],
                        1,
                        cbd.CUstream(int(stream.cuda_stream)),
                    )[:1]
                    t2 = time.perf_counter()
                    if int(err) != 0:
                        raise RuntimeError(f"cuda-python cuMemcpyBatchAsync: {err}")
                    full.append(t2 - t0)
                    call.append(t2 - t1)
                res["cuda_python_us"] = statistics.median(full) * 1e6
                res["cuda_python_call_only_us"] = statistics.median(call) * 1e6
            except (RuntimeError, TypeError, AttributeError, ValueError) as err:
                res["cuda_python_error"] = f"{type(err).__name__}: {err}"
        stream.synchronize()
        out[str(count)] = res
    return out


def measure_submit_parts(
    engine: Engine, arena: HostArena, blocks: tuple[int, ...] = (64, 512), reps: int = 100
) -> dict[str, Any]:
    """Where the caller's ``submit`` time goes (staged backend, submitter thread on): the whole
    call; the call with the hand-off to the thread replaced by a no-op (no thread wake-up); and its
    parts (spec validation, the ordering event, the Pending)."""
    import queue
    import time

    from kvoffload.transfer.cuda.pending import CudaPending
    from kvoffload.transfer.cuda.staged import StagedBackend

    def med(fn: Callable[[], object]) -> float:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    class Sink:
        def put(self, job: object, inline: bool = True) -> None:
            return

    class Waiterless:  # a queue nobody is blocked on
        def __init__(self) -> None:
            self.queue: queue.SimpleQueue[object] = queue.SimpleQueue()

        def put(self, job: object, inline: bool = True) -> None:
            self.queue.put(job)

    out: dict[str, Any] = {}
    rng = np.random.default_rng(1)
    backend = StagedBackend(engine.kv, arena)
    try:
        for n in blocks:
            spec = [TransferSpec.of("store", rng.permutation(engine.pool)[:n], np.arange(n))]
            full = _waited_submits(partial(backend.submit, spec), reps)
            checked = _waited_submits(partial(backend.submit_checked, spec), reps)
            after_idle = []
            for _ in range(10):
                time.sleep(0.08)  # longer than the submitter's polling window: it sleeps
                t0 = time.perf_counter()
                p = backend.submit(spec)
                after_idle.append(time.perf_counter() - t0)
                p.wait(30)
            real = backend._submitters
            backend._submitters = {"store": Sink(), "load": Sink()}  # type: ignore[dict-item]
            no_wake = med(partial(backend.submit, spec))
            checked_no_wake = med(partial(backend.submit_checked, spec))
            waiterless = Waiterless()
            backend._submitters = {"store": waiterless, "load": waiterless}  # type: ignore[dict-item]
            no_waiter = med(partial(backend.submit, spec))
            backend._submitters = real
            out[str(n)] = {
                "pieces": n * len(engine.kv.groups[0].regions),
                "submit_us": full,
                # through a paired TransferWorker (its Offloader validated the job)
                "submit_checked_us": checked,
                "submit_after_idle_us": statistics.median(after_idle) * 1e6,
                "submit_without_thread_wake_us": no_wake,
                "submit_checked_without_thread_wake_us": checked_no_wake,
                "submit_into_queue_without_waiter_us": no_waiter,
                "validate_us": med(partial(backend.validate, spec)),
                "order_event_us": med(
                    lambda: backend._order_events.append(backend._order_event("current") or 0)
                ),
                "pending_us": med(CudaPending),
            }
    finally:
        backend.close()
    return out


def _waited_submits(submit: Callable[[], Any], reps: int) -> float:
    """Median microseconds of ``submit()``, each transfer waited for before the next."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        p = submit()
        ts.append(time.perf_counter() - t0)
        p.wait(30)
    return statistics.median(ts) * 1e6


def measure_first_layer(
    engine: Engine, arena: HostArena, backend: CudaBackend, n: int, reps: int
) -> dict[str, Any]:
    """How soon layer 0 of an ``n``-block load is usable, against the whole load: from ``submit``
    on an idle GPU to the layer-0 slice's event and to the last event (GPU clock, medians), and
    the host time ``wait_on(stream, layer=0)`` and ``wait_on(stream)`` took after ``submit``
    returned (what an engine's thread waits before it can enqueue layer 0's attention)."""
    rng = np.random.default_rng(2)
    stream, side = torch.cuda.Stream(), torch.cuda.Stream()
    out: dict[str, list[float]] = {k: [] for k in ("layer0_ms", "whole_ms", "host0_us", "host_us")}
    slices = 0
    for i in range(reps + 1):
        spec = [TransferSpec.of("load", rng.permutation(engine.pool)[:n], np.arange(n))]
        start, first, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize()
        start.record(stream)
        p = backend.submit(spec, order_after=stream)
        t0 = time.perf_counter()
        p.wait_on(side, layer=0)
        t1 = time.perf_counter()
        first.record(side)
        p.wait_on(stream)
        t2 = time.perf_counter()
        end.record(stream)
        end.synchronize()
        side.synchronize()
        if not p.wait(30) or p.error() is not None:
            raise RuntimeError(f"a first-layer probe load failed: {p.error()}")
        slices = len(getattr(p, "layer_events", ()))
        if i:
            out["layer0_ms"].append(start.elapsed_time(first))
            out["whole_ms"].append(start.elapsed_time(end))
            out["host0_us"].append((t1 - t0) * 1e6)
            out["host_us"].append((t2 - t0) * 1e6)
    row: dict[str, Any] = {k: statistics.median(v) for k, v in out.items()}
    return {
        **row,
        "blocks": n,
        "slices": slices,
        "GBps": n * engine.kv.slot_bytes / row["whole_ms"] / 1e6,
    }


def measure_host_costs(reps: int = 200) -> dict[str, float]:
    """Median host microseconds of the calls a transfer's enqueue is made of."""
    import time

    from kvoffload.transfer.cuda import driver as cu
    from kvoffload.transfer.cuda.kernels import CopyLauncher

    drv = cu.CudaDriver.load()
    stream = torch.cuda.Stream()
    handle = int(stream.cuda_stream)
    ev = cu.event_create()
    src = torch.empty(64 * 4096, dtype=torch.uint8, device="cuda")
    dst = torch.empty(64 * 4096, dtype=torch.uint8, pin_memory=True)
    idx = torch.arange(64, dtype=torch.int64, device="cuda")
    regions = torch.tensor(
        [[src.data_ptr()], [4096], [4096], [0]], dtype=torch.int64, device="cuda"
    )
    launcher = CopyLauncher()

    def table(n: int) -> np.ndarray:
        off = np.arange(n, dtype=np.int64) * 4096
        return np.stack([src.data_ptr() + off, dst.data_ptr() + off, np.full(n, 4096, np.int64)])

    tables = {n: table(n) for n in (1, 16, 64)}

    def launch() -> None:
        launcher.launch(
            stream,
            16,
            idx,
            idx,
            regions,
            0,
            64,
            1,
            dst.data_ptr(),
            4096,
            to_host=True,
            identity=True,
            jobs=8,
            words=512,
        )

    calls: dict[str, Callable[[], object]] = {
        "event_record": lambda: cu.event_record(ev, handle),
        "stream_wait_event": lambda: cu.stream_wait_event(handle, ev),
        "event_create_destroy": lambda: cu.event_destroy(cu.event_create()),
        "event_query": lambda: cu.event_done(ev),
        "memcpy_async_upload_512B": lambda: drv.memcpy(dst.data_ptr(), src.data_ptr(), 512, handle),
        "triton_launch": launch,
        **{f"memcpy_batch_{n}": partial(drv.memcpy_batch, t, handle) for n, t in tables.items()},
    }
    out = {}
    for name, fn in calls.items():
        fn()
        stream.synchronize()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
            if len(ts) % 16 == 0:
                stream.synchronize()
        stream.synchronize()
        out[name] = statistics.median(ts) * 1e6
    cu.event_destroy(ev)
    return out


def measure_launch_stall(
    engine: Engine, arena: HostArena, backend: Any, reps: int, steps: int = 100
) -> dict[str, Any]:
    """The launch-thread half of the slowdown: a launch-bound Python "model" (``steps`` steps of
    100 tiny kernels each, so the GPU waits on the host) timed on the host clock, alone, beside an
    idle backend, and submitting a 2-block store and a 2-block load per step (as an engine would),
    in repeated interleaved windows; the GPU itself is nearly idle, so what it shows is host time
    and GIL. Also the host CPU time the process spends per step."""
    x = torch.zeros(1024, device="cuda")
    pool = min(engine.pool, arena.num_slots) - 4

    def window(submit: bool) -> tuple[float, float]:
        pend = []
        torch.cuda.synchronize()
        c0, t0 = time.process_time(), time.perf_counter()
        for i in range(steps):
            for _ in range(100):
                x.add_(1.0)
            if submit:
                b = (4 * i) % pool
                pend.append(backend.submit([TransferSpec.of("store", [b, b + 1], [b, b + 1])]))
                pend.append(
                    backend.submit([TransferSpec.of("load", [b + 2, b + 3], [b + 2, b + 3])])
                )
        torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        for p in pend:
            p.wait(30)
        return wall / steps * 1e6, cpu / steps * 1e6

    window(True)  # warm-up
    alone, busy, cpu_alone, cpu_busy = [], [], [], []
    for _ in range(reps):
        a, ca = window(False)
        b, cb = window(True)
        alone.append(a)
        busy.append(b)
        cpu_alone.append(ca)
        cpu_busy.append(cb)
    base = statistics.median(alone)
    return {
        "step_alone_us": spread(alone),
        "step_with_transfers_us": spread(busy),
        "noise": (max(alone) - min(alone)) / base,
        "slowdown": statistics.median(busy) / base - 1,
        "host_cpu_us_per_transfer": (statistics.median(cpu_busy) - statistics.median(cpu_alone))
        / 2,
    }


def _within_dma_cap(
    backends: dict[str, CudaBackend], regions: int, cap: int, n: int
) -> dict[str, CudaBackend]:
    """The methods measured at ``n`` blocks: ``dma`` (a descriptor per piece) only up to ``cap``
    pieces, past which one transfer costs it seconds of host time."""
    return {m: b for m, b in backends.items() if m != "dma" or n * regions <= cap}


def run_gpu(args: Any) -> dict[str, Any]:
    """The whole GPU benchmark; returns the JSON-ready result. The sweep stops taking new cases
    once ``args.time_budget_s`` has passed (the skipped ones are listed)."""
    began = time.perf_counter()
    torch.cuda.init()
    result: dict[str, Any] = {"benchmark": "transfer", **gpu_info()}
    sleeper = Sleeper()
    rng = np.random.default_rng(0)
    result["link"] = measure_link(sleeper, args.link_bytes, args.link_reps)
    cases = parse_cases(args.cases)

    def counts(model: str, bs: int) -> list[int]:
        return case_blocks(model, bs, args.gpu_blocks, args.max_transfer_mib)

    fill = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda").cpu().numpy()

    def make_arena(slots: int, slot: int) -> HostArena:
        arena = HostArena(slots, slot, pin=cuda_pin)
        flat = arena.slots.reshape(-1)
        for off in range(0, len(flat), len(fill)):
            part = flat[off : off + len(fill)]
            part[:] = fill[: len(part)]
        return arena

    rows: list[dict[str, Any]] = []
    both: list[dict[str, Any]] = []
    skipped: list[str] = []
    first_layer: list[dict[str, Any]] = []
    dma_skipped: list[str] = []
    cap = args.dma_max_pieces
    gemm_done = stall = None
    with progress() as bar:
        task = bar.add_task("GPU transfers", total=len(cases))
        for case_index, (model, layout, bs) in enumerate(cases):
            if time.perf_counter() - began > args.time_budget_s:
                skipped.append(f"{model}:{layout}:{bs}")
                bar.advance(task)
                continue
            ns = counts(model, bs)
            engine = Engine(model, layout, bs, 2 * max(ns) + 8)
            arena = make_arena(2 * max(ns) + 8, engine.kv.slot_bytes)  # one case's slot size
            backends = {m: make(m, engine.kv, arena) for m in args.methods}
            regions = len(engine.kv.groups[0].regions)
            running = partial(_within_dma_cap, backends, regions, cap)
            try:
                for n in ns:
                    bar.update(task, description=f"{model} {layout} bs{bs} x{n}")
                    if "dma" in backends and n * regions > cap:
                        dma_skipped.append(f"{model}:{layout}:{bs} x{n}")
                    for row in measure_config(
                        sleeper, engine, arena, running(n), n, args.reps, rng, args.latency_reps
                    ):
                        rows.append({"model": model, "layout": layout, "block_size": bs, **row})
                n_both = min(512, max(ns))
                for m, bk in running(n_both).items():
                    if m == "sm":
                        continue
                    runs = [
                        measure_both(sleeper, engine, arena, bk, n_both, args.reps, rng)
                        for _ in range(3)
                    ]
                    both.append(
                        {
                            "model": model,
                            "layout": layout,
                            "block_size": bs,
                            "blocks": n_both,
                            "method": m,
                            "GBps": statistics.median(runs),
                            "runs_GBps": runs,
                        }
                    )
                if "staged" in backends:
                    first_layer.append(
                        {
                            "model": model,
                            "layout": layout,
                            "block_size": bs,
                            **measure_first_layer(
                                engine, arena, backends["staged"], max(ns), args.reps
                            ),
                        }
                    )
                if case_index == 0:
                    result["submit_parts"] = measure_submit_parts(engine, arena)
                    if args.gemm_reps > 0:
                        bar.update(task, description="GEMM interference, launch stalls")
                        gemm_done = measure_gemm(
                            engine,
                            arena,
                            {m: b for m, b in backends.items() if m != "auto"},
                            min(512, max(ns)),
                            args.gemm_reps,
                            args.gemms,
                            rng,
                        )
                        stall = {
                            m: measure_launch_stall(engine, arena, b, max(3, args.gemm_reps // 2))
                            for m, b in backends.items()
                            if m in ("staged", "dma")
                        }
            finally:
                for bk in backends.values():
                    bk.close()
                arena.close()
                del engine
                torch.cuda.empty_cache()
            bar.advance(task)
            print(f"[{time.perf_counter() - began:.0f} s] {model} {layout} bs{bs} done", flush=True)
    result["rows"] = rows
    result["store_and_load"] = both
    result["first_layer"] = first_layer
    result["dma_skipped"] = dma_skipped
    result["gemm"] = gemm_done
    result["launch_stall"] = stall
    result["skipped_cases"] = skipped
    result["link_after"] = measure_link(sleeper, args.link_bytes, args.link_reps)
    result["binding_host_us"] = measure_binding(tuple(args.binding_counts))
    result["host_call_us"] = measure_host_costs()
    result["seconds"] = time.perf_counter() - began
    return result
