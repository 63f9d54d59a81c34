"""``Offload``: how the e2e engine uses kvoffload's host tier (mode ``kvoffload``)."""

from __future__ import annotations

from dataclasses import dataclass

ADMISSIONS = ("all", "reuse", "none")
STORES = ("behind", "evict")
HANDOVERS = ("background", "inline")
LOADS = ("layered", "blocking")


@dataclass(frozen=True)
class Offload:
    """How the engine uses kvoffload's host tier (mode ``kvoffload``)."""

    # Which requests' blocks go to host: "all"; "reuse": only a request that reused something (a
    # GPU or host hit, or a first block it shares with an earlier request that was not stored,
    # and then that earlier request's blocks still on the GPU too), so a stream of unrelated
    # prompts copies nothing; "none": nothing (lookups only).
    admission: str = "reuse"
    # When they go: "evict": once they come within ``store_lead`` times the most blocks one request
    # has allocated of the head of the GPU pool's free queue (the next to be evicted), so nothing
    # is copied while the pool has room; "behind": right after compute wrote them (write-behind).
    store: str = "evict"
    store_lead: float = 2.0
    # How a host hit meets prefill: "layered" (layer i's attention waits for layer i's blocks
    # only) or "blocking" (prefill starts once the whole load has arrived).
    load: str = "layered"
    # Time each layer's wait on the GPU (the exposed wait per layer): eager and piecewise through
    # kvoffload's StallTimer (two events per wait the waiter enqueues, recorded by the native
    # core in the wait's own call), full graphs by events captured in the graph. False
    # (diagnostic): the waits without that timing, full graphs captured without those events
    # (since 2026-11-27; before, ``--untimed-waits`` left them in the graph); load_exposed_ms
    # then reads "not measured".
    time_waits: bool = True
    # The stores a request hands over once its forward is launched, before its token is read
    # (``evict``): "background": kvoffload's thread enqueues their copies while this thread
    # waits for the device (``TransferWorker.step(jobs, background=True)``); "inline": this
    # thread does, inside the call (before 2026-11-27).
    store_handover: str = "background"
    # A restore's load (``layered``), handed over right before the forward's launch: "inline":
    # the engine's thread enqueues its copies inside the call; "background": kvoffload's
    # thread does (``TransferWorker.step(jobs, background=True)``) while the engine launches;
    # a layer's wait waits on the host for that layer's slice to be enqueued, a full graph's
    # gate for the whole load (since 2026-11-27; docs/api.md, "Background hand-over").
    load_handover: str = "inline"

    def __post_init__(self) -> None:
        for name, allowed in (
            ("admission", ADMISSIONS),
            ("store", STORES),
            ("load", LOADS),
            ("store_handover", HANDOVERS),
            ("load_handover", HANDOVERS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"expected {name} in {allowed}, got {getattr(self, name)!r}")
        if not self.store_lead > 0:
            raise ValueError(f"expected store_lead > 0, got {self.store_lead}")
