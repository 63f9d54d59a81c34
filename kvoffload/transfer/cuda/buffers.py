"""Pinned host buffers (with device twins) that transfers reuse instead of allocating.

A transfer takes a buffer, fills its host side with numpy (block ids, descriptor tables), uploads
it if the GPU must read it, and gives it back with ``release(stream)``: the buffer is reused once
the work enqueued on ``stream`` up to that point has finished (an event marks it). When every
buffer is still in use a new one is made, so taking one never waits.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvoffload.transfer.cuda import driver as cu

MIN_CAPACITY = 4096  # int64 entries; grows by doubling


@dataclass
class Buffer:
    host: np.ndarray  # int64, page-locked
    pinned: Any  # the torch tensor owning ``host``
    device: Any  # torch int64 tensor of the same capacity, or None
    event: int  # marks the last use

    @property
    def capacity(self) -> int:
        return len(self.host)

    def upload(self, driver: cu.CudaDriver, n: int, stream: int) -> None:
        """Enqueue the copy of ``host[:n]`` to ``device[:n]`` on ``stream``."""
        driver.memcpy(self.host.ctypes.data, int(self.device.data_ptr()), 8 * n, stream)


class BufferRing:
    def __init__(self, device: Any, with_device: bool) -> None:
        self._device = device
        self._with_device = with_device
        self._buffers: list[Buffer] = []
        self._held: set[int] = set()  # taken and not yet released
        self._lock = threading.Lock()  # the store and load submitter threads share a ring

    def take(self, n: int) -> Buffer:
        """A buffer of at least ``n`` int64 entries that no enqueued work still uses."""
        with self._lock:
            return self._take(n)

    def _take(self, n: int) -> Buffer:
        for i, buf in enumerate(self._buffers):
            if i in self._held or not cu.event_done(buf.event):
                continue
            if buf.capacity < n:
                buf = self._buffers[i] = self._make(n, buf.event)
            self._held.add(i)
            return buf
        self._buffers.append(self._make(n, cu.event_create()))
        self._held.add(len(self._buffers) - 1)
        return self._buffers[-1]

    def release(self, buf: Buffer, stream: int) -> None:
        """Give ``buf`` back; it is reused once ``stream`` has passed this point."""
        with self._lock:
            cu.event_record(buf.event, stream)
            self._held.discard(next(i for i, b in enumerate(self._buffers) if b is buf))

    def close(self) -> None:
        for buf in self._buffers:
            cu.event_destroy(buf.event)
        self._buffers.clear()

    def _make(self, n: int, event: int) -> Buffer:
        import torch

        cap = max(MIN_CAPACITY, 1 << max(0, n - 1).bit_length())
        pinned = torch.empty(cap, dtype=torch.int64, pin_memory=True)
        dev = (
            torch.empty(cap, dtype=torch.int64, device=self._device) if self._with_device else None
        )
        return Buffer(pinned.numpy(), pinned, dev, event)
