"""What crosses from the scheduler side to the worker side and back: plain data."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvoffload.store.keys import BlockKey
from kvoffload.transfer.spec import Direction, TransferSpec

# Both are frozen dataclasses with the ``__init__`` written out: the generated one of a frozen
# dataclass sets each field through ``object.__setattr__`` (1.4 µs for eight fields on the CI CPU,
# 0.4 µs written into ``__dict__``), and one of each is made per transfer on the engine's thread.
# ``tests/test_offload_api.py`` checks that each ``__init__`` takes the fields as declared.


@dataclass(frozen=True, eq=False, init=False)
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

    def __init__(
        self,
        job_id: int,
        req_id: str,
        direction: Direction,
        keys: tuple[BlockKey, ...] | np.ndarray,
        specs: tuple[TransferSpec, ...],
        nbytes: int,
        owner: str = "",
    ) -> None:
        d = self.__dict__
        d["job_id"], d["req_id"], d["direction"], d["keys"] = job_id, req_id, direction, keys
        d["specs"], d["nbytes"], d["owner"] = specs, nbytes, owner


@dataclass(frozen=True, init=False)
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

    def __init__(
        self,
        job_id: int,
        ok: bool,
        nbytes: int,
        seconds: float,
        error: str | None = None,
        cancelled: bool = False,
        timed_out: bool = False,
        final: bool = True,
    ) -> None:
        d = self.__dict__
        d["job_id"], d["ok"], d["nbytes"], d["seconds"] = job_id, ok, nbytes, seconds
        d["error"], d["cancelled"], d["timed_out"], d["final"] = error, cancelled, timed_out, final
