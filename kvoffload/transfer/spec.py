"""A transfer as data: which engine blocks go to (or come from) which host slots."""

from __future__ import annotations

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
        if not 0 <= self.group < len(layout.groups):
            raise ValueError(f"expected group in [0, {len(layout.groups)}), got {self.group}")
        if self.blocks.shape != self.slots.shape:
            raise ValueError(
                f"expected as many host slots as engine blocks, got {len(self.slots)} slots for "
                f"{len(self.blocks)} blocks"
            )
        _check_range(self.blocks, layout.groups[self.group].num_blocks, "engine block id")
        _check_range(self.slots, num_slots, "host slot")
        dst, what = (
            (self.slots, "host slot")
            if self.direction == "store"
            else (self.blocks, "engine block")
        )
        distinct = len(np.unique(dst))
        if distinct != len(dst):
            raise ValueError(
                f"expected distinct destination {what}s in one {self.direction}, got "
                f"{len(dst) - distinct} duplicates"
            )


def _check_range(ids: np.ndarray, upper: int, what: str) -> None:
    if len(ids) and (ids.min() < 0 or ids.max() >= upper):
        bad = ids[(ids < 0) | (ids >= upper)][0]
        raise ValueError(f"expected every {what} in [0, {upper}), got {bad}")
