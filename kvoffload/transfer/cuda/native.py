"""The compiled enqueue loop of the ``staged`` backend (``native.c``): build, load, call.

Why: the Python chunk loop holds the GIL for ~20-40 us per chunk (a Triton launch through its
Python launcher, five ctypes calls, list work), 0.4-0.75 ms per transfer on the H100 VM, and an
engine that launches its kernels from Python in the same process waits for the GIL meanwhile
(docs/transfer.md, "Host time"). ``kvo_staged`` runs one transfer part's whole chunk loop in C with
the GIL released (ctypes releases it for the call): Python keeps the validation, the chunk plan and
the descriptor table (numpy, vectorized), C does the per-chunk driver calls.

How it is built: at first use, with the system C compiler (``$CC``, else ``cc``), into the cache
directory (``$KVOFFLOAD_CACHE_DIR``, else ``~/.cache/kvoffload``), named by a hash of the source,
so a new version never loads an old build. It needs no CUDA headers and no Python headers, so a
C compiler alone suffices; ``pip install`` compiles nothing. Without a compiler (or with
``KVOFFLOAD_NATIVE=0``) ``library()`` returns None and ``unavailable()`` says why; the backend
then runs the same loop in Python, with the same bytes and the same ordering.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvoffload.transfer.calibration import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
ABI = 1
STEPS = {1: "cuLaunchKernel", 2: "copy", 3: "cuEventRecord", 4: "cuStreamWaitEvent"}
# kvo_transfer's fields, in order (all 64-bit)
TRANSFER_FIELDS = (
    *("store", "n_chunks", "starts", "counts", "part_at", "src", "dst", "size"),
    *("position", "depth", "bases", "filled", "freed", "gather", "dmas", "n_dmas", "ahead"),
    *("blocks", "regions", "n_regions", "unit"),
)
_FIELD = {name: i for i, name in enumerate(TRANSFER_FIELDS)}
DRIVER_FIELDS = ("launch", "batch", "copy", "record", "wait", "attrs", "attr_index")

_reason: str | None = None


def unavailable() -> str | None:
    """Why the compiled loop is not in use (None: it is, or ``library()`` was not called yet)."""
    return _reason


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built and loaded library, or None (the reason in ``unavailable()``)."""
    global _reason
    if os.environ.get("KVOFFLOAD_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        _reason = "disabled by KVOFFLOAD_NATIVE=0"
        return None
    try:
        path = build()
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as err:
        _reason = str(err)
        log.warning(
            "kvoffload: the staged backend enqueues in Python (slower host path): %s", _reason
        )
        return None
    if lib.kvo_abi() != ABI:
        _reason = f"expected native ABI {ABI} in {path}, got {lib.kvo_abi()}"
        return None
    fn = lib.kvo_staged
    fn.argtypes = [ctypes.c_void_p] * 4
    fn.restype = ctypes.c_int
    _reason = None
    return lib


def build(directory: Path | None = None) -> Path:
    """Compile ``native.c`` (once per source version) and return the shared library's path.

    RuntimeError naming the compiler and its output when it is missing or fails."""
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + platform.machine().encode()).hexdigest()[:16]
    directory = directory or cache_dir() / "native"
    path = directory / f"kvoffload_native_{tag}.so"
    if path.exists():
        return path
    compiler = os.environ.get("CC") or "cc"
    found = shutil.which(compiler)
    if found is None:
        raise RuntimeError(
            f"expected a C compiler ({compiler!r}, from $CC or 'cc') on PATH to build the "
            "staged backend's enqueue loop, found none (install gcc, or set CC)"
        )
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    cmd = [found, "-O2", "-std=c99", "-shared", "-fPIC", "-o", tmp, str(SOURCE)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"expected {' '.join(cmd[:-3])} to build {SOURCE.name}, it failed with exit "
                f"{done.returncode}: {(done.stderr or done.stdout).strip()[:500]}"
            )
        os.replace(tmp, path)  # atomic: concurrent builders leave one complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@dataclass(frozen=True)
class NativeKernel:
    """How to launch one compiled variant of the copy kernel from C (``kvo_kernel``)."""

    function: int  # CUfunction
    block: int  # threads per program
    shared: int  # dynamic shared memory bytes
    wide: int  # bit j: integer argument j is i64
    hidden: int  # trailing pointer parameters the compiler added

    def pack(self, programs: int) -> np.ndarray:
        return np.array(
            [self.function, programs, self.block, self.shared, self.wide, self.hidden],
            dtype=np.int64,
        )


def pack_driver(entry: dict[str, int]) -> np.ndarray:
    """``kvo_driver`` from the driver's entry-point addresses (``batch`` may be 0)."""
    return np.array([entry[name] for name in DRIVER_FIELDS], dtype=np.uint64).view(np.int64)


def new_transfer() -> np.ndarray:
    return np.zeros(len(TRANSFER_FIELDS), dtype=np.int64)


def field(name: str) -> int:
    return _FIELD[name]


def wide(v: int) -> bool:
    """True where Triton passes the integer ``v`` as an i64 (else i32): it types a
    non-specialized int argument by its value."""
    return not -(2**31) <= v < 2**31


def address(a: np.ndarray) -> int:
    """The address of a numpy array's first element."""
    return int(a.__array_interface__["data"][0])
