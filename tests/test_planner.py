"""The planner's choice from a given calibration table, and the ``auto`` backend's routing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvoffload.store.arena import HostArena
from kvoffload.transfer.backend import LayerGate, Pending
from kvoffload.transfer.calibration import CalibrationTable, Measurement
from kvoffload.transfer.host import HostBackend
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.planner import (
    DMA_PIECE_BYTES,
    PlannedBackend,
    Planner,
    RoutedGate,
    transfer_shape,
)
from kvoffload.transfer.spec import TransferSpec


def table(*rows: tuple[str, str, int, int, float]) -> CalibrationTable:
    return CalibrationTable("GPU", 1, tuple(Measurement(*r) for r in rows))


TABLE = table(
    ("staged", "store", 4096, 10240, 51.0),
    ("dma", "store", 4096, 10240, 4.7),
    ("sm", "store", 4096, 10240, 53.0),
    ("staged", "store", 2 << 20, 64, 50.0),
    ("dma", "store", 2 << 20, 64, 54.5),
    ("staged", "load", 4096, 10240, 48.0),
    ("dma", "load", 4096, 10240, 49.0),
)


def test_without_a_table_small_pieces_go_staged_and_whole_blocks_dma():
    planner = Planner(None)
    assert planner.choose("store", 32768, 2048) == "staged"
    assert planner.choose("load", DMA_PIECE_BYTES, 64) == "dma"
    assert Planner(None, candidates=("staged",)).choose("load", 4 << 20, 8) == "staged"


def test_the_fastest_candidate_at_the_nearest_point_wins():
    planner = Planner(TABLE)
    assert planner.choose("store", 4096, 8000) == "staged"  # sm is faster but not a candidate
    assert planner.choose("store", 1 << 20, 100) == "dma"  # nearest: the 2 MiB point
    assert planner.choose("load", 8192, 20000) == "dma"
    assert Planner(TABLE, candidates=("staged", "dma", "sm")).choose("store", 4096, 9000) == "sm"


def test_a_direction_the_table_lacks_falls_back_to_the_default():
    only_loads = table(("dma", "load", 4096, 64, 9.0))
    assert Planner(only_loads).choose("store", 4096, 64) == "staged"


def test_bad_shapes_raise_value_error():
    with pytest.raises(ValueError, match="piece_bytes > 0"):
        Planner(None).choose("store", 0, 5)
    with pytest.raises(ValueError, match="candidate"):
        Planner(None, candidates=())


def cpu_engine(pool: int = 10):
    rng = np.random.default_rng(0)
    tensors = [rng.integers(0, 256, (pool, 4096), dtype=np.uint8) for _ in range(3)]
    kv = KVLayout.from_tensors(tensors, block_size=16)
    arena = HostArena(pool, kv.slot_bytes)
    return tensors, kv, arena


def test_transfer_shape_counts_pieces_and_the_smallest_page():
    _, kv, arena = cpu_engine()
    specs = [TransferSpec.of("store", [1, 2, 3], [0, 1, 2])]
    assert transfer_shape(kv, specs) == (4096, 9)
    arena.close()


def test_planned_backend_routes_to_the_chosen_backend_and_moves_bytes():
    tensors, kv, arena = cpu_engine()
    made: list[str] = []

    def make(name, layout, a):
        made.append(name)
        return HostBackend(layout, a)

    planned = PlannedBackend(
        kv,
        arena,
        Planner(table(("dma", "store", 4096, 6, 9.0), ("staged", "store", 4096, 6, 8.0))),
        make,
    )
    try:
        assert planned.submit([TransferSpec.of("store", [4, 7], [1, 3])]).wait(10)
        assert made == ["dma"]
        for t, off in zip(tensors, (0, 4096, 8192), strict=True):
            assert np.array_equal(arena.slots[1, off : off + 4096], t[4])
            assert np.array_equal(arena.slots[3, off : off + 4096], t[7])
        planned.submit([TransferSpec.of("store", [5], [2])]).wait(10)
        assert made == ["dma"]  # built once, reused
        with pytest.raises(ValueError, match="host slot"):
            planned.submit([TransferSpec.of("store", [1], [99])])
    finally:
        planned.close()
        arena.close()


def test_with_the_other_direction_in_flight_the_both_rows_decide():
    both = table(
        ("staged", "load", 65536, 16384, 52.0),
        ("dma", "load", 65536, 16384, 50.0),
        ("staged", "both", 65536, 16384, 90.0),
        ("dma", "both", 65536, 16384, 99.0),
    )
    planner = Planner(both)
    assert planner.choose("load", 65536, 16384) == "staged"
    assert planner.choose("load", 65536, 16384, concurrent=True) == "dma"
    assert Planner(TABLE).choose("load", 4096, 9000, concurrent=True) == "dma"  # no both rows


class Held:
    """A pending that is done only once released."""

    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished


def test_planned_backend_sees_a_transfer_of_the_other_direction_in_flight():
    _, kv, arena = cpu_engine()
    both = table(
        ("staged", "load", 4096, 6, 9.0),
        ("dma", "load", 4096, 6, 8.0),
        ("dma", "both", 4096, 6, 17.0),
        ("staged", "both", 4096, 6, 15.0),
    )
    planned = PlannedBackend(kv, arena, Planner(both), lambda n, lay, a: HostBackend(lay, a))
    try:
        load = [TransferSpec.of("load", [4, 7], [1, 3])]
        assert planned.choose(load) == "staged"
        store = Held()
        planned._last["store"] = store  # type: ignore[assignment]
        assert planned.choose(load) == "dma"
        store.finished = True
        assert planned.choose(load) == "staged"
    finally:
        planned.close()
        arena.close()


class HeldPending(Pending):
    """A transfer that lands only once released; ``wait_on`` records the stream it ordered."""

    def __init__(self, log: list[Any]) -> None:
        self.finished = False
        self.log = log

    def done(self) -> bool:
        return self.finished

    def wait(self, timeout: float | None = None) -> bool:
        return self.finished

    def error(self) -> BaseException | None:
        return None

    def wait_on(self, stream: object = None, layer: int | None = None) -> None:
        self.log.append(("whole", self, stream))


class GateLog(LayerGate):
    def __init__(self, layers: int, log: list[Any]) -> None:
        super().__init__(layers)
        self.log = log

    def wait(self, stream: object, layer: int) -> None:
        self.log.append(("wait", layer, stream))

    def open(self, stream: object, pendings) -> None:
        self.log.append(("open", list(pendings), stream))


class HeldBackend(HostBackend):
    """Moves nothing: each submit is a ``HeldPending``; its gate logs what it is asked."""

    def __init__(self, layout, arena, log: list[Any]) -> None:
        super().__init__(layout, arena)
        self.log = log

    def submit(self, specs, **options):
        return HeldPending(self.log)

    def layer_gate(self, layers: int) -> LayerGate:
        return GateLog(layers, self.log)


def test_the_auto_gate_opens_the_native_engines_loads_layer_by_layer_and_others_whole():
    _, kv, arena = cpu_engine()
    log: list[Any] = []
    routes = table(("staged", "load", 4096, 3, 9.0), ("dma", "load", 4096, 6, 9.0))
    planned = PlannedBackend(kv, arena, Planner(routes), lambda n, lay, a: HeldBackend(lay, a, log))
    try:
        gate = planned.layer_gate(4)
        assert isinstance(gate, RoutedGate) and gate.layers == 4
        assert set(planned.backends) == {"staged"}  # the gate's backend, built for it
        gate.wait("s", 2)
        assert log == [("wait", 2, "s")]
        staged = planned.submit([TransferSpec.of("load", [1], [0])])  # 3 pieces: staged
        dma = planned.submit([TransferSpec.of("load", [2, 3], [1, 2])])  # 6 pieces: dma
        done = planned.submit([TransferSpec.of("load", [4], [3])])
        done.finished = True  # type: ignore[attr-defined]
        assert planned.owner(staged) == "staged" and planned.owner(dma) == "dma"
        log.clear()
        gate.open("s", [staged, dma, done])
        # the other backend's load whole first, then the gate opened for the engine's own
        assert log == [("whole", dma, "s"), ("open", [staged], "s")]
        with pytest.raises(ValueError, match="expected transfers"):
            gate.open("s", [staged, "job"])  # type: ignore[list-item]
        assert len(log) == 2  # refused whole: nothing waited, nothing opened
    finally:
        planned.close()
        arena.close()


def test_the_auto_gate_without_the_native_engine_is_the_plain_one():
    _, kv, arena = cpu_engine()
    planned = PlannedBackend(
        kv, arena, Planner(None, candidates=("dma",)), lambda n, lay, a: HostBackend(lay, a)
    )
    try:
        gate = planned.layer_gate(2)
        assert type(gate) is LayerGate and planned.backends == {}
    finally:
        planned.close()
        arena.close()
