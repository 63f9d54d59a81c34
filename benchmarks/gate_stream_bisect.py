"""Which stream opens the layer gates of a full CUDA graph, and does it hold the engine? (issue 25)

In ``bench e2e --graph full`` a restored request's graph replay began only once its whole load
had landed: ~10.5 ms of device time on the engine's stream inside ``gate_open``, where the
engine's stream gets one event record. The gate's opener is a stream of the native core that
waits (stream memory operations) for each layer to land, then opens it. This runs ``bench e2e``
with that opener stream made one of three ways:

- ``pool``: ``torch.cuda.Stream()`` (the backend's way: one of torch's pooled streams, handed
  out round robin, so it may be a stream something else also uses);
- ``high``: a pooled stream of the highest priority;
- ``own``: a stream of its own (``cuStreamCreate``, non-blocking);
- ``default``: the engine's own stream (torch's default stream), with ``unordered``'s gates;
- ``nogate``: timing only, nothing captured or opened: the graph holds no stream memory
  operation and no stream of ours is asked to open anything;
- ``unordered``: timing only, the bytes are NOT kept in order: every step opens its gate at once
  (no load listed), so the replay waits for nothing. What is left of the stall then is not the
  gate's waits.

    python benchmarks/gate_stream_bisect.py MODE [bench e2e arguments] --out F   # CUDA only
"""

from __future__ import annotations

import sys
from typing import Any

import torch

import kvoffload.transfer.cuda.staged as staged

MODES = ("pool", "high", "own", "unordered", "default", "nogate")


def gate_stream(mode: str, pooled: Any) -> Any:
    if mode == "pool":
        return pooled()
    if mode == "high":
        high = pooled.priority_range()[1]
        return pooled(priority=high)
    if mode == "default":
        return torch.cuda.default_stream()
    from cuda.bindings import driver as cu

    err, handle = cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
    if int(err) != 0:
        raise RuntimeError(f"cuStreamCreate failed: {err}")
    return torch.cuda.ExternalStream(int(handle))  # type: ignore[no-untyped-call]


def unorder() -> None:
    """Every gate opened at once (timing only: the graph no longer waits for its loads)."""
    gate_open = staged.NativeGate.open

    def opened(self: Any, stream: object, pendings: Any) -> None:
        gate_open(self, stream, [])

    staged.NativeGate.open = opened  # type: ignore[method-assign]


def no_gate() -> None:
    """Gates that enqueue nothing (timing only)."""

    def nothing(self: Any, *args: Any) -> None:
        return None

    staged.NativeGate.open = nothing  # type: ignore[method-assign,assignment]
    staged.NativeGate.wait = nothing  # type: ignore[method-assign,assignment]


def patch(mode: str) -> None:
    """The backend's gate stream made the ``mode`` way: ``torch.cuda.Stream`` called without a
    priority inside the backend's constructor is the gate stream's (the copy streams pass one)."""
    init = staged.NativeStagedBackend.__init__
    real: Any = torch.cuda.Stream

    def stream(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **kwargs) if "priority" in kwargs else gate_stream(mode, real)

    def patched(self: Any, *args: Any, **kwargs: Any) -> None:
        torch.cuda.Stream = stream  # type: ignore[misc,assignment]
        try:
            init(self, *args, **kwargs)
        finally:
            torch.cuda.Stream = real  # type: ignore[misc]
        print(f"gate stream ({mode}): handle {self._gate_stream.cuda_stream:#x}")

    staged.NativeStagedBackend.__init__ = patched  # type: ignore[method-assign]


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in MODES or "--out" not in sys.argv:
        raise SystemExit(
            f"usage: gate_stream_bisect.py {{{','.join(MODES)}}} [bench e2e args] --out F"
        )
    if not torch.cuda.is_available():
        raise SystemExit("gate_stream_bisect.py: expected a CUDA device, got none")
    mode, args = sys.argv[1], sys.argv[2:]
    if mode in ("unordered", "default"):
        unorder()
    if mode == "nogate":
        no_gate()
    elif mode != "unordered":
        patch(mode)
    from kvoffload.cli import main as cli

    return int(cli(["bench", "e2e", *args]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
