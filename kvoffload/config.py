"""OffloadConfig: every user-facing option, validated once, at the boundary."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.store.arena import slots_for_capacity
from kvoffload.store.policies import POLICIES

DEFAULT_HOST_CAPACITY_BYTES = 4 << 30
BACKEND_NAMES = ("auto", "host", "staged", "dma", "sm")


@dataclass(frozen=True)
class OffloadConfig:
    # Host RAM for offloaded KV, in bytes. Give this or host_capacity_blocks, not both; with
    # neither, 4 GiB.
    host_capacity_bytes: int | None = None
    # Host RAM for offloaded KV, in blocks (one block = one host slot, all layers of a group).
    host_capacity_blocks: int | None = None
    # Which block to give up when the host tier is full: "lru" or "arc".
    eviction_policy: str = "lru"
    # Copy backend: "auto" (host for CPU tensors, the calibrated choice on a GPU), "host",
    # "staged", "dma" or "sm".
    backend: str = "auto"
    # Page-lock the host arena: None pins it when the engine's KV is on a CUDA device.
    pin_memory: bool | None = None

    def __post_init__(self) -> None:
        if self.host_capacity_bytes is not None and self.host_capacity_blocks is not None:
            raise ValueError(
                "expected host_capacity_bytes or host_capacity_blocks, got both "
                f"({self.host_capacity_bytes}, {self.host_capacity_blocks})"
            )
        for name in ("host_capacity_bytes", "host_capacity_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"expected {name} to be a positive int, got {value!r}")
        if self.eviction_policy not in POLICIES:
            raise ValueError(
                f"expected eviction_policy in {sorted(POLICIES)}, got {self.eviction_policy!r}"
            )
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"expected backend in {list(BACKEND_NAMES)}, got {self.backend!r}")
        if self.pin_memory not in (None, True, False):
            raise ValueError(
                f"expected pin_memory to be None, True or False, got {self.pin_memory!r}"
            )

    def num_slots(self, slot_bytes: int) -> int:
        """Host slots for blocks of ``slot_bytes``; ValueError if not even one fits."""
        if self.host_capacity_blocks is not None:
            return self.host_capacity_blocks
        capacity = self.host_capacity_bytes or DEFAULT_HOST_CAPACITY_BYTES
        return slots_for_capacity(capacity, slot_bytes)

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> OffloadConfig:
        """Build from user options (JSON, a CLI); unknown keys raise ValueError naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown kvoffload option(s) {unknown}; expected some of {sorted(known)}"
            )
        return cls(**dict(options))
