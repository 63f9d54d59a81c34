"""The copy-backend registry: a backend by name. Each factory imports its backend on first use,
so naming a backend never loads CUDA, and the interface (``kvoffload.transfer.backend``) imports
no backend at all."""

from __future__ import annotations

from kvoffload.store.arena import HostArena
from kvoffload.transfer.backend import BackendFactory, CopyBackend
from kvoffload.transfer.layout import KVLayout


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
    from kvoffload.transfer.cuda.engine import make_staged

    return make_staged(layout, arena)


BACKENDS: dict[str, BackendFactory] = {
    "host": _host,
    "dma": _dma,
    "sm": _sm,
    "staged": _staged,  # the native engine where it can run, else dma (``path_reason`` says why)
}


def register_backend(name: str, factory: BackendFactory) -> None:
    BACKENDS[name] = factory


def make_backend(name: str, layout: KVLayout, arena: HostArena) -> CopyBackend:
    """Build a backend by name; ``auto`` picks ``host`` for CPU layouts and, for CUDA layouts, a
    planner that routes each transfer by this GPU's calibration table (``staged`` without one)."""
    if name == "auto":
        if layout.is_cuda:
            from kvoffload.transfer.planner import make_planned

            return make_planned(layout, arena, make_backend)
        name = "host"
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"expected a copy backend in {sorted([*BACKENDS, 'auto'])}, got {name!r}"
        ) from None
    return factory(layout, arena)
