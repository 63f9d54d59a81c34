"""Both halves in one process, for engines whose scheduler and worker share memory."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvoffload.config import OffloadConfig
from kvoffload.metrics import MetricsServer, serve
from kvoffload.offload.offloader import Offloader
from kvoffload.offload.tiers import TierMover, build_mover
from kvoffload.offload.worker import TransferWorker
from kvoffload.store.arena import HostArena
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.registry import make_backend
from kvoffload.transfer.topology import arena_placement

# Backends that copy between a GPU and host memory: refused for CPU tensors before anything is
# built (they would fail later, importing Triton or the CUDA driver).
CUDA_BACKENDS = ("staged", "dma", "sm")


@dataclass
class LocalOffload:
    """The Offloader, the TransferWorker built with it and the host arena they share.

    Safe to share between threads (each part has its own lock). ``close`` settles every job;
    after it the Offloader and the worker refuse new work with ValueError ("expected an open
    Offloader, got a closed one").
    """

    offloader: Offloader
    worker: TransferWorker
    arena: HostArena
    mover: TierMover | None = None  # the lower tiers' worker side, when the config names any
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _closed: bool = field(default=False, init=False)
    _metrics: list[MetricsServer] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.worker.offloader is not self.offloader:
            raise ValueError(
                "expected the TransferWorker built with this Offloader "
                "(TransferWorker(backend, offloader)), got a worker of another Offloader"
            )

    @property
    def closed(self) -> bool:
        return self._closed

    def serve_metrics(self, port: int, addr: str = "0.0.0.0") -> MetricsServer:
        """Expose this offload's Prometheus metrics over HTTP on ``addr:port`` (0: any free
        port; the server's ``port`` says which). Needs ``pip install -e '.[metrics]'``;
        ``docs/api.md`` lists the metrics. Stopped by ``close``."""
        with self._lock:
            if self._closed:
                raise ValueError("serve_metrics: expected an open LocalOffload, got a closed one")
            server = serve(self, port, addr)
            self._metrics.append(server)
            return server

    def close(self, tier_drain_s: float = 30.0, transfer_wait_s: float = 60.0) -> None:
        """Finish submitted transfers (up to ``transfer_wait_s`` seconds; those not started by
        then are cancelled) and apply their results, write host blocks still queued for the
        lower tiers (up to ``tier_drain_s`` seconds: the disk tier keeps them across a restart),
        then settle every job left (``Offloader.close``) and release. Afterwards every request is
        settled and no host slot is pinned. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.worker.close(transfer_wait_s)
        if not self.offloader.closed:
            self.offloader.complete(self.worker.get_finished())
        if self.mover is not None:
            if not self.offloader.closed:
                self.offloader.drain_tiers(tier_drain_s)
            self.mover.close()
        self.offloader.close()
        for server in self._metrics:
            server.close()
        self.arena.close()


def build_local(layout: KVLayout, config: OffloadConfig | None = None) -> LocalOffload:
    """An Offloader, a TransferWorker paired with it and the host arena they share, sized by
    ``config``.

    >>> off = build_local(KVLayout.from_tensors(kv_tensors, block_size=16))   # doctest: +SKIP
    """
    config = config or OffloadConfig()
    if config.backend in CUDA_BACKENDS and not layout.is_cuda:
        raise ValueError(
            f"expected a CUDA layout for backend {config.backend!r} (it copies between a GPU and "
            f"host memory), got tensors on {layout.device!r}: use backend 'host' or 'auto' for "
            "CPU tensors"
        )
    engine_blocks = [g.num_blocks for g in layout.groups]
    offloader = Offloader(config, layout.slot_bytes, engine_blocks, layout.block_size)
    pin = config.pin_memory if config.pin_memory is not None else layout.is_cuda
    pin_fn = None
    if pin:
        from kvoffload.transfer.pinning import cuda_pin

        pin_fn = cuda_pin
    nbytes = offloader.num_slots * layout.slot_bytes
    placement = arena_placement(config.numa_node, layout.device, nbytes)
    arena = HostArena(offloader.num_slots, layout.slot_bytes, pin=pin_fn, placement=placement)
    backend = None
    try:
        backend = make_backend(config.backend, layout, arena)
        mover = build_mover(layout, config, arena) if config.has_lower_tiers else None
    except BaseException:
        if backend is not None:
            backend.close()
        arena.close()
        raise
    if mover is not None:
        offloader.attach_tiers(mover)
    worker = TransferWorker(backend, offloader, config.load_timeout_s)
    return LocalOffload(offloader, worker, arena, mover)
