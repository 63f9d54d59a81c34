"""A CPU stand-in for the CUDA pieces the copy backends call, so their host logic runs on CPU.

Every operation is carried out at the moment it is enqueued, in enqueue order, on real memory:
``memcpy_batch`` and ``memcpy`` move bytes with ``ctypes.memmove``, the copy kernel moves each
block's pages exactly as ``kernels.copy_blocks`` defines them, "device" tensors are CPU tensors.
A pipeline that enqueues work in an order its own events allow therefore produces the real bytes,
and a descriptor, staging offset or chunk boundary computed wrong shows up as wrong bytes. What it
does not test: GPU-side concurrency (events are always complete once recorded), Triton, the
driver. Those are the GPU tests' job (tests/gpu).

Use the ``fake_cuda`` fixture (``tests/conftest.py`` does not enable it globally).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
import torch

from kvoffload.transfer.cuda import base, driver, extension, staged
from kvoffload.transfer.layout import KVLayout

_ids = itertools.count(16)


FAKE_SMS = 6  # the fake device's multiprocessors


class FakeStream:
    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.cuda_stream = next(_ids)
        self.priority = priority

    def synchronize(self) -> None:
        return

    def wait_event(self, event: Any) -> None:
        return


@dataclass
class Calls:
    """What the backends asked of the fake driver, in order (for assertions)."""

    log: list[tuple[Any, ...]] = field(default_factory=list)
    descriptors: int = 0
    launches: int = 0
    # errors raised inside the fake driver's C callbacks (ctypes cannot raise them into C); the
    # fixture fails the test if any is left
    errors: list[BaseException] = field(default_factory=list)
    # a batch copy through the C entry point fails at this descriptor of the batch (None: never)
    fail_batch_at: int | None = None
    # cuEventRecord through the C entry point fails on this stream (None: never)
    fail_record_on: int | None = None
    # called with the stream of every cuEventRecord through the C entry point (None: nothing)
    on_record: Any = None
    events: int = 0  # events the C entry points created and not destroyed
    memory: dict[int, Any] = field(default_factory=dict)  # allocations: address -> buffer
    # what the C entry point cuLaunchKernel runs (tests swap it to hold a launch)
    launch_impl: Any = None
    # stream memory operations not yet run: stream -> operations behind an unmet wait, in order
    # (a wait whose word has not reached its value holds its stream's later operations, as on a
    # GPU; every write lets held streams go on)
    held: dict[int, list[tuple[int, int, int, int]]] = field(default_factory=dict)
    # cuStreamBatchMemOp / cuStreamWriteValue32 / cuStreamWaitValue32 calls through the C entries
    memops: int = 0
    # cuStreamWriteValue32/cuStreamBatchMemOp fail on this stream (None: never)
    fail_flags_on: int | None = None
    # cuStreamQuery of this stream returns this error (a copy that failed on the device), else
    # not ready while the stream is held, else done
    fail_query_on: tuple[int, int] | None = None
    # seconds spent inside the C entry points' Python (benchmarks/api_fake.py leaves it out)
    seconds: float = 0.0
    # cuEventRecord through the C entry point: event -> the host clock when the stream reached
    # the record (None while the stream is held behind a wait: cuEventQuery says not ready)
    event_times: dict[int, float | None] = field(default_factory=dict)
    # cuEventRecord calls per event, and the latest of them its stream has reached: a
    # cuStreamWaitEvent holds its stream's later operations until the record it follows is reached
    recorded: dict[int, int] = field(default_factory=dict)
    reached: dict[int, int] = field(default_factory=dict)

    def stream_held(self, stream: int) -> bool:
        """True while ``stream`` waits on a flag word that has not reached its value, or on an
        event record its stream has not reached."""
        return bool(self.held.get(stream))


class FakeDriver:
    """``CudaDriver``'s interface, moving bytes at once."""

    version = 13000
    batch_resolved = True

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    def memcpy_batch(self, table: np.ndarray, stream: int) -> None:
        if stream in (0, driver.CU_STREAM_LEGACY):
            raise ValueError("expected a created CUDA stream for the copy, got the legacy one")
        if table.dtype != np.int64 or table.ndim != 2 or table.shape[0] != 3:
            raise ValueError(f"expected an int64 (3, n) table, got {table.dtype} {table.shape}")
        for src, dst, size in zip(*(row.tolist() for row in table), strict=True):
            ctypes.memmove(dst, src, size)
        self.calls.descriptors += table.shape[1]
        self.calls.log.append(("batch", stream, table.shape[1]))

    def memcpy(self, src: int, dst: int, nbytes: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)
        self.calls.log.append(("copy", stream, nbytes))

    def table(self) -> int:
        """The address of a ``kvo_driver`` table (native/kvo.h) whose entry points are ctypes
        callbacks doing what the Python fake does, with the same log entries."""
        if not hasattr(self, "_table"):
            self._callbacks = _entry_callbacks(self.calls)
            addresses = [
                ctypes.cast(self._callbacks[k], ctypes.c_void_p).value or 0
                for k in extension.DRIVER_FIELDS
            ]
            self._table = (ctypes.c_uint64 * len(addresses))(*addresses)
        return ctypes.addressof(self._table)


