"""The native transfer core's extension module (``kvoffload.transfer.cuda._core``): whether it
is there, and why not.

The extension is compiled when the package is installed (``setup.py``: plain C, no CUDA toolkit;
the driver is resolved from ``libcuda.so.1`` at run time), never at run time. Where it is missing
(an install without a C compiler) or disabled (``KVOFFLOAD_NATIVE=0``), ``module()`` returns None,
``unavailable()`` says why, and ``make_staged`` returns the ``dma`` backend instead (a different,
simpler path: the staged pipeline exists in C only).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import ModuleType

import numpy as np

ABI = 12  # KVO_ABI (native/kvo.h): the packed spec's and the driver table's layout
# kvo_driver's entry points, in order (kvoffload/transfer/cuda/native/driver.h)
DRIVER_FIELDS = (
    *("launch", "batch", "copy", "record", "wait", "event_create", "event_destroy"),
    *("event_query", "event_sync", "ctx_get", "ctx_set", "mem_alloc", "mem_free"),
    *("host_alloc", "host_free", "stream_sync", "error_name"),
    *("write32", "wait32", "memops", "host_dptr", "ctx_sync", "copy2d", "elapsed"),
    "stream_query",
)
STEP_COPY = 2  # a copy the driver refused (native/job.h's step codes)

_reason: str | None = None


def disabled() -> bool:
    return os.environ.get("KVOFFLOAD_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


@functools.cache
def _load() -> tuple[ModuleType | None, str | None]:
    if disabled():
        return None, "disabled by KVOFFLOAD_NATIVE=0"
    try:
        from kvoffload.transfer.cuda import _core  # type: ignore[attr-defined]
    except ImportError as err:
        return None, (
            f"the native core extension is not built ({err}); reinstall kvoffload with a C "
            "compiler present (gcc or clang) to build it"
        )
    if _core.ABI != ABI or len(DRIVER_FIELDS) != _core.DRIVER_FIELDS:
        return None, (
            f"expected native core ABI {ABI} with {len(DRIVER_FIELDS)} driver entry points, got "
            f"ABI {_core.ABI} with {_core.DRIVER_FIELDS} (a stale build)"
        )
    return _core, None


def module() -> ModuleType | None:
    """The extension module, or None (the reason in ``unavailable()``)."""
    return _load()[0]


def unavailable() -> str | None:
    """Why the native core is not in use (None: it is available)."""
    return _load()[1]


def driver_timed() -> bool:
    """``KVOFFLOAD_DRIVER_TIMES=1``: cores opened from now on call the driver through a timed
    table (``driver_times``), at ~50 ns per call; a diagnostic for benchmarks."""
    return os.environ.get("KVOFFLOAD_DRIVER_TIMES", "0").strip() == "1"


def driver_times(reset: bool = False) -> dict[str, tuple[int, float]]:
    """This thread's driver calls through a timed table since the last reset: ``{entry point:
    (calls, microseconds)}`` for those called (empty without the extension or timing)."""
    core = module()
    if core is None:
        return {}
    rows = core.driver_times(reset)
    return {n: (c, ns / 1e3) for n, (c, ns) in zip(DRIVER_FIELDS, rows, strict=True) if c}


def reset() -> None:
    """Forget the cached answer (tests toggle ``KVOFFLOAD_NATIVE``)."""
    _load.cache_clear()


@dataclass(frozen=True)
class NativeKernel:
    """How C launches one compiled variant of the copy kernel (``kvo_kernel`` in kvo.h)."""

    function: int  # CUfunction
    block: int  # threads per program
    shared: int  # dynamic shared memory bytes
    wide: int  # bit j: integer argument j is i64
    hidden: int  # trailing pointer parameters the compiler added

    def pack(self, programs: int) -> list[int]:
        return [self.function, programs, self.block, self.shared, self.wide, self.hidden]


def wide(v: int) -> bool:
    """True where Triton passes the integer ``v`` as an i64 (else i32): it types a
    non-specialized int argument by its value."""
    return not -(2**31) <= v < 2**31


def address(a: np.ndarray) -> int:
    """The address of a numpy array's first element."""
    return int(a.__array_interface__["data"][0])
