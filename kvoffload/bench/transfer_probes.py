# mypy: disable-error-code="no-untyped-call"
"""Host-time probes of the GPU benchmark: where a ``submit`` call's time goes, single driver calls,
the ctypes and cuda-python bindings of ``cuMemcpyBatchAsync``, and how soon layer 0 of a load is
usable."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from kvoffload.bench.transfer_kv import SyntheticKV
from kvoffload.store.arena import HostArena
from kvoffload.transfer.spec import TransferSpec


def measure_first_layer(
    kv: SyntheticKV, arena: HostArena, backend: Any, n: int, reps: int
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
        spec = [TransferSpec.of("load", rng.permutation(kv.pool)[:n], np.arange(n))]
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
        owner = getattr(p, "layer_slice", None)  # the native engine's layer -> slice
        slices = 0 if owner is None else int(owner.max()) + 1
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
        "GBps": n * kv.kv.slot_bytes / row["whole_ms"] / 1e6,
    }


def measure_submit_parts(
    kv: SyntheticKV,
    backends: dict[str, Any],
    blocks: tuple[int, ...] = (64, 512),
    reps: int = 100,
) -> dict[str, Any]:
    """Where the caller's ``submit`` time goes, per method (``{method: {blocks: {...}}}``): the
    whole call, ``submit_checked`` (what a paired TransferWorker calls), the call after the
    backend sat idle."""
    rng = np.random.default_rng(1)
    out: dict[str, Any] = {}
    for method, backend in backends.items():
        per: dict[str, Any] = {}
        for n in blocks:
            spec = [TransferSpec.of("store", rng.permutation(kv.pool)[:n], np.arange(n))]
            after_idle = []
            for _ in range(10):
                time.sleep(0.08)  # the engine's threads are asleep
                t0 = time.perf_counter()
                p = backend.submit(spec)
                after_idle.append(time.perf_counter() - t0)
                p.wait(30)
            per[str(n)] = {
                "pieces": n * len(kv.kv.groups[0].regions),
                "submit_us": _waited_submits(partial(backend.submit, spec), reps),
                # through a paired TransferWorker (its Offloader validated the job)
                "submit_checked_us": _waited_submits(partial(backend.submit_checked, spec), reps),
                "submit_after_idle_us": statistics.median(after_idle) * 1e6,
            }
        out[method] = per
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


def measure_host_costs(reps: int = 200) -> dict[str, float]:
    """Median host microseconds of the calls a transfer's enqueue is made of."""

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


def measure_binding(counts: tuple[int, ...], reps: int = 15) -> dict[str, Any]:
    """Host time of one cuMemcpyBatchAsync call of ``count`` 4 KiB D2H descriptors: through ctypes
    (numpy arrays passed as three pointers) and through cuda-python (lists of CUdeviceptr)."""

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
