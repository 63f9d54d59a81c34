"""What a caller hands the ``Offloader``, checked in the API's own words: engine block ids before
they are cast to int64 (so the message shows the value given, not its wrapped int64), and the
keys of a load that are not held on host."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvoffload.store.index import READABLE, BlockIndex
from kvoffload.store.keys import BlockKey, KeyArray, key_list

_INT64_MAX = int(np.iinfo(np.int64).max)


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
