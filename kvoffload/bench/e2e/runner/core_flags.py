"""The native core's variant flags (``staged-FLAG-...``): what each sets in ``StagedConfig``,
shared by ``kvoffload bench e2e --backend`` and ``variants.py``."""

from __future__ import annotations

from typing import Any

from kvoffload.transfer.registry import BACKENDS, register_backend

# the native core's settings per flag (StagedConfig fields)
SETTINGS: dict[str, dict[str, Any]] = {
    "inline": {"native_inline_bytes": 1 << 62},
    "thread": {"native_inline_bytes": 0},
    "ramp": {"first_slice_bytes": 64 << 10},
    "prio": {"copy_priority": -5},
    "whole": {"max_layer_slices": 1},
    "coupled": {"load_coupled": True},  # a load's copy and scatter on one DMA stream (default)
    "split": {"load_coupled": False},  # a load's scatter on its own streams (before 2026-11-26)
    # a store's gather on the kernels' stream, its copies after an event (before 2026-11-26)
    "ssplit": {"store_coupled": False},
    "most": {"plan_link_GBps": 0.0},  # the most slices the byte rules allow (before 2026-11-25)
    "wide": {"load_programs": 0},  # a load's scatter on one program per SM
    # a load's scatter on load_programs whatever its chunk's bytes (before 2026-11-27)
    "fixed": {"load_program_bytes": 0},
    "narrow": {"access_bytes": 8},  # 8-byte accesses in the copy kernels (before 2026-11-28)
}
# parametric flags: ``lpN`` scatters loads with N programs, ``pN`` gathers/scatters the rest,
# ``msN`` cuts a load into at most N layer slices, ``wN`` runs the kernels with N warps, ``dsN``
# copies on N DMA streams per direction, ``fcN`` starts a store's chunks at N KiB, ``xpN`` runs
# the exposed chunk's kernel (a store's first, a load's last) on at least N programs, ``hiN``
# reads the ids of jobs up to N blocks from host memory, ``cpN`` polls completion every <= N us,
# ``pbN`` scatters a load's chunk on one program per N KiB, ``wsN`` spins a job's waiter N us,
# ``ltN`` allows a load one layer slice per N KiB, ``laN`` stages a coupled load's chunk in N areas
# (``la1``: one area a chunk, before 2026-11-28)
NUMBERED = {
    "lp": ("load_programs", 1),
    "ms": ("max_layer_slices", 1),
    "p": ("programs", 1),
    "w": ("num_warps", 1),
    "ds": ("dma_streams", 1),
    "fc": ("first_chunk_bytes", 1024),
    "xp": ("exposed_programs", 1),
    "hi": ("host_ids", 1),
    "cp": ("completion_poll_us", 1),
    "pb": ("load_program_bytes", 1024),
    "ws": ("wait_spin_us", 1),
    "lt": ("layer_slice_transfer_bytes", 1024),
    "la": ("load_chunk_areas", 1),
}


def settings_of(flag: str) -> dict[str, Any] | None:
    """The StagedConfig fields a variant flag sets; None for a flag that is not one."""
    if flag in SETTINGS:
        return SETTINGS[flag]
    for prefix, (field, unit) in NUMBERED.items():
        rest = flag[len(prefix) :]
        if flag.startswith(prefix) and rest.isdigit() and int(rest) > 0:
            return {field: int(rest) * unit}
    return None


def configured(backend: str, flags: list[str]) -> str:
    """Register ``staged-<flags>``: the native core built with those flags' settings."""
    bad = [f for f in flags if settings_of(f) is None]
    if bad:
        raise ValueError(
            f"expected engine flags from {sorted(SETTINGS)} or lpN / msN / pN / wN / dsN / "
            f"fcN / xpN / hiN / cpN / pbN / wsN / ltN / laN, got {bad} in "
            f"{'-'.join([backend, *flags])!r}"
        )
    if backend != "staged":
        raise ValueError(
            f"expected backend 'staged' for -{'-'.join(flags)} (its engine's settings), got "
            f"{backend!r}"
        )
    name = "-".join([backend, *flags])
    if name not in BACKENDS:
        from kvoffload.transfer.cuda.staged import make_staged
        from kvoffload.transfer.cuda.staged_config import StagedConfig

        fields: dict[str, Any] = {}
        for flag in flags:
            fields.update(settings_of(flag) or {})
        config = StagedConfig(**fields)
        register_backend(name, lambda layout, arena: make_staged(layout, arena, config))
    return name