class FakeLauncher:
    """``kernels.CopyLauncher``: the copy kernel's contract, block by block, region by region."""

    calls: Calls

    def __init__(self) -> None:
        self.compiled: dict[tuple[Any, ...], int] = {}  # variants launched: key -> function

    def launch(
        self,
        stream: Any,
        programs: int,
        blocks: Any,
        slots: Any,
        regions: Any,
        first: int,
        n_blocks: int,
        n_regions: int,
        host_base: int,
        slot_stride: int,
        to_host: bool,
        identity: bool,
        jobs: int,
        words: int,
        num_warps: int = 4,
        vec: int = 1,
    ) -> None:
        if vec not in (1, 2) or (
            vec == 2 and not aligned16(regions, n_regions, host_base, slot_stride)
        ):
            raise ValueError(f"a copy kernel of {8 * vec}-byte accesses over these pieces")
        ids = blocks.numpy()[first : first + n_blocks].tolist()
        slot_ids = (
            list(range(n_blocks)) if identity else slots.numpy()[first : first + n_blocks].tolist()
        )
        copy_pieces(regions.numpy()[:, :n_regions], ids, slot_ids, host_base, slot_stride, to_host)
        FakeLauncher.calls.launches += 1
        FakeLauncher.calls.log.append(("launch", stream.cuda_stream, n_blocks))
        # "compiled": later launches of this variant may go through the C loop
        ints = (first, n_blocks, n_regions, host_base, slot_stride)
        key = (to_host, identity, jobs, words, num_warps, vec, *(extension.wide(v) for v in ints))
        if key not in self.compiled:
            self.compiled[key] = len(_FUNCTIONS) + 1
            _FUNCTIONS[self.compiled[key]] = key

    def native_kernel(self, *key: Any) -> extension.NativeKernel | None:
        """As ``CopyLauncher.native_kernel``: known once ``launch`` ran the variant; the function
        handle tells the fake cuLaunchKernel the direction and the integer widths. ``key``: its
        arguments (to_host, identity, jobs, words, num_warps, ints, vec=1)."""
        to_host, identity, jobs, words, num_warps, ints, *rest = key
        vec = rest[0] if rest else 1
        wide = tuple(extension.wide(v) for v in ints)
        function = self.compiled.get((to_host, identity, jobs, words, num_warps, vec, *wide))
        if function is None:
            return None
        mask = sum(1 << j for j, w in enumerate(wide) if w)
        return extension.NativeKernel(function, 32 * num_warps, 0, mask, 2)


def aligned16(regions: Any, n_regions: int, host_base: int, slot_stride: int) -> bool:
    """Whether every piece of a launch (its regions' bases, strides, bytes and offsets, the slot
    area's base and stride) is a multiple of 16 bytes: what a kernel of 16-byte accesses needs."""
    table = np.asarray(regions)[:, :n_regions]
    return not (table % 16).any() and host_base % 16 == 0 and slot_stride % 16 == 0


# every fake "compiled" copy-kernel variant: function handle -> its key
_FUNCTIONS: dict[int, tuple[Any, ...]] = {}


