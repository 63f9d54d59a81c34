"""The CUDA driver entry points the copy backends call, resolved once at run time through ctypes.

``cuMemcpyBatchAsync`` is resolved with ``cuGetProcAddress`` at version 12080 (the CUDA 12.8 ABI,
which takes a ``failIdx`` out-parameter), never linked at build time: CUDA 13's headers map the name
to a new entry point without ``failIdx``, while 13.x drivers keep serving the 12.8 one. Where the
driver lacks it (older than 12.8), ``memcpy_batch`` falls back to one ``cuMemcpyAsync`` per
descriptor, with the same bytes and the same error reporting.

Why ctypes and not cuda-python: the call takes three pointer arrays we already hold as numpy
int64, so ctypes passes three integers; cuda-python's ``cuMemcpyBatchAsync`` takes Python lists of
``CUdeviceptr`` and converts them element by element. ``kvoffload bench transfer`` measures both
on the GPU (section ``binding_host_us`` of its JSON); on an H100, driver 580, at 2,048 / 10,000
descriptors: see ``docs/transfer.md`` ("ctypes vs cuda-python").

This module imports neither torch nor cuda-python.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

CUDA_SUCCESS = 0
_NO_INDEX = 2**64 - 1  # failIdx when no single descriptor is to blame
CUDA_ERROR_INVALID_VALUE = 1
CU_STREAM_LEGACY = 0x1  # the legacy default stream's handle (0 means the same)
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1
BATCH_VERSION = 12080  # cuMemcpyBatchAsync with failIdx (CUDA 12.8 ABI)


class CudaCopyError(RuntimeError):
    """A copy the driver refused; ``index`` is the failing descriptor (or None if unknown)."""

    def __init__(self, message: str, code: int, index: int | None) -> None:
        super().__init__(message)
        self.code = code
        self.index = index


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_P = ctypes.c_void_p
_BatchFn = ctypes.CFUNCTYPE(
    ctypes.c_int, _P, _P, _P, ctypes.c_size_t, _P, _P, ctypes.c_size_t, _P, _P
)
_CopyFn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, _P)
BatchFn = Callable[[int, int, int, int, object, object, int, object, int], int]
CopyFn = Callable[[int, int, int, int], int]


@functools.cache
def libcuda() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        raise RuntimeError(f"expected the CUDA driver (libcuda.so.1), got: {err}") from None


def resolve(name: str, version: int) -> int | None:
    """The address of driver entry point ``name`` at ABI ``version``, or None if absent."""
    lib = libcuda()
    get = lib.cuGetProcAddress_v2
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(_P), ctypes.c_int, ctypes.c_uint64, _P]
    get.restype = ctypes.c_int
    fn = _P()
    status = ctypes.c_int()
    err = get(name.encode(), ctypes.byref(fn), version, 0, ctypes.byref(status))
    return fn.value if err == CUDA_SUCCESS and status.value == 0 and fn.value else None


def error_name(code: int) -> str:
    text = ctypes.c_char_p()
    try:
        lib = libcuda()
    except RuntimeError:
        return f"CUresult {code}"
    if lib.cuGetErrorName(code, ctypes.byref(text)) != CUDA_SUCCESS or not text.value:
        return f"CUresult {code}"
    return text.value.decode()


def driver_version() -> int:
    """e.g. 13000 for a CUDA 13.0 driver."""
    v = ctypes.c_int()
    err = libcuda().cuDriverGetVersion(ctypes.byref(v))
    if err != CUDA_SUCCESS:
        raise RuntimeError(f"cuDriverGetVersion failed: {error_name(err)}")
    return v.value


@dataclass
class CudaDriver:
    """The entry points, resolved once. ``batch`` is None where the driver lacks the batch call.

    Build with ``CudaDriver.load()``; ``CudaDriver.load(use_batch=False)`` pretends the batch call
    is missing (tests force the ``cuMemcpyAsync`` fallback with it).
    """

    batch: BatchFn | None
    copy: CopyFn
    version: int

    @property
    def batch_resolved(self) -> bool:
        return self.batch is not None

    @classmethod
    def load(cls, use_batch: bool = True) -> CudaDriver:
        copy_addr = resolve("cuMemcpyAsync", 12000)
        if copy_addr is None:
            raise RuntimeError("the CUDA driver has no cuMemcpyAsync entry point")
        batch_addr = resolve("cuMemcpyBatchAsync", BATCH_VERSION) if use_batch else None
        batch = _BatchFn(batch_addr) if batch_addr else None
        return cls(batch, _CopyFn(copy_addr), driver_version())

    def memcpy_batch(self, table: np.ndarray, stream: int) -> None:
        """Enqueue the copies of a (3, n) int64 ``table`` of rows (src, dst, bytes) on ``stream``.

        The rows are those of ``kvoffload.transfer.descriptors.build_descriptors``.

        Raises ValueError for the legacy NULL stream (the batch call answers
        CUDA_ERROR_INVALID_VALUE there; a created stream is required), CudaCopyError naming the
        failing descriptor for a refused copy. Returns once the copies are enqueued.
        """
        if stream in (0, CU_STREAM_LEGACY):
            raise ValueError(
                "expected a created CUDA stream for the copy, got the legacy default "
                f"(NULL) stream (handle {stream}); run the copy on a torch.cuda.Stream()"
            )
        if table.dtype != np.int64 or table.ndim != 2 or table.shape[0] != 3:
            raise ValueError(f"expected an int64 (3, n) table, got {table.dtype} {table.shape}")
        n = table.shape[1]
        if n == 0:
            return
        if table.strides[1] != 8:
            table = np.ascontiguousarray(table)
        if self.batch is None or n == 1:  # one copy: cuMemcpyAsync costs a third of a batch call
            self._loop(table, stream)
            return
        fail = ctypes.c_size_t(_NO_INDEX)
        err = self.batch(
            table[1].ctypes.data,
            table[0].ctypes.data,
            table[2].ctypes.data,
            n,
            ctypes.byref(_ATTRS),
            _ATTR_INDEX,
            1,
            ctypes.byref(fail),
            stream,
        )
        if err != CUDA_SUCCESS:
            index = fail.value if fail.value < n else None
            raise CudaCopyError(
                f"cuMemcpyBatchAsync failed with {error_name(err)} at descriptor {index} of {n}"
                + (_describe(table, index) if index is not None else ""),
                err,
                index,
            )

    def memcpy(self, src: int, dst: int, nbytes: int, stream: int) -> None:
        """One async copy (index uploads); RuntimeError if the driver refuses it."""
        err = self.copy(dst, src, nbytes, stream)
        if err != CUDA_SUCCESS:
            raise CudaCopyError(
                f"cuMemcpyAsync of {nbytes} bytes failed: {error_name(err)}", err, 0
            )

    def _loop(self, table: np.ndarray, stream: int) -> None:
        for i, (src, dst, size) in enumerate(zip(*(row.tolist() for row in table), strict=True)):
            err = self.copy(dst, src, size, stream)
            if err != CUDA_SUCCESS:
                raise CudaCopyError(
                    f"cuMemcpyAsync failed with {error_name(err)} at descriptor {i} of "
                    f"{table.shape[1]}" + _describe(table, i),
                    err,
                    i,
                )


# Events and stream waits: the few calls the pipelines make per chunk, through ctypes (about a
# microsecond each, the GIL released), instead of torch.cuda.Event's Python wrappers.
CU_EVENT_DISABLE_TIMING = 0x2
CUDA_ERROR_NOT_READY = 600


def _check(err: int, what: str) -> None:
    if err != CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {error_name(err)}")


@functools.cache
def _fn(name: str, *argtypes: type) -> Callable[..., int]:
    fn = getattr(libcuda(), name)
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def event_create(timing: bool = False) -> int:
    """A new event; ``timing``: one ``event_elapsed`` can read (else created without timing)."""
    out = _P()
    flags = 0 if timing else CU_EVENT_DISABLE_TIMING
    _check(_fn("cuEventCreate", _P, ctypes.c_uint)(ctypes.byref(out), flags), "cuEventCreate")
    return int(out.value or 0)


def event_elapsed(start: int, end: int) -> float:
    """Seconds between two completed records of timing events (``event_create(timing=True)``)."""
    ms = ctypes.c_float()
    _check(
        _fn("cuEventElapsedTime", _P, _P, _P)(ctypes.byref(ms), start, end), "cuEventElapsedTime"
    )
    return ms.value / 1e3


def event_destroy(event: int) -> None:
    """Release ``event``; safe while work it tracks is still pending (the driver defers it)."""
    _fn("cuEventDestroy_v2", _P)(event)


def event_record(event: int, stream: int) -> None:
    _check(_fn("cuEventRecord", _P, _P)(event, stream), "cuEventRecord")


def event_done(event: int) -> bool:
    """True once the work before the last record of ``event`` finished (or it was never recorded).

    A failed copy shows here as the error the driver reports (a RuntimeError).
    """
    err = _fn("cuEventQuery", _P)(event)
    if err == CUDA_ERROR_NOT_READY:
        return False
    _check(err, "cuEventQuery")
    return True


def current_context() -> int:
    """The calling thread's current CUDA context handle, 0 when it has none (a thread that has
    made no CUDA call yet)."""
    out = _P()
    _check(_fn("cuCtxGetCurrent", _P)(ctypes.byref(out)), "cuCtxGetCurrent")
    return int(out.value or 0)


def stream_wait_event(stream: int, event: int) -> None:
    """Work enqueued on ``stream`` after this waits for ``event``'s last record."""
    _check(_fn("cuStreamWaitEvent", _P, _P, ctypes.c_uint)(stream, event, 0), "cuStreamWaitEvent")


def _describe(table: np.ndarray, i: int) -> str:
    return f" (src {int(table[0, i]):#x}, dst {int(table[1, i]):#x}, {int(table[2, i])} bytes)"


# One attribute for every descriptor: source read in stream order (the copies may not start before
# the work enqueued ahead of them on the stream; that is how a store waits for the gather).
_ATTRS = _MemcpyAttributes()
_ATTRS.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
_ATTR_INDEX = (ctypes.c_size_t * 1)(0)


def host_device_pointer(address: int) -> int:
    """The device address of page-locked host memory at ``address`` (UVA: usually the same)."""
    fn = libcuda().cuMemHostGetDevicePointer_v2
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), _P, ctypes.c_uint]
    out = ctypes.c_uint64()
    err = fn(ctypes.byref(out), _P(address), 0)
    if err != CUDA_SUCCESS:
        raise RuntimeError(
            f"expected page-locked host memory at {address:#x} (the host arena must be pinned "
            f"for a CUDA backend), cuMemHostGetDevicePointer said {error_name(err)}"
        )
    return out.value
