"""The copy-backend contract: ``CopyBackend`` and the ``Pending`` it returns. No backend here.

A backend moves the bytes of ``TransferSpec`` lists between an engine's KV tensors (described by a
``KVLayout``) and a ``HostArena``. ``submit`` must not block on the copy; it returns a ``Pending``
the caller polls or waits on. Adding a backend never touches the store.
The registry that builds one by name is ``kvoffload.transfer.registry``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from kvoffload.store.arena import HostArena
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import TransferSpec, check_distinct_across
from kvoffload.transfer.stall import StallTimer

# wait_on() of a CPU copy blocks the host at most this long: far above any real copy (a 1 GiB
# transfer takes ~0.3 s on a 2-core CI machine), so reaching it means something is stuck.
HOST_WAIT_ON_TIMEOUT = 60.0

LayerWaiter = Callable[[int], None]  # ``waiter(layer)``: ``Pending.layer_waiter``


class Pending(ABC):
    """One submitted transfer."""

    @abstractmethod
    def done(self) -> bool:
        """True once the copy finished (successfully or not); never blocks."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> bool:
        """Block up to ``timeout`` seconds; True if the copy finished."""

    @abstractmethod
    def error(self) -> BaseException | None:
        """After ``done``: the exception the copy raised, or None."""

    def cancel(self) -> bool:
        """Try to stop a copy that has not started; True if it will never touch memory."""
        return False

    def enqueued(self) -> bool:
        """True once everything the copy does is enqueued (or it will never run), so a
        ``wait_on`` of the whole copy would not wait on the host for our enqueue (a CPU
        backend's ``wait_on`` still waits for the copy itself); never blocks. Backends that hand
        a copy to a thread of theirs (``submit(background=True)``) override it."""
        return True

    def wait_on(self, stream: object = None, layer: int | None = None) -> None:
        """Order ``stream``'s later work after this copy, or with ``layer`` after the part of it
        that moves that layer (an index into the layer group's layers, ``LayerGroup.layer_starts``:
        the engine's attention for layer i may then read the loaded blocks while later layers are
        still arriving). GPU backends make the stream wait on the device (the host does not block);
        CPU backends have no device stream, so this waits on the host, up to
        ``HOST_WAIT_ON_TIMEOUT`` seconds (TimeoutError), and raises the copy's error.

        This default waits for the whole copy whatever ``layer`` is (every layer has arrived by
        then); backends that move a load layer by layer override it. The caller checks ``layer``
        against the layout (``TransferWorker.wait_on`` does).
        """
        if not self.wait(HOST_WAIT_ON_TIMEOUT):
            raise TimeoutError(f"the copy did not finish within {HOST_WAIT_ON_TIMEOUT} s")
        error = self.error()
        if error is not None:
            raise error

    def layer_waiter(
        self, stream: object = None, layers: int | None = None, timer: StallTimer | None = None
    ) -> LayerWaiter:
        """``wait_on`` bound to ``stream``, for an engine that waits once per layer: the stream is
        resolved once, each call then costs what the backend's wait costs. With ``layers``, a
        layer outside ``[0, layers)`` is refused (ValueError, as ``check_layer``) by the waiter
        itself; without, the caller checks it, as for ``wait_on``. With ``timer``, each layer's
        wait is timed into it (``StallTimer``; this default: on the host clock, the wait being
        the host's)."""

        def wait(layer: int) -> None:
            if layers is not None and (type(layer) is not int or not 0 <= layer < layers):
                check_layer(layer, layers)
            if timer is None:
                self.wait_on(stream, layer)
            else:
                self.timed_wait(timer, stream, layer)

        return wait

    def timed_wait(self, timer: StallTimer, stream: object, layer: int) -> None:
        """``wait_on(stream, layer)`` timed into ``timer``: here on the host clock (the wait is
        the host's); a backend whose waits are the device's times them there."""
        timer.host_wait(layer, lambda: self.wait_on(stream, layer))


def check_layer(layer: object, layers: int) -> None:
    """ValueError unless ``layer`` is an int (not a bool) in ``[0, layers)``. A waiter called
    once per layer tests ``type(layer) is int and 0 <= layer < layers`` inline first and calls
    this only when that fails (an int subclass may still pass here)."""
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers:
        raise ValueError(f"expected a layer in [0, {layers}), got {layer!r}")


class LayerGate:
    """Per-layer readiness at fixed places, for an engine whose whole forward is one CUDA graph.

    A graph replays the waits it captured with the values it captured, so a wait on "job j's
    layer i" cannot be captured once and replayed for the next job. A gate can: ``wait(stream,
    layer)`` is captured inside the graph ("wait until ``layer`` is open"), and ``open(stream,
    pendings)``, called eagerly once per step before the replay on the same stream, closes every
    layer (after the replays enqueued so far) and opens each once every listed transfer has
    landed it (at once for none). Call it before every replay: a replay without its own ``open``
    passes the layers the last one opened.

    This default, for backends without GPU flag words (and CPU ones), keeps the contract the
    plain way: ``wait`` enqueues nothing and ``open`` makes ``stream`` wait for each listed
    transfer whole (``Pending.wait_on``), so the replay starts once they have all landed.
    """

    def __init__(self, layers: int) -> None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"expected a layer gate of >= 1 layers, got {layers!r}")
        self.layers = layers

    def check(self, layer: int) -> None:
        check_layer(layer, self.layers)

    def wait(self, stream: object, layer: int) -> None:
        """Enqueue on ``stream`` (capturable): wait until ``layer`` is open."""
        self.check(layer)

    def open(self, stream: object, pendings: Sequence[Pending]) -> None:
        """Close every layer, then open each for the next replay on ``stream`` once ``pendings``
        landed it."""
        for pending in pendings:
            pending.wait_on(stream)


class CopyBackend(ABC):
    name: str = ""

    def __init__(self, layout: KVLayout, arena: HostArena) -> None:
        if arena.slot_bytes < layout.slot_bytes:
            raise ValueError(
                f"expected host slots of at least {layout.slot_bytes} bytes for this layout, "
                f"got {arena.slot_bytes}"
            )
        self.layout = layout
        self.arena = arena

    @abstractmethod
    def submit(self, specs: Sequence[TransferSpec]) -> Pending:
        """Start copying ``specs`` (validated first: ValueError for bad input)."""

    def submit_checked(self, specs: Sequence[TransferSpec], *, background: bool = False) -> Pending:
        """``submit`` for specs the caller has already validated against this backend's layout
        and arena (a ``TransferWorker`` paired with its ``Offloader`` does: ``schedule_*``
        checked them); a backend may skip the costlier checks (GPU backends skip the duplicate
        checks, keeping the range checks). This default is ``submit``. ``background``: enqueue
        on the backend's own thread where it has one (the native ``staged`` core), not the
        caller's; a backend without one ignores it. ``TransferWorker`` passes it only when true,
        so a backend that predates it keeps working."""
        return self.submit(specs)

    def validate(self, specs: Sequence[TransferSpec]) -> None:
        for spec in specs:
            spec.validate(self.layout, self.arena.num_slots)
        check_distinct_across(specs)

    def layer_gate(self, layers: int) -> LayerGate:
        """A ``LayerGate`` of ``layers`` layers for this backend's transfers."""
        return LayerGate(layers)

    def close(self) -> None:
        return


BackendFactory = Callable[[KVLayout, HostArena], CopyBackend]