def copy_pieces(
    regions: np.ndarray,
    ids: list[int],
    slot_ids: list[int],
    host_base: int,
    slot_stride: int,
    to_host: bool,
) -> None:
    """What ``kernels.copy_blocks`` does, with memmove: every region of every block."""
    bases, strides, pages, offsets = (regions[k].tolist() for k in range(4))
    for b, s in zip(ids, slot_ids, strict=True):
        for base_, stride, page, off in zip(bases, strides, pages, offsets, strict=True):
            eng = base_ + b * stride
            slot = host_base + s * slot_stride + off
            size = page // 8 * 8
            if to_host:
                ctypes.memmove(slot, eng, size)
            else:
                ctypes.memmove(eng, slot, size)


_P = ctypes.c_void_p
_U = ctypes.c_uint
_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, _P, _U, _U, _U, _U, _U, _U, _U, _P, _P, _P)
_BATCH = ctypes.CFUNCTYPE(
    ctypes.c_int, _P, _P, _P, ctypes.c_size_t, _P, _P, ctypes.c_size_t, _P, _P
)
_COPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, _P)
_RECORD = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P)
_WAIT = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _U)
_FAILED = 999  # the CUresult the callbacks return after an exception (recorded in calls.errors)
_WAIT_32, _WRITE_32 = 1, 2  # CU_STREAM_MEM_OP_WAIT_VALUE_32, _WRITE_VALUE_32
_RECORD_OP = -1  # the fake's own: an event record queued on a stream like its memory operations
_WAIT_EVENT_OP = -2  # the fake's own: cuStreamWaitEvent, met once that record was reached
_NOT_READY, _INVALID_HANDLE = 600, 400  # CUDA_ERROR_NOT_READY, CUDA_ERROR_INVALID_HANDLE
_WAIT_EQ = 1  # CU_STREAM_WAIT_VALUE_EQ (else GEQ, cyclic)


_MEMOPS_LOCK = threading.RLock()  # the core's threads and the test's run stream operations


def hold_stream(calls: Calls, stream: int) -> Callable[[], None]:
    """Hold ``stream``'s later stream memory operations (as a GPU stream busy with earlier work
    would: kernels and copies still run at once in this fake) until the returned release runs."""
    word = ctypes.c_uint32(0)
    calls.memory[ctypes.addressof(word)] = word
    _memops(calls, stream, [(_WAIT_32, ctypes.addressof(word), 1, _WAIT_EQ)])

    def release() -> None:
        _memops(calls, -1, [(_WRITE_32, ctypes.addressof(word), 1, 0)])

    return release


def _memops(calls: Calls, stream: int, ops: list[tuple[int, int, int, int]]) -> None:
    with _MEMOPS_LOCK:
        _run_memops(calls, stream, ops)


def _run_memops(calls: Calls, stream: int, ops: list[tuple[int, int, int, int]]) -> None:
    """Run ``ops`` (operation, address, value, flags) on ``stream`` in order, behind whatever the
    stream already holds; a wait not met holds the rest."""
    queue = calls.held.setdefault(stream, [])
    queue.extend(ops)
    progressed = True
    while progressed:  # a write may release other streams' waits
        progressed = False
        for s, q in calls.held.items():
            while q:
                op, address, value, flags = q[0]
                if op == _RECORD_OP:  # address: the event, value: which record of it
                    calls.event_times[address] = time.perf_counter()
                    calls.reached[address] = max(calls.reached.get(address, 0), value)
                    q.pop(0)
                    progressed = True
                    continue
                if op == _WAIT_EVENT_OP:  # the record the wait was enqueued behind
                    if calls.reached.get(address, 0) < value:
                        break
                    q.pop(0)
                    continue
                word = ctypes.c_uint32.from_address(address)
                if op == _WAIT_32:
                    now = word.value
                    ahead = ((now - value) & 0xFFFFFFFF) < 1 << 31  # GEQ, cyclic
                    met = now == value if flags == _WAIT_EQ else ahead
                    if not met:
                        break
                else:
                    word.value = value & 0xFFFFFFFF
                    calls.log.append(("write32", s, value))
                    progressed = True
                q.pop(0)


