"""Both halves in one process, for engines whose scheduler and worker share memory."""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.config import OffloadConfig
from kvoffload.offload.offloader import Offloader
from kvoffload.offload.tiers import TierMover, build_mover
from kvoffload.offload.worker import TransferWorker
from kvoffload.store.arena import HostArena
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.registry import make_backend


@dataclass
class LocalOffload:
    offloader: Offloader
    worker: TransferWorker
    arena: HostArena
    mover: TierMover | None = None  # the lower tiers' worker side, when the config names any

    def close(self, tier_drain_s: float = 30.0) -> None:
        """Finish transfers, write host blocks still queued for the lower tiers (up to
        ``tier_drain_s`` seconds: the disk tier keeps them across a restart), then release."""
        self.worker.close()
        if self.mover is not None:
            self.offloader.drain_tiers(tier_drain_s)
            self.mover.close()
        self.arena.close()


def build_local(layout: KVLayout, config: OffloadConfig | None = None) -> LocalOffload:
    """An Offloader, a TransferWorker and the host arena they share, sized by ``config``.

    >>> off = build_local(KVLayout.from_tensors(kv_tensors, block_size=16))   # doctest: +SKIP
    """
    config = config or OffloadConfig()
    offloader = Offloader(config, layout.slot_bytes)
    pin = config.pin_memory if config.pin_memory is not None else layout.is_cuda
    pin_fn = None
    if pin:
        from kvoffload.transfer.pinning import cuda_pin

        pin_fn = cuda_pin
    arena = HostArena(offloader.num_slots, layout.slot_bytes, pin=pin_fn)
    backend = make_backend(config.backend, layout, arena)
    mover = build_mover(layout, config, arena) if config.has_lower_tiers else None
    if mover is not None:
        offloader.attach_tiers(mover)
    return LocalOffload(offloader, TransferWorker(backend), arena, mover)
