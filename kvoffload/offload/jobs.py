"""What crosses from the scheduler side to the worker side and back: plain data."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvoffload.store.keys import BlockKey
from kvoffload.transfer.spec import Direction, TransferSpec


@dataclass(frozen=True, eq=False)
class TransferJob:
    job_id: int  # increasing per Offloader
    req_id: str
    direction: Direction
    # one per block, in spec order: bytes, or the rows of a read-only (n, 16) uint8 array where the
    # keys were given as one (Offloader.schedule_*)
    keys: tuple[BlockKey, ...] | np.ndarray
    specs: tuple[TransferSpec, ...]
    nbytes: int
    owner: str = ""  # the token of the Offloader that made it (``Offloader.token``)


@dataclass(frozen=True)
class JobResult:
    job_id: int
    ok: bool
    nbytes: int  # bytes moved (0 when not ok)
    seconds: float  # submit to completion, as seen by the worker
    error: str | None = None
    cancelled: bool = False  # stopped before it touched memory
    # A load past its deadline (``OffloadConfig.load_timeout_s``) is reported twice: first with
    # ``timed_out=True, final=False`` while its copy may still be writing (recompute its blocks;
    # the request stays unsettled), then with ``final=True`` once the copy really ended.
    timed_out: bool = False
    final: bool = True
