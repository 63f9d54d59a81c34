"""What crosses from the scheduler side to the worker side and back: plain data."""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.store.keys import BlockKey
from kvoffload.transfer.spec import Direction, TransferSpec


@dataclass(frozen=True, eq=False)
class TransferJob:
    job_id: int
    req_id: str
    direction: Direction
    keys: tuple[BlockKey, ...]  # one per block, in spec order
    specs: tuple[TransferSpec, ...]
    nbytes: int


@dataclass(frozen=True)
class JobResult:
    job_id: int
    ok: bool
    nbytes: int  # bytes moved (0 when not ok)
    seconds: float  # submit to completion, as seen by the worker
    error: str | None = None
    cancelled: bool = False  # stopped before it touched memory
