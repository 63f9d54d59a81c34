"""Engine block ids through the native check (``kvoffload/store/native/ids.c``) and the Python
checks it stands in front of: the same ids accepted, the same refusals, the job's own copy."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.config import OffloadConfig
from kvoffload.offload import Offloader
from kvoffload.offload.inputs import engine_block_ids
from kvoffload.store.index import native_index


def oracle(ids: list[int], upper: int, distinct: bool) -> bool:
    in_range = all(i >= 0 and (upper < 0 or i < upper) for i in ids)
    return in_range and (not distinct or len(set(ids)) == len(ids))


@pytest.mark.parametrize("upper", [-1, 1, 50, 1 << 25])
@pytest.mark.parametrize("distinct", [False, True])
def test_native_ids_agree_with_the_oracle(upper: int, distinct: bool) -> None:
    rng = np.random.default_rng(abs(upper) + distinct)
    ids_of = native_index().ids
    for n in (0, 1, 2, 5, 40, 300):
        for _ in range(20):
            ids = rng.integers(-2, 60, n).tolist()
            if rng.random() < 0.5:
                ids = sorted(set(ids)) if rng.random() < 0.5 else list(dict.fromkeys(ids))
            want = oracle(ids, upper, distinct)
            for given in (ids, tuple(ids), np.array(ids, dtype=np.int64)):
                got = ids_of(given, upper, distinct)
                assert (got is not None) == want, (given, upper, distinct)
                if got is not None:
                    assert np.frombuffer(got, np.int64).tolist() == ids


@pytest.mark.parametrize(
    "given",
    [
        [True, 1],
        [1.0],
        [np.int64(1)],
        [2**63],
        [-(2**63) - 1],
        np.array([1, 2], dtype=np.int32),
        np.array([1, 2], dtype=np.uint64),
        np.arange(4, dtype=np.int64)[::2],
        np.zeros((2, 1), dtype=np.int64),
        b"\x00" * 8,
        "ab",
        {1, 2},
        range(3),
    ],
)
def test_native_ids_leave_anything_else_to_the_python_checks(given: object) -> None:
    assert native_index().ids(given, 100, False) is None


def test_the_job_ids_are_read_only_copies() -> None:
    off = Offloader(OffloadConfig(host_capacity_blocks=8), slot_bytes=64, engine_blocks=[16])
    mine = np.array([3, 1], dtype=np.int64)
    job = off.schedule_store("r", [b"a", b"b"], mine)
    assert job is not None
    mine[0] = 9
    (spec,) = job.specs
    assert spec.blocks.tolist() == [3, 1]
    assert not spec.blocks.flags.writeable and not spec.slots.flags.writeable
    job = off.schedule_store("r", [b"a", b"c"], [5, 6])  # b"a" held: the blocks are chosen
    assert job is not None
    assert job.specs[0].blocks.tolist() == [6] and not job.specs[0].blocks.flags.writeable


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        ([0, 16], "expected every engine block id in [0, 16), got 16"),
        ([0, -1], "expected every engine block id in [0, 16), got -1"),
        ([2, 2], "expected distinct destination engine blocks in one load, got 1 duplicates"),
        ([2.0, 1.0], "expected int engine block ids, got dtype float64"),
        ([1], "expected one engine block per key (2), got 1"),
        (np.array([2**64 - 1, 1], dtype=np.uint64), "expected engine block ids in [0, 2**63)"),
    ],
)
def test_refusals_are_worded_as_before(blocks: object, message: str) -> None:
    with pytest.raises(ValueError, match=r"^schedule_load: ") as err:
        engine_block_ids("r", 2, blocks, 0, "load", (16,))  # type: ignore[arg-type]
    assert message in str(err.value)


def test_a_store_may_repeat_blocks_a_load_may_not() -> None:
    ids = engine_block_ids("r", 3, [4, 1, 4], 0, "store", (8,))
    assert ids.tolist() == [4, 1, 4]
    with pytest.raises(ValueError, match="duplicates"):
        engine_block_ids("r", 3, [4, 1, 4], 0, "load", (8,))
    assert engine_block_ids("r", 3, [4, 1, 0], 0, "load", None).tolist() == [4, 1, 0]
