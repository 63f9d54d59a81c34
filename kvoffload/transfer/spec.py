"""A transfer as data: which engine blocks go to (or come from) which host slots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvoffload.transfer.layout import KVLayout

Direction = Literal["store", "load"]  # store: engine -> host; load: host -> engine
DIRECTIONS: tuple[Direction, ...] = ("store", "load")

# Up to this many int64 ids are checked by Python's min/max/set over ``tolist()`` (0.3 µs for
# one id, ~2 µs for 32), above it by numpy, whose reductions cost 1.5-4 µs a call whatever the
# length (AMD EPYC, 2 cores, Python 3.11, numpy 2.4: ``kvoffload bench store``).
SMALL_IDS = 32


@dataclass(frozen=True, eq=False, init=False)
class TransferSpec:
    direction: Direction
    blocks: np.ndarray  # engine block ids, int64, one per block
    slots: np.ndarray  # host slot ids, int64, same length
    group: int = 0  # layer group of the layout

    def __init__(
        self, direction: Direction, blocks: np.ndarray, slots: np.ndarray, group: int = 0
    ) -> None:
        # written out: one is made per transfer (see ``kvoffload.offload.jobs``)
        d = self.__dict__
        d["direction"], d["blocks"], d["slots"], d["group"] = direction, blocks, slots, group

    @classmethod
    def of(
        cls, direction: Direction, blocks: object, slots: object, group: int = 0
    ) -> TransferSpec:
        return cls(
            direction,
            np.ascontiguousarray(blocks, dtype=np.int64).reshape(-1),
            np.ascontiguousarray(slots, dtype=np.int64).reshape(-1),
            group,
        )

    def __len__(self) -> int:
        return len(self.blocks)

    def validate(self, layout: KVLayout, num_slots: int) -> None:
        """Raise ValueError unless this transfer is well-formed for ``layout`` and the arena."""
        if self.direction not in DIRECTIONS:
            raise ValueError(f"expected direction in {DIRECTIONS}, got {self.direction!r}")
        if self.blocks.shape != self.slots.shape:
            raise ValueError(
                f"expected as many host slots as engine blocks, got {len(self.slots)} slots for "
                f"{len(self.blocks)} blocks"
            )
        check_engine_blocks(
            self.direction, self.blocks, self.group, [g.num_blocks for g in layout.groups]
        )
        if not ids_fit(self.slots, num_slots, self.direction == "store"):
            _check_range(self.slots, num_slots, "host slot")
            if self.direction == "store":
                _check_distinct(self.slots, "host slot", self.direction)


def check_engine_blocks(
    direction: Direction, blocks: np.ndarray, group: int, group_blocks: Sequence[int] | None
) -> None:
    """Raise ValueError unless ``group`` names a layer group and ``blocks`` are engine block ids
    of it (``group_blocks``: blocks per group; None when unknown, then only ``>= 0`` is checked),
    distinct where they are a load's destinations."""
    if not isinstance(group, (int, np.integer)) or isinstance(group, bool):
        raise ValueError(f"expected an int layer group, got {group!r}")
    if group_blocks is None or 0 <= group < len(group_blocks):
        upper = None if group_blocks is None else group_blocks[group]
        if group >= 0 and ids_fit(blocks, upper, direction == "load"):
            return
    if group_blocks is None:
        if group < 0:
            raise ValueError(f"expected group >= 0, got {group}")
        if len(blocks) and blocks.min() < 0:
            raise ValueError(f"expected every engine block id >= 0, got {blocks.min()}")
    else:
        if not 0 <= group < len(group_blocks):
            raise ValueError(f"expected group in [0, {len(group_blocks)}), got {group}")
        _check_range(blocks, group_blocks[group], "engine block id")
    if direction == "load":
        _check_distinct(blocks, "engine block", direction)


def ids_fit(ids: np.ndarray, upper: int | None, distinct: bool) -> bool:
    """True when every id of the 1-D ``ids`` is in ``[0, upper)`` (``>= 0`` for None) and, with
    ``distinct``, none repeats: a few Python or numpy calls whatever the length. False where that
    is not so or not decided cheaply (not 1-D int64, distinct ids not ascending): the caller's
    checks then find and word the refusal."""
    if ids.dtype != np.int64 or ids.ndim != 1:
        return False
    n = len(ids)
    if not n:
        return True
    if n <= SMALL_IDS:
        vals = ids.tolist()
        low_ok = min(vals) >= 0 and (upper is None or max(vals) < upper)
        return low_ok and (not distinct or len(set(vals)) == n)
    if distinct:  # ascending ids are distinct and bounded by their ends; others are sorted later
        ascending = bool((ids[1:] > ids[:-1]).all())
        return ascending and int(ids[0]) >= 0 and (upper is None or int(ids[-1]) < upper)
    if upper is None:
        return bool(ids.min() >= 0)
    return int(ids.view(np.uint64).max()) < upper  # a negative id reads as >= 2**63


def check_distinct_across(specs: Sequence[TransferSpec]) -> None:
    """Raise ValueError where two specs of one direction and layer group share a destination
    (a store's host slot, a load's engine block): one submit is one job per direction, so both
    writes would race. Each spec is checked alone by ``validate``."""
    seen: dict[tuple[str, int], list[np.ndarray]] = {}
    for spec in specs:
        dst = spec.slots if spec.direction == "store" else spec.blocks
        seen.setdefault((spec.direction, int(spec.group)), []).append(dst)
    for (direction, _), parts in seen.items():
        if len(parts) > 1:
            what = "host slot" if direction == "store" else "engine block"
            _check_distinct(np.concatenate(parts), what, direction)


def _check_distinct(dst: np.ndarray, what: str, direction: str) -> None:
    if len(dst) < 2 or bool(np.all(dst[1:] > dst[:-1])):  # ascending: distinct, no sort
        return
    ordered = np.sort(dst)
    duplicates = int(np.count_nonzero(ordered[1:] == ordered[:-1]))
    if duplicates:
        raise ValueError(
            f"expected distinct destination {what}s in one {direction}, got {duplicates} duplicates"
        )


def _check_range(ids: np.ndarray, upper: int, what: str) -> None:
    # one pass: a negative int64 read as uint64 is >= 2**63, so beyond any upper bound
    if ids.dtype == np.int64:
        out = len(ids) and ids.view(np.uint64).max() >= upper
    else:
        out = len(ids) and (ids.min() < 0 or ids.max() >= upper)
    if out:
        bad = ids[(ids < 0) | (ids >= upper)][0]
        raise ValueError(f"expected every {what} in [0, {upper}), got {bad}")
