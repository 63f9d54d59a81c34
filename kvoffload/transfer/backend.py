"""The copy-backend contract, and the registry that builds one by name.

A backend moves the bytes of ``TransferSpec`` lists between an engine's KV tensors (described by a
``KVLayout``) and a ``HostArena``. ``submit`` must not block on the copy; it returns a ``Pending``
the caller polls or waits on. Adding a backend never touches the store.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from kvoffload.store.arena import HostArena
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import TransferSpec

# wait_on() of a CPU copy blocks the host at most this long: far above any real copy (a 1 GiB
# transfer takes ~0.3 s on a 2-core CI machine), so reaching it means something is stuck.
HOST_WAIT_ON_TIMEOUT = 60.0


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

    def validate(self, specs: Sequence[TransferSpec]) -> None:
        for spec in specs:
            spec.validate(self.layout, self.arena.num_slots)

    def close(self) -> None:
        return


BackendFactory = Callable[[KVLayout, HostArena], CopyBackend]


def _host(layout: KVLayout, arena: HostArena) -> CopyBackend:
    from kvoffload.transfer.host import HostBackend

    return HostBackend(layout, arena)


def _dma(layout: KVLayout, arena: HostArena) -> CopyBackend:
    from kvoffload.transfer.cuda.dma import DmaBackend

    return DmaBackend(layout, arena)


def _sm(layout: KVLayout, arena: HostArena) -> CopyBackend:
    from kvoffload.transfer.cuda.sm import SmBackend

    return SmBackend(layout, arena)


def _staged(layout: KVLayout, arena: HostArena) -> CopyBackend:
    from kvoffload.transfer.cuda.staged import StagedBackend

    return StagedBackend(layout, arena)


BACKENDS: dict[str, BackendFactory] = {"host": _host, "dma": _dma, "sm": _sm, "staged": _staged}


def register_backend(name: str, factory: BackendFactory) -> None:
    BACKENDS[name] = factory


def make_backend(name: str, layout: KVLayout, arena: HostArena) -> CopyBackend:
    """Build a backend by name; ``auto`` picks ``host`` for CPU layouts and, for CUDA layouts, a
    planner that routes each transfer by this GPU's calibration table (``staged`` without one)."""
    if name == "auto":
        if layout.is_cuda:
            from kvoffload.transfer.planner import make_planned

            return make_planned(layout, arena)
        name = "host"
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"expected a copy backend in {sorted([*BACKENDS, 'auto'])}, got {name!r}"
        ) from None
    return factory(layout, arena)
