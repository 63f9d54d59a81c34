"""A store's chunk plan in the native core: chunks double from ``first_chunk_bytes`` up to one
staging area, and a tail shorter than the first chunk joins the chunk before it where the two fit
an area (no one-block chunk after a large one: each chunk costs the caller four driver calls). The
fake driver logs each launch's block count; the bytes are the host backend's."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.transfer.spec import TransferSpec
from tests.fake_cuda import Calls, fake_cuda  # noqa: F401 (the fixture)
from tests.test_cuda_backends_on_cpu import POOL
from tests.test_native_engine import engine_on, needs_core


def expected_chunks(n: int, first: int, largest: int) -> list[int]:
    """The rule, written plainly."""
    sizes, size, left = [], first, n
    while left:
        take = min(size, left)
        if left - take < first and left <= largest:
            take = left
        sizes.append(take)
        left -= take
        size = min(2 * size, largest)
    return sizes


def test_the_rule_merges_only_a_short_tail() -> None:
    assert expected_chunks(37, 12, 409) == [12, 25]  # fp8 TP8 blocks, 4 MiB first chunk
    assert expected_chunks(36, 12, 409) == [12, 24]
    assert expected_chunks(13, 12, 409) == [13]
    assert expected_chunks(7, 2, 4) == [2, 4, 1]  # 4 + 1 exceed an area: the tail stays
    assert expected_chunks(1, 2, 4) == [1]


@needs_core
@pytest.mark.parametrize("coupled", [False, True])
@pytest.mark.parametrize(("first", "area"), [(2, 4), (3, 8), (1, 3)])
def test_store_chunks_follow_the_rule_and_move_the_oracles_bytes(
    fake_cuda: Calls,  # noqa: F811
    coupled: bool,
    first: int,
    area: int,
) -> None:
    with engine_on("llama3-8b", "page", store_coupled=coupled) as (pair, _):
        slot = pair.kv.slot_bytes
    config = {"staging_bytes": 2 * area * slot, "depth": 2, "first_chunk_bytes": first * slot}
    with engine_on("llama3-8b", "page", store_coupled=coupled, **config) as (pair, backend):
        rng = np.random.default_rng(first * 10 + area)
        for count in range(1, POOL + 1):
            spec = TransferSpec.of(
                "store",
                rng.choice(POOL, count, replace=False),
                rng.choice(POOL, count, replace=False),
            )
            start = len(fake_cuda.log)
            pending = backend.submit([spec])
            assert pending.wait(10) and pending.error() is None
            pair.oracle.copy([spec])
            pair.check()
            blocks = [e[2] for e in fake_cuda.log[start:] if e[0] == "launch"]
            assert blocks == expected_chunks(count, first, area), count
