"""The ``host`` backend: CPU memory to CPU memory with numpy, for CPU engines, CI and as the oracle.

Each region of the layout is viewed as a strided ``(num_blocks, page_bytes)`` uint8 array over its
address; a transfer is then one fancy-indexed copy per region (no per-block Python). Copies run on
one background thread (numpy releases the GIL while copying), so ``submit`` returns at once.
They go layer by layer (layer-major across the specs of one submit), and each layer's end is
signalled, so ``wait_on(layer=i)`` returns as soon as layer i has arrived.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvoffload.store.arena import HostArena
from kvoffload.transfer.backend import HOST_WAIT_ON_TIMEOUT, CopyBackend, Pending
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


class LayerSignals:
    """The end of each layer of one copy; ``fail`` wakes every waiter of the layers not done."""

    def __init__(self, layers: int) -> None:
        self.events = [threading.Event() for _ in range(layers)]
        self.failed_from: int | None = None  # first layer not copied, when the copy failed

    def done(self, layer: int) -> None:
        self.events[layer].set()

    def fail(self, layer: int) -> None:
        self.failed_from = layer
        for event in self.events[layer:]:
            event.set()


class HostPending(FuturePending):
    def __init__(self, future: Future[None], layers: LayerSignals) -> None:
        super().__init__(future)
        self._layers = layers

    def cancel(self) -> bool:
        cancelled = super().cancel()
        if cancelled:
            self._layers.fail(0)
        return cancelled

    def wait_on(self, stream: object = None, layer: int | None = None) -> None:
        if layer is None or not 0 <= layer < len(self._layers.events):
            super().wait_on(stream)
            return
        if not self._layers.events[layer].wait(HOST_WAIT_ON_TIMEOUT):
            raise TimeoutError(
                f"layer {layer} of the copy did not arrive within {HOST_WAIT_ON_TIMEOUT} s"
            )
        failed = self._layers.failed_from
        if failed is not None and layer >= failed:
            super().wait_on(stream)  # raises the copy's error (or returns if it was cancelled)


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
        self._job = threading.local()  # ``signals`` of the submitted copy running on a thread

    def copy(self, specs: Sequence[TransferSpec]) -> None:
        """Copy synchronously in the calling thread, layer by layer (a submitted copy signals the
        end of each layer to its ``wait_on(layer=...)`` waiters)."""
        signals: LayerSignals | None = getattr(self._job, "signals", None)
        layer = 0
        try:
            for layer in range(self._num_layers(specs)):
                for spec in specs:
                    group = self.layout.groups[spec.group]
                    if layer < group.num_layers:
                        for r in group.layer_regions(layer):
                            self._copy_region(spec, r)
                if signals is not None:
                    signals.done(layer)
        except BaseException:
            if signals is not None:
                signals.fail(layer)
            raise

    def _copy_region(self, spec: TransferSpec, r: int) -> None:
        group = self.layout.groups[spec.group]
        off, page = group.offsets[r], group.regions[r].page_bytes
        view, host = self._views[spec.group][r], slice(off, off + page)
        if spec.direction == "store":
            self.arena.slots[spec.slots, host] = view[spec.blocks]
        else:
            view[spec.blocks] = self.arena.slots[spec.slots, host]

    def _num_layers(self, specs: Sequence[TransferSpec]) -> int:
        return max((self.layout.groups[s.group].num_layers for s in specs), default=0)

    def submit(self, specs: Sequence[TransferSpec]) -> Pending:
        self.validate(specs)
        specs = list(specs)
        layers = LayerSignals(self._num_layers(specs))
        return HostPending(self._pool.submit(self._run, specs, layers), layers)

    def _run(self, specs: list[TransferSpec], signals: LayerSignals) -> None:
        """A submitted copy, on the pool's thread: ``copy`` (which subclasses may wrap) finds
        this job's signals in a thread-local, so its signature stays ``copy(specs)``."""
        self._job.signals = signals
        try:
            self.copy(specs)
        except BaseException:
            signals.fail(0 if signals.failed_from is None else signals.failed_from)
            raise
        finally:
            self._job.signals = None
        for layer in range(len(signals.events)):  # a subclass copying without signalling
            signals.done(layer)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
