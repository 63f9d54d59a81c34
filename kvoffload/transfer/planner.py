"""The planner: which copy backend moves a given transfer, from this machine's calibration table.

A transfer is characterised by its direction, its piece size (bytes of one block of one region)
and its piece count (blocks x regions). The planner takes the measured point nearest to it (in
log2 of piece size and of count) and picks the candidate method with the highest GB/s there.
When a transfer of the other direction is still in flight, it looks at the table's ``both`` rows
instead (a store and a load of that shape at once, GB/s summed), where they were measured: on the
H100 ``dma`` moved 99 GB/s both ways on 64 KiB pieces against 90 for ``staged``, while on 2 KiB
pieces ``staged`` moved 91 against 15 (2026-11-23).
Candidates are ``staged`` and ``dma`` by default: ``sm`` is fast but occupies SMs for the whole
transfer and slows the model beside it, so it is chosen only when asked for.

Without a table (``kvoffload calibrate`` not run for this GPU and driver) it answers ``staged``,
near the link on every layout measured with little SM time, except for pieces of at least
``DMA_PIECE_BYTES`` (a cross-layer layout's whole-block pieces), which the copy engines move at the
link directly, so a gather would only add work (see docs/transfer.md for the measurements).

``PlannedBackend`` is the ``auto`` backend on a CUDA layout: it routes each ``submit`` to the
backend the planner picks, building each backend on first use. Its layer gate (a forward captured
whole in a CUDA graph) is the native engine's, so a load the engine moved opens layer by layer; a
load another backend moved opens it once landed whole. Until 2026-11-26 ``auto`` gave the plain
gate, so every full-graph replay waited for its whole load (``bench e2e --graph full``, Qwen2.5-7B
docs on an H200: 4.3-4.5 ms of a 4.7 ms load, docs/e2e.md "Sixth round").
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.store.arena import HostArena
from kvoffload.transfer.backend import CopyBackend, LayerGate, Pending
from kvoffload.transfer.calibration import CalibrationTable
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import TransferSpec

DEFAULT_METHOD = "staged"
# Without a table, pieces this large go to ``dma``: on the lent H100 (driver 580, 2026-11-22,
# benchmarks/results/transfer_nvidia-h100-80gb-hbm3_2026-11-22.json) one descriptor per
# 640 KiB-6 MiB cross-layer piece reached 0.75-1.01 of the link (median 0.98) and was ahead of
# ``staged`` end to end in 16 of 24 (configuration, direction) pairs: a gather only adds work.
DMA_PIECE_BYTES = 512 << 10
DEFAULT_CANDIDATES = ("staged", "dma")


class Planner:
    def __init__(
        self, table: CalibrationTable | None, candidates: Sequence[str] = DEFAULT_CANDIDATES
    ) -> None:
        if not candidates:
            raise ValueError("expected at least one candidate method, got none")
        self.table = table
        self.candidates = tuple(candidates)
        self._cache: dict[tuple[str, int, int, bool], str] = {}

    def choose(
        self, direction: str, piece_bytes: int, pieces: int, concurrent: bool = False
    ) -> str:
        """The method for a ``direction`` transfer of ``pieces`` pieces of ``piece_bytes``;
        ``concurrent``: a transfer of the other direction is in flight."""
        if piece_bytes <= 0 or pieces <= 0:
            raise ValueError(
                f"expected piece_bytes > 0 and pieces > 0, got {piece_bytes}, {pieces}"
            )
        key = (direction, piece_bytes, pieces, concurrent)
        if key not in self._cache:
            self._cache[key] = self._choose(*key)
        return self._cache[key]

    def _choose(self, direction: str, piece_bytes: int, pieces: int, concurrent: bool) -> str:
        if self.table is None:
            return self._default(piece_bytes)
        rows = []
        for want in ("both", direction) if concurrent else (direction,):
            rows = [
                e for e in self.table.entries if e.direction == want and e.method in self.candidates
            ]
            if rows:
                break
        if not rows:
            return self._default(piece_bytes)

        def distance(point: tuple[int, int]) -> float:
            return abs(math.log2(point[0] / piece_bytes)) + abs(math.log2(point[1] / pieces))

        nearest = min({(e.piece_bytes, e.pieces) for e in rows}, key=distance)
        at = [e for e in rows if (e.piece_bytes, e.pieces) == nearest]
        return max(at, key=lambda e: e.gbps).method

    def _default(self, piece_bytes: int) -> str:
        if piece_bytes >= DMA_PIECE_BYTES and "dma" in self.candidates:
            return "dma"
        return DEFAULT_METHOD if DEFAULT_METHOD in self.candidates else self.candidates[0]


def transfer_shape(layout: KVLayout, specs: Sequence[TransferSpec]) -> tuple[int, int]:
    """(piece bytes, pieces) of a transfer: its smallest region page and its piece count."""
    return shape_of(group_shapes(layout), specs)


def group_shapes(layout: KVLayout) -> tuple[tuple[int, int], ...]:
    """Per layer group, (regions, smallest region page in bytes): what ``shape_of`` reads."""
    return tuple((len(g.regions), min(r.page_bytes for r in g.regions)) for g in layout.groups)


def shape_of(groups: Sequence[tuple[int, int]], specs: Sequence[TransferSpec]) -> tuple[int, int]:
    """``transfer_shape`` from ``group_shapes``: O(specs), not O(regions) (a Llama page layout
    has 32 regions a group, walked on every submit before)."""
    pieces = sum(len(s) * groups[s.group][0] for s in specs)
    piece = min(groups[s.group][1] for s in specs)
    return piece, max(pieces, 1)


class PlannedBackend(CopyBackend):
    """``auto`` on a GPU: each transfer goes to the backend the planner picks for it."""

    name = "auto"

    def __init__(
        self,
        layout: KVLayout,
        arena: HostArena,
        planner: Planner,
        make: Callable[[str, KVLayout, HostArena], CopyBackend],
    ) -> None:
        super().__init__(layout, arena)
        self.planner = planner
        self._make = make
        self._groups = group_shapes(layout)
        self.backends: dict[str, CopyBackend] = {}
        self._last: dict[str, Pending] = {}  # per direction, the latest transfer submitted
        # which backend moves each transfer still referenced (a layer gate routes by it)
        self._owner: weakref.WeakKeyDictionary[Pending, str] = weakref.WeakKeyDictionary()

    def choose(self, specs: Sequence[TransferSpec]) -> str:
        if not specs:
            return self.planner.choose("store", 1, 1)
        piece, pieces = shape_of(self._groups, specs)
        direction = specs[0].direction
        other = self._last.get("load" if direction == "store" else "store")
        # transfers of one direction finish in order, so the latest one tells
        concurrent = other is not None and not other.done()
        return self.planner.choose(direction, piece, pieces, concurrent)

    def submit(self, specs: Sequence[TransferSpec], **options: Any) -> Pending:
        specs = list(specs)
        self.validate(specs)
        return self._route(specs, checked=False, options=options)

    def submit_checked(self, specs: Sequence[TransferSpec], **options: Any) -> Pending:
        """The chosen backend's ``submit_checked`` (its own checks, not this one's)."""
        return self._route(list(specs), checked=True, options=options)

    def _route(self, specs: list[TransferSpec], checked: bool, options: dict[str, Any]) -> Pending:
        name = self.choose(specs)
        backend = self._backend(name)
        if checked:
            pending = backend.submit_checked(specs, **options)
        else:
            pending = backend.submit(specs, **options)
        self._owner[pending] = name
        if specs:
            self._last[specs[0].direction] = pending
        return pending

    def _backend(self, name: str) -> CopyBackend:
        if name not in self.backends:
            self.backends[name] = self._make(name, self.layout, self.arena)
        return self.backends[name]

    def owner(self, pending: Pending) -> str | None:
        """The name of the backend that moves ``pending`` (None: not submitted here)."""
        return self._owner.get(pending)

    def layer_gate(self, layers: int) -> LayerGate:
        """``DEFAULT_METHOD``'s gate (the native engine's flag words: its loads open each layer
        as it lands) when that method is a candidate, routed by ``RoutedGate``; else the plain
        gate (each load waited for whole)."""
        if DEFAULT_METHOD not in self.planner.candidates:
            return super().layer_gate(layers)
        return RoutedGate(self, self._backend(DEFAULT_METHOD).layer_gate(layers))

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
        self.backends.clear()


class RoutedGate(LayerGate):
    """``PlannedBackend.layer_gate``: the waits are ``inner``'s (``DEFAULT_METHOD``'s gate).
    ``open`` hands ``inner`` the transfers that backend moves (each layer opens as it lands); a
    transfer another backend moves is waited for whole on ``stream`` first, so the gate opens
    after it too; a finished one needs nothing."""

    def __init__(self, planned: PlannedBackend, inner: LayerGate) -> None:
        super().__init__(inner.layers)
        self._planned = planned
        self.inner = inner

    def wait(self, stream: object, layer: int) -> None:
        self.inner.wait(stream, layer)

    def open(self, stream: object, pendings: Sequence[Pending]) -> None:
        for p in pendings:
            if not isinstance(p, Pending):
                raise ValueError(f"expected transfers (Pending), got {type(p).__name__}")
        own: list[Pending] = []
        other: list[Pending] = []
        for p in pendings:
            if p.done():
                continue
            (own if self._planned.owner(p) == DEFAULT_METHOD else other).append(p)
        for p in other:  # before inner's open: the gate's opening is ordered after these waits
            p.wait_on(stream)
        self.inner.open(stream, own)


def make_planned(
    layout: KVLayout, arena: HostArena, make: Callable[[str, KVLayout, HostArena], CopyBackend]
) -> PlannedBackend:
    """The ``auto`` backend for a CUDA layout, with this GPU's cached table (if any); ``make``
    builds a backend by name (the registry passes its ``make_backend``, so the planner never
    imports the registry)."""
    import torch

    from kvoffload.transfer.calibration import load_cached
    from kvoffload.transfer.cuda.driver import driver_version

    device = torch.device(layout.device)
    table = load_cached(torch.cuda.get_device_name(device), driver_version())
    return PlannedBackend(layout, arena, Planner(table), make)
