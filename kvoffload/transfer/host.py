"""The ``host`` backend: CPU memory to CPU memory with numpy, for CPU engines, CI and as the oracle.

Each region of the layout is viewed as a strided ``(num_blocks, page_bytes)`` uint8 array over its
address; a transfer is then one fancy-indexed copy per region (no per-block Python). Copies run on
one background thread (numpy releases the GIL while copying), so ``submit`` returns at once.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvoffload.store.arena import HostArena
from kvoffload.transfer.backend import CopyBackend, Pending
from kvoffload.transfer.layout import KVLayout, Region
from kvoffload.transfer.spec import TransferSpec


def region_view(region: Region) -> np.ndarray:
    """A writable (num_blocks, page_bytes) uint8 view of a CPU region."""
    span = (region.num_blocks - 1) * region.block_stride + region.page_bytes
    buf = (ctypes.c_uint8 * span).from_address(region.base)
    flat = np.ctypeslib.as_array(buf)
    return as_strided(flat, (region.num_blocks, region.page_bytes), (region.block_stride, 1))


class FuturePending(Pending):
    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self._future.exception(timeout)
        except FutureTimeout:
            return False
        except CancelledError:
            return True
        return True

    def error(self) -> BaseException | None:
        if self._future.cancelled():
            return None
        return self._future.exception(0)

    def cancel(self) -> bool:
        return self._future.cancel()


class HostBackend(CopyBackend):
    name = "host"

    def __init__(self, layout: KVLayout, arena: HostArena) -> None:
        if layout.is_cuda:
            raise ValueError(
                f"expected a CPU layout for the host backend, got device {layout.device}"
            )
        super().__init__(layout, arena)
        self._views = [[region_view(r) for r in g.regions] for g in layout.groups]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-host")

    def copy(self, specs: Sequence[TransferSpec]) -> None:
        """Copy synchronously in the calling thread."""
        slots = self.arena.slots
        for spec in specs:
            group = self.layout.groups[spec.group]
            for view, off, region in zip(
                self._views[spec.group], group.offsets, group.regions, strict=True
            ):
                host = slice(off, off + region.page_bytes)
                if spec.direction == "store":
                    slots[spec.slots, host] = view[spec.blocks]
                else:
                    view[spec.blocks] = slots[spec.slots, host]

    def submit(self, specs: Sequence[TransferSpec]) -> Pending:
        self.validate(specs)
        return FuturePending(self._pool.submit(self.copy, list(specs)))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
