"""A transfer as data: which engine blocks go to (or come from) which host slots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvoffload.transfer.layout import KVLayout

Direction = Literal["store", "load"]  # store: engine -> host; load: host -> engine
DIRECTIONS: tuple[Direction, ...] = ("store", "load")


@dataclass(frozen=True, eq=False)
class TransferSpec:
    direction: Direction
    blocks: np.ndarray  # engine block ids, int64, one per block
    slots: np.ndarray  # host slot ids, int64, same length
    group: int = 0  # layer group of the layout

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
