"""Mode ``gpu_all_copy``: the ideal engine (``gpu_all``'s pool, nothing evicted) with the bytes a
restore moves crossing the link beside its forward, and none of kvoffload's code.

Per request, right after ``kvoffload`` ran it, one host-to-device copy of the bytes kvoffload's
load of that request moved (``load_bytes``), from pinned host memory into a scratch device buffer
on a side stream (one ``copy_``: one driver call), started where ``kvoffload`` starts its load:
after the inputs' upload, before the forward. Nothing waits for it. What it costs the forward
(the host launch phase, TTFT) against ``gpu_all`` is what the machine charges for moving those
bytes at all; ``results.beside`` sets kvoffload's restored requests against it, so the growth
over ``gpu_all`` splits into the copy's share and ours, measured in the same run.
"""

from __future__ import annotations

import torch

MODE = "gpu_all_copy"


class BesideCopy:
    """The side copy of one ``gpu_all_copy`` engine: ``start(n)`` moves ``n`` bytes (at most
    ``capacity``, allocated here, outside any timed request)."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"BesideCopy: expected capacity > 0 bytes, got {capacity}")
        cuda = device.type == "cuda"
        self.capacity = capacity
        self._src = torch.ones(capacity, dtype=torch.uint8, pin_memory=cuda)
        self._dst = torch.empty(capacity, dtype=torch.uint8, device=device)
        self._stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]

    def start(self, n: int) -> None:
        if not 0 <= n <= self.capacity:
            raise ValueError(f"BesideCopy: expected 0 to {self.capacity} bytes, got {n}")
        if n == 0:
            return
        if self._stream is None:  # a CPU: the bytes move now, in this thread
            self._dst[:n].copy_(self._src[:n])
            return
        with torch.cuda.stream(self._stream):
            self._dst[:n].copy_(self._src[:n], non_blocking=True)

    def sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def landed(self, n: int) -> bool:
        """Whether the first ``n`` bytes arrived (tests; waits for the copy)."""
        self.sync()
        return bool(torch.equal(self._dst[:n].cpu(), self._src[:n]))