def _entry_callbacks(calls: Calls) -> dict[str, Any]:
    """The driver entry points as C callbacks over real memory (see ``FakeDriver.entry``)."""

    def guarded(fn: Any) -> Any:
        def run(*args: Any) -> int:
            t0 = time.perf_counter()
            try:
                return int(fn(*args))
            except Exception as err:  # noqa: BLE001 (kept in calls.errors; the fixture fails on it)
                calls.errors.append(err)
                return _FAILED
            finally:
                calls.seconds += time.perf_counter() - t0

        return run

    def int64s(address: int, n: int) -> list[int]:
        return list((ctypes.c_int64 * n).from_address(address)) if n else []

    def launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        key = _FUNCTIONS[function]
        to_host, identity, vec, wide = key[0], key[1], key[5], key[6:]
        slot = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        blocks, slots, regions = (ctypes.c_uint64.from_address(slot[j]).value for j in range(3))
        ints = [
            (ctypes.c_int64 if w else ctypes.c_int32).from_address(slot[3 + j]).value
            for j, w in enumerate(wide)
        ]
        first, n_blocks, n_regions, host_base, slot_stride = ints
        table = np.array(int64s(regions, 4 * n_regions), dtype=np.int64).reshape(4, n_regions)
        ids = int64s(blocks + 8 * first, n_blocks)
        slot_ids = list(range(n_blocks)) if identity else int64s(slots + 8 * first, n_blocks)
        if vec == 2 and not aligned16(table, n_regions, host_base, slot_stride):
            raise ValueError("a 16-byte-access copy kernel launched over pieces not 16-aligned")
        copy_pieces(table, ids, slot_ids, host_base, slot_stride, to_host)
        calls.launches += 1
        calls.log.append(("launch", stream, n_blocks, gx))  # gx: the programs
        return 0

    def batch(dsts, srcs, sizes, count, attrs, attr_index, n_attrs, fail, stream):
        for i, (d, s, n) in enumerate(
            zip(int64s(dsts, count), int64s(srcs, count), int64s(sizes, count), strict=True)
        ):
            if calls.fail_batch_at == i:
                ctypes.c_size_t.from_address(fail).value = i
                return driver.CUDA_ERROR_INVALID_VALUE
            ctypes.memmove(d, s, n)
        calls.descriptors += count
        calls.log.append(("batch", stream, count))
        return 0

    def copy(dst, src, nbytes, stream):
        ctypes.memmove(dst, src, nbytes)
        calls.log.append(("copy", stream, nbytes))
        return 0

    def record(event, stream):
        if calls.fail_record_on == stream:
            return driver.CUDA_ERROR_INVALID_VALUE
        if calls.on_record is not None:
            calls.on_record(stream)
        calls.log.append(("record", stream, event))
        calls.event_times[event] = None  # reached once the stream gets there
        calls.recorded[event] = calls.recorded.get(event, 0) + 1
        _memops(calls, stream, [(_RECORD_OP, event, calls.recorded[event], 0)])
        return 0

    def query(event):
        return _NOT_READY if event in calls.event_times and calls.event_times[event] is None else 0

    def stream_query(stream):
        if calls.fail_query_on is not None and calls.fail_query_on[0] == stream:
            return calls.fail_query_on[1]
        return _NOT_READY if calls.stream_held(stream) else 0

    def elapsed(out, start, end):
        if not all(e in calls.event_times for e in (start, end)):
            return _INVALID_HANDLE
        t0, t1 = calls.event_times[start], calls.event_times[end]
        if t0 is None or t1 is None:
            return _NOT_READY
        ctypes.c_float.from_address(out).value = (t1 - t0) * 1e3
        return 0

    def wait(stream, event, flags):
        calls.log.append(("wait", stream, event))
        if calls.recorded.get(event, 0):  # the event's latest record (none: nothing to wait)
            _memops(calls, stream, [(_WAIT_EVENT_OP, event, calls.recorded[event], 0)])
        return 0

    def event_create(out, flags):
        ctypes.c_void_p.from_address(out).value = next(_ids) << 8
        calls.events += 1
        return 0

    def event_destroy(event):
        calls.events -= 1
        return 0

    def ok(*args):
        return 0

    def ctx_get(out):
        ctypes.c_void_p.from_address(out).value = 1
        return 0

    def alloc(out, nbytes, *flags):
        buf = ctypes.create_string_buffer(nbytes)
        address = ctypes.addressof(buf)
        calls.memory[address] = buf
        ctypes.c_uint64.from_address(out).value = address
        return 0

    def free(address):
        return 0 if calls.memory.pop(address, None) is not None else driver.CUDA_ERROR_INVALID_VALUE

    def write32(stream, address, value, flags):
        if calls.fail_flags_on == stream:
            return driver.CUDA_ERROR_INVALID_VALUE
        calls.memops += 1
        _memops(calls, stream, [(_WRITE_32, address, value, flags)])
        return 0

    def wait32(stream, address, value, flags):
        calls.memops += 1
        calls.log.append(("wait32", stream, value))
        _memops(calls, stream, [(_WAIT_32, address, value, flags)])
        return 0

    def memops(stream, count, params, flags):
        if calls.fail_flags_on == stream:
            return driver.CUDA_ERROR_INVALID_VALUE
        calls.memops += 1
        ops = []
        for k in range(count):
            at = params + 48 * k  # CUstreamBatchMemOpParams: op, address, value, flags
            op = ctypes.c_uint32.from_address(at).value
            if op not in (_WAIT_32, _WRITE_32):
                raise ValueError(f"expected 32-bit wait/write operations, got {op}")
            ops.append(
                (
                    op,
                    ctypes.c_uint64.from_address(at + 8).value,
                    ctypes.c_uint32.from_address(at + 16).value,
                    ctypes.c_uint32.from_address(at + 24).value,
                )
            )
            if op == _WAIT_32:
                calls.log.append(("wait32", stream, ops[-1][2]))
        _memops(calls, stream, ops)
        return 0

    def copy2d(desc, stream):
        # CUDA_MEMCPY2D: srcDevice at 32, srcPitch at 48, dstDevice at 88, dstPitch at 104,
        # WidthInBytes at 112, Height at 120 (memory types UNIFIED: addresses are pointers)
        def field(at: int) -> int:
            return int(ctypes.c_uint64.from_address(desc + at).value)

        for at, want in ((16, 4), (72, 4)):  # CU_MEMORYTYPE_UNIFIED on both sides
            if ctypes.c_int32.from_address(desc + at).value != want:
                raise ValueError(f"expected memory type {want} at offset {at}")
        src, src_pitch, dst, dst_pitch = field(32), field(48), field(88), field(104)
        width, height = field(112), field(120)
        for row in range(height):
            ctypes.memmove(dst + row * dst_pitch, src + row * src_pitch, width)
        calls.descriptors += 1
        calls.log.append(("copy2d", stream, height))
        return 0

    def host_dptr(out, host, flags):
        ctypes.c_uint64.from_address(out).value = host
        return 0

    def ctx_sync():
        _memops(calls, -1, [])  # the GPU polls: words the host wrote release their waits
        held = {s: q for s, q in calls.held.items() if q}
        if held:  # a GPU would wait here forever
            raise RuntimeError(f"cuCtxSynchronize with streams held on flag words: {held}")
        return 0

    names: dict[int, Any] = {}

    def error_name(code, out):
        text = names.setdefault(code, ctypes.create_string_buffer(f"FAKE_ERROR_{code}".encode()))
        ctypes.c_void_p.from_address(out).value = ctypes.addressof(text)
        return 0

    pointer = ctypes.CFUNCTYPE(ctypes.c_int, _P)
    calls.launch_impl = launch
    return {
        "launch": _LAUNCH(guarded(lambda *args: calls.launch_impl(*args))),
        "batch": _BATCH(guarded(batch)),
        "copy": _COPY(guarded(copy)),
        "record": _RECORD(guarded(record)),
        "wait": _WAIT(guarded(wait)),
        "event_create": ctypes.CFUNCTYPE(ctypes.c_int, _P, _U)(guarded(event_create)),
        "event_destroy": pointer(guarded(event_destroy)),
        "event_query": pointer(guarded(query)),
        "event_sync": pointer(guarded(ok)),
        "ctx_get": pointer(guarded(ctx_get)),
        "ctx_set": pointer(guarded(ok)),
        "mem_alloc": ctypes.CFUNCTYPE(ctypes.c_int, _P, ctypes.c_size_t)(guarded(alloc)),
        "mem_free": ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64)(guarded(free)),
        "host_alloc": ctypes.CFUNCTYPE(ctypes.c_int, _P, ctypes.c_size_t, _U)(guarded(alloc)),
        "host_free": ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64)(guarded(free)),
        "stream_sync": pointer(guarded(ok)),
        "error_name": ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, _P)(guarded(error_name)),
        "write32": ctypes.CFUNCTYPE(ctypes.c_int, _P, ctypes.c_uint64, ctypes.c_uint32, _U)(
            guarded(write32)
        ),
        "wait32": ctypes.CFUNCTYPE(ctypes.c_int, _P, ctypes.c_uint64, ctypes.c_uint32, _U)(
            guarded(wait32)
        ),
        "memops": ctypes.CFUNCTYPE(ctypes.c_int, _P, _U, _P, _U)(guarded(memops)),
        "host_dptr": ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _U)(guarded(host_dptr)),
        "ctx_sync": ctypes.CFUNCTYPE(ctypes.c_int)(guarded(ctx_sync)),
        "copy2d": ctypes.CFUNCTYPE(ctypes.c_int, _P, _P)(guarded(copy2d)),
        "elapsed": ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P)(guarded(elapsed)),
        "stream_query": pointer(guarded(stream_query)),
    }


