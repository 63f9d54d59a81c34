"""Eviction policies, chosen by name: ``make_policy("lru" | "arc", capacity)``."""

from __future__ import annotations

from kvoffload.store.policies.arc import ARCPolicy
from kvoffload.store.policies.base import EvictionPolicy
from kvoffload.store.policies.lru import LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"expected an eviction policy in {sorted(POLICIES)}, got {name!r}"
        ) from None
    return cls(capacity)


__all__ = ["POLICIES", "ARCPolicy", "EvictionPolicy", "LRUPolicy", "make_policy"]
