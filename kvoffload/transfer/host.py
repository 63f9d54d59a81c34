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
from kvoffload.transfer.backend import (
    HOST_WAIT_ON_TIMEOUT,
    CopyBackend,
    LayerWaiter,
    Pending,
    check_layer,
)
from kvoffload.transfer.layout import KVLayout, Region
from kvoffload.transfer.spec import TransferSpec
from kvoffload.transfer.stall import StallTimer


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
    """How far one copy got, layer by layer (one condition, not an event per layer: a submit on
    the engine's thread builds one of these). ``fail`` wakes every waiter of the layers not
    done."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.arrived = 0  # layers [0, arrived) have arrived (or the copy failed: failed_from)
        self.failed_from: int | None = None  # first layer not copied, when the copy failed
        self._cond = threading.Condition(threading.Lock())

    def done(self, layer: int) -> None:
        with self._cond:
            self.arrived = max(self.arrived, layer + 1)
            self._cond.notify_all()

    def fail(self, layer: int) -> None:
        with self._cond:
            self.failed_from = layer
            self.arrived = self.layers
            self._cond.notify_all()

    def wait(self, layer: int, timeout: float) -> bool:
        """Block until ``layer`` has arrived (or the copy failed), up to ``timeout`` s."""
        if self.arrived > layer:  # no lock: a layer that arrived stays arrived
            return True
        with self._cond:
            return self._cond.wait_for(lambda: self.arrived > layer, timeout)


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
        signals = self._layers
        if layer is None or not 0 <= layer < signals.layers:
            super().wait_on(stream)
            return
        if not signals.wait(layer, HOST_WAIT_ON_TIMEOUT):
            raise TimeoutError(
                f"layer {layer} of the copy did not arrive within {HOST_WAIT_ON_TIMEOUT} s"
            )
        failed = signals.failed_from
        if failed is not None and layer >= failed:
            super().wait_on(stream)  # raises the copy's error (or returns if it was cancelled)

    def layer_waiter(
        self, stream: object = None, layers: int | None = None, timer: StallTimer | None = None
    ) -> LayerWaiter:
        """``wait_on(stream, layer)`` per call; a layer that has arrived (the copy not failed)
        returns at once, without a lock (and stood 0 for ``timer``)."""
        signals = self._layers

        def wait(layer: int) -> None:
            if layers is not None and (type(layer) is not int or not 0 <= layer < layers):
                check_layer(layer, layers)
            if 0 <= layer < signals.arrived and signals.failed_from is None:
                return
            if timer is None:
                self.wait_on(stream, layer)
            else:
                self.timed_wait(timer, stream, layer)

        return wait


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
        return self.submit_checked(specs)

    def submit_checked(self, specs: Sequence[TransferSpec], *, background: bool = False) -> Pending:
        """``submit`` without the checks: numpy bounds-checks every index of the copy anyway, so
        specs a ``TransferWorker``'s Offloader checked are not checked twice. Every copy runs on
        the backend's pool threads: ``background`` changes nothing."""
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
        signals.done(signals.layers - 1)  # every layer (a subclass may copy without signalling)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
