"""What a caller hands the ``Offloader``, checked in the API's own words: engine block ids before
they are cast to int64 (so the message shows the value given, not its wrapped int64), and the
keys of a load that are not held on host.

Engine block ids that fit (a list of ints or an int64 array, in range, distinct for a load) are
copied and checked by one native call (``kvoffload/store/native/ids.c``): no Python per id, ~0.3
µs for a few. Anything else takes the numpy checks, which word the refusal."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvoffload.store.index import READABLE, BlockIndex, native_index
from kvoffload.store.keys import BlockKey, KeyArray, key_list
from kvoffload.transfer.spec import Direction, check_engine_blocks

_INT64_MAX = int(np.iinfo(np.int64).max)
_INT64 = np.dtype(np.int64)


def engine_block_ids(
    req_id: str,
    n: int,
    blocks: Sequence[int] | np.ndarray,
    group: int,
    direction: Direction,
    engine_blocks: tuple[int, ...] | None,
) -> np.ndarray:
    """``schedule_*``'s ``blocks`` checked as ``n`` engine block ids of ``group`` (of
    ``engine_blocks`` per group; None: only ``>= 0``), as a read-only int64 array of their own (a
    caller's array is copied: the job's ids cannot change with it). ValueError else."""
    if not isinstance(req_id, str):
        raise ValueError(f"schedule_{direction}: expected a str req_id, got {req_id!r}")
    uppers = (-1,) if engine_blocks is None else engine_blocks  # -1: only >= 0
    if type(group) is int and 0 <= group < len(uppers):
        fast = native_index().ids(blocks, uppers[group], direction == "load")
        if fast is not None and len(fast) == 8 * n:
            return np.frombuffer(fast, _INT64)  # read-only: bytes
    raw = np.asarray(blocks)
    if raw.ndim != 1:
        raise ValueError(
            f"schedule_{direction}: expected a 1-D array of engine block ids, got shape {raw.shape}"
        )
    if raw.dtype != np.int64:
        check_block_ids(raw, f"schedule_{direction}")
        if raw.size and raw.dtype.kind not in "iu":
            raise ValueError(
                f"schedule_{direction}: expected int engine block ids, got dtype {raw.dtype}"
            )
    if len(raw) != n:
        raise ValueError(
            f"schedule_{direction}: expected one engine block per key ({n}), got {len(raw)}"
        )
    if isinstance(blocks, (list, tuple)):  # ``raw`` is new
        arr = np.ascontiguousarray(raw, dtype=np.int64)
    else:
        arr = np.array(raw, dtype=np.int64)
    try:
        check_engine_blocks(direction, arr, group, engine_blocks)
    except ValueError as err:
        raise ValueError(f"schedule_{direction}: {err}") from None
    arr.setflags(write=False)  # a job is data that cannot change once checked
    return arr


def check_block_ids(raw: np.ndarray, where: str) -> None:
    """ValueError when an engine block id does not fit int64 (a uint64 ``2**64 - 1``, a Python
    int ``2**63`` or more), showing the id as given; other checks come after the cast."""
    if raw.dtype == object:
        ints = [v for v in raw.ravel() if isinstance(v, int) and not isinstance(v, bool)]
        wide = [v for v in ints if not -_INT64_MAX - 1 <= v <= _INT64_MAX]
        if wide:
            raise ValueError(f"{where}: expected engine block ids in [0, 2**63), got {wide[0]}")
    elif raw.dtype.kind == "u" and raw.size and int(raw.max()) > _INT64_MAX:
        raise ValueError(f"{where}: expected engine block ids in [0, 2**63), got {int(raw.max())}")


def not_held(
    index: BlockIndex, keys: Sequence[BlockKey] | KeyArray, where: str, refused: ValueError
) -> ValueError:
    """The refusal of a load asking for ``keys`` of which some are not held on host (never
    stored, evicted, or still being stored); the index's own ``refused`` for anything else."""
    keys = key_list(keys)
    absent = [i for i, key in enumerate(keys) if index.state(key) != READABLE]
    if not absent:
        return ValueError(f"{where}: {refused}")
    first = absent[0]
    return ValueError(
        f"{where}: expected keys held on host (as many as lookup(keys) returned), got "
        f"{len(keys)} keys of which {len(absent)} are not held, the first at position {first} "
        f"({keys[first].hex()[:32]})"
    )