def cuda_layout(kv: KVLayout) -> KVLayout:
    """``kv`` (built from CPU tensors) as if its tensors were on the GPU."""
    return replace(kv, device="cuda:0")


def no_pin(address: int, nbytes: int) -> Any:
    return lambda: None


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    """Patch torch.cuda, the driver module and the kernel launcher for the duration of a test."""
    with faked(monkeypatch) as calls:
        yield calls
    assert not calls.errors, f"the fake driver's C callbacks raised: {calls.errors}"
    gc.collect()  # pendings left over give their events back while the fake is in place


@contextlib.contextmanager
def faked(monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    """The fake in place through ``monkeypatch`` (undone with it): the ``fake_cuda`` fixture,
    and ``benchmarks/api_fake.py`` outside pytest (``pytest.MonkeyPatch.context()``)."""
    calls = Calls()
    events = itertools.count(1 << 20)
    recorded: dict[int, int] = {}
    times: dict[int, float] = {}  # event -> when recorded (the Python fake runs every op at once)

    def event_record(event: int, stream: int) -> None:
        recorded[event] = stream
        times[event] = time.perf_counter()
        calls.log.append(("record", stream, event))

    def stream_wait_event(stream: int, event: int) -> None:
        calls.log.append(("wait", stream, event))

    patches = {
        "event_create": lambda timing=False: next(events),
        "event_elapsed": lambda start, end: times[end] - times[start],
        "event_destroy": lambda event: None,
        "event_record": event_record,
        "event_done": lambda event: True,
        "stream_wait_event": stream_wait_event,
        "current_context": lambda: 1,
        "host_device_pointer": lambda address: address,
    }
    for name, fn in patches.items():
        monkeypatch.setattr(driver, name, fn)
    monkeypatch.setattr(driver.CudaDriver, "load", classmethod(lambda cls, **kw: FakeDriver(calls)))
    FakeLauncher.calls = calls
    # The backends import the launcher from this module when they start. CPU torch wheels come
    # without Triton, so the module is replaced whole rather than patched after importing it.
    kernels = types.ModuleType("kvoffload.transfer.cuda.kernels")
    kernels.CopyLauncher = FakeLauncher  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, kernels.__name__, kernels)
    monkeypatch.setattr(base, "_current_stream", lambda device: 7)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    # a small device: load_programs 0 (one scatter program per SM) launches FAKE_SMS programs
    props = types.SimpleNamespace(multi_processor_count=FAKE_SMS)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    real_empty, real_to = torch.empty, torch.Tensor.to

    def empty(*shape: Any, device: Any = None, pin_memory: bool = False, **kw: Any) -> Any:
        if device is not None and torch.device(device).type == "cuda":
            device = None
        return real_empty(*shape, device=device, **kw)

    def to(self: torch.Tensor, *args: Any, **kw: Any) -> Any:
        if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
            return self
        return real_to(self, *args, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "to", to)
    fake = FakeDriver(calls)
    monkeypatch.setattr(staged, "_driver_table", fake.table)
    real_zeros = torch.zeros

    def zeros(*shape: Any, device: Any = None, **kw: Any) -> Any:
        return real_zeros(*shape, **kw)

    monkeypatch.setattr(torch, "zeros", zeros)
    yield calls
