"""Keys and block ids as arrays: the same results as lists, the caller's arrays never shared with a
job, bad arrays refused in the API's words (changing nothing). Also the checks that let the list
paths skip Python scans: a list of keys checked only where the index refuses or misses it, block
ids checked without a reduction per call for short jobs; both refuse exactly what they did."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvoffload import KVLayout, OffloadConfig, as_block_key, build_local, prefix_block_keys
from kvoffload.offload.jobs import JobResult, TransferJob
from kvoffload.offload.local import LocalOffload
from kvoffload.store.index import StorePlan
from kvoffload.transfer.spec import SMALL_IDS, TransferSpec, check_engine_blocks

NUM_BLOCKS, BS = 32, 16


def make_local() -> LocalOffload:
    gen = torch.Generator().manual_seed(0)
    kv = [
        torch.randint(-(2**15), 2**15, (2, NUM_BLOCKS, BS, 2, 32), dtype=torch.int16, generator=gen)
        for _ in range(2)
    ]
    made = build_local(
        KVLayout.from_tensors(kv, block_size=BS, block_dim=1), OffloadConfig(host_capacity_blocks=8)
    )
    made.kv = kv  # type: ignore[attr-defined]  # kept alive with the layout
    return made


@pytest.fixture
def local() -> Iterator[LocalOffload]:
    made = make_local()
    yield made
    made.close()


def run(local: LocalOffload, job: TransferJob | None) -> list[TransferJob]:
    assert job is not None
    local.worker.submit(job)
    assert local.worker.wait([job.job_id], timeout=30) == set()
    return local.offloader.complete(local.worker.get_finished())


def state(local: LocalOffload) -> tuple[object, ...]:
    off, ix = local.offloader, local.offloader.index
    return (ix.num_free, ix.num_writing, ix.num_readable, ix.num_pinned, off.in_flight())


def rows(keys: list[bytes]) -> np.ndarray:
    out: np.ndarray = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(-1, 16).copy()
    return out


def job_keys(job: TransferJob) -> list[bytes]:
    return [bytes(k) for k in job.keys]


def test_arrays_give_the_same_results_as_lists() -> None:
    """Two identical engines, one driven with lists (bytes keys, int ids), the other with arrays
    ((n, 16) uint8 keys; int64, int32 and uint16 ids): the same jobs, slots, hits, bytes."""
    keys = prefix_block_keys(np.arange(6 * BS), BS)
    a, b = make_local(), make_local()
    try:
        for ids_dtype in (np.int64, np.int32, np.uint16):
            for off in (a.offloader, b.offloader):
                off.index.reset()
            steps: list[tuple[str, str, list[bytes], list[int]]] = [
                ("store", "s1", keys[:3], [0, 1, 2]),
                ("store", "s2", keys[:5], [0, 1, 2, 3, 3]),  # three held, two new (one block twice)
                ("load", "l1", keys[:5], [20, 22, 21, 25, 24]),
            ]
            for direction, req, ks, ids in steps:
                schedule = f"schedule_{direction}"
                job_a = getattr(a.offloader, schedule)(req, ks, ids)
                job_b = getattr(b.offloader, schedule)(req, rows(ks), np.array(ids, ids_dtype))
                assert job_keys(job_a) == job_keys(job_b)
                for sa, sb in zip(job_a.specs, job_b.specs, strict=True):
                    assert np.array_equal(sa.blocks, sb.blocks)
                    assert np.array_equal(sa.slots, sb.slots)
                    assert sb.blocks.dtype == np.int64 and not sb.blocks.flags.writeable
                assert isinstance(job_b.keys, np.ndarray) and not job_b.keys.flags.writeable
                assert job_a.nbytes == job_b.nbytes
                run(a, job_a)
                run(b, job_b)
                assert a.offloader.lookup(keys) == b.offloader.lookup(rows(keys))
            assert a.offloader.lookup(keys) == b.offloader.lookup(rows(keys)) == 5
            for ta, tb in zip(a.kv, b.kv, strict=True):  # type: ignore[attr-defined]
                assert torch.equal(ta, tb)
                assert torch.equal(ta[:, [20, 22, 21, 25, 24]], ta[:, [0, 1, 2, 3, 3]])
            snap_a, snap_b = a.offloader.snapshot(), b.offloader.snapshot()
            assert snap_a == snap_b
    finally:
        a.close()
        b.close()


def test_a_callers_arrays_are_not_shared_with_the_job(local: LocalOffload) -> None:
    """The job's ids are its own read-only copy: the caller's array stays writable and changing
    it afterwards changes nothing (before, a load made the caller's int64 array read-only)."""
    off = local.offloader
    keys = prefix_block_keys(np.arange(2 * BS), BS)
    key_rows, src = rows(keys), np.array([0, 1], dtype=np.int64)
    store = off.schedule_store("s", key_rows, src)
    assert store is not None
    key_rows[:] = 0
    src[:] = 7
    assert job_keys(store) == keys and list(store.specs[0].blocks) == [0, 1]
    run(local, store)
    dst = np.array([5, 6], dtype=np.int64)
    load = off.schedule_load("l", rows(keys), dst)
    assert dst.flags.writeable
    dst[:] = 9
    assert list(load.specs[0].blocks) == [5, 6]
    run(local, load)


ARRAY_KEYS = [
    (np.zeros((2, 16), np.int64), r"int64 of shape \(2, 16\)"),
    (np.zeros((2, 17), np.uint8), r"uint8 of shape \(2, 17\)"),
    (np.zeros(32, np.uint8), r"uint8 of shape \(32,\)"),
    (np.zeros((2, 16), np.float32), r"float32 of shape \(2, 16\)"),
]
ARRAY_IDS = [
    (np.array([0.0, 1.0]), "expected int engine block ids, got dtype float64"),
    (np.array([[0, 1]]), r"expected a 1-D array of engine block ids, got shape \(1, 2\)"),
    (np.array([0, 1, 2]), r"expected one engine block per key \(2\), got 3"),
    (
        np.array([0, 2**64 - 1], np.uint64),
        r"expected engine block ids in \[0, 2\*\*63\), got 18446744073709551615",
    ),
    (
        np.array([0, NUM_BLOCKS]),
        rf"expected every engine block id in \[0, {NUM_BLOCKS}\), got {NUM_BLOCKS}",
    ),
    (np.array([-1, 0], np.int32), r"expected every engine block id in \[0, 32\), got -1"),
    (np.array([True, False]), "expected int engine block ids, got dtype bool"),
]


@pytest.mark.parametrize(("bad", "given"), ARRAY_KEYS)
def test_a_bad_key_array_is_refused_saying_what_was_given(
    local: LocalOffload, bad: np.ndarray, given: str
) -> None:
    off, before = local.offloader, state(local)
    expected = r"expected keys as a uint8 array of shape \(n, 16\), got "
    for call in ("lookup", "schedule_store", "schedule_load", "touch", "lookup_tiers"):
        args: tuple[Any, ...] = (
            (bad,) if call in ("lookup", "touch", "lookup_tiers") else ("r", bad, [0, 1])
        )
        with pytest.raises(ValueError, match=f"{call}: {expected}{given}"):
            getattr(off, call)(*args)
        assert state(local) == before and off.is_settled("r")


@pytest.mark.parametrize(("bad", "given"), ARRAY_IDS)
@pytest.mark.parametrize("keys_as", ["list", "array"])
def test_a_bad_block_id_array_is_refused_saying_what_was_given(
    local: LocalOffload, bad: np.ndarray, given: str, keys_as: str
) -> None:
    off = local.offloader
    keys = prefix_block_keys(np.arange(2 * BS), BS)
    run(local, off.schedule_store("s", keys, [0, 1]))
    before = state(local)
    ks: Any = rows(keys) if keys_as == "array" else keys
    for direction in ("store", "load"):
        with pytest.raises(ValueError, match=f"schedule_{direction}: {given}"):
            getattr(off, f"schedule_{direction}")("r", ks, bad)
        assert state(local) == before and off.is_settled("r")


def test_a_repeated_destination_in_a_load_array_is_refused(local: LocalOffload) -> None:
    off = local.offloader
    keys = prefix_block_keys(np.arange(2 * BS), BS)
    run(local, off.schedule_store("s", keys, [0, 1]))
    before = state(local)
    for ks in (keys, rows(keys)):
        with pytest.raises(ValueError, match="distinct destination engine blocks in one load"):
            off.schedule_load("r", ks, np.array([4, 4]))
        assert state(local) == before


def test_a_list_of_keys_is_refused_as_before_where_the_index_is_not_asked_first(
    local: LocalOffload,
) -> None:
    """Lists reach the index unscanned: whatever it refuses or misses is then checked in Python,
    so bad keys are refused with the same message, before bad block ids, anywhere in the list;
    int hashes and bytes subclasses are still keys."""
    off = local.offloader
    keys = prefix_block_keys(np.arange(3 * BS), BS)
    run(local, off.schedule_store("s", keys, [0, 1, 2]))
    before = state(local)
    for call in ("schedule_store", "schedule_load"):
        with pytest.raises(
            ValueError, match=f"{call}: expected keys as non-empty bytes.*position 1"
        ):
            getattr(off, call)("r", [keys[0], "abc"], [99, 99])  # bad key and bad blocks
        with pytest.raises(ValueError, match=f"{call}: expected one engine block per key"):
            getattr(off, call)("r", keys, [5])
        assert state(local) == before
    with pytest.raises(ValueError, match=r"lookup: expected keys as non-empty bytes.*position 3"):
        off.lookup([*keys, b""])  # a full hit up to the bad key: still refused
    assert off.lookup([*keys, b"absent", b"x" * 16]) == 3

    class Key(bytes):
        pass

    assert off.lookup([Key(k) for k in keys]) == 3
    load = off.schedule_load("l", [Key(keys[0]), keys[1]], [7, 8])
    assert all(type(k) is bytes for k in load.keys)
    run(local, load)
    ints: Any = [12345, 67890]  # int block hashes: keys by value
    run(local, off.schedule_store("i", ints[:1], [3]))
    assert off.lookup(ints[:1]) == off.lookup([as_block_key(12345)]) == 1
    run(local, off.schedule_load("j", ints[:1], [9]))
    with pytest.raises(ValueError, match=r"expected keys held on host.*1 are not held"):
        off.schedule_load("r", ints, [10, 11])
    with pytest.raises(ValueError, match="distinct keys"):
        off.schedule_store("r", [b"n" * 16, b"n" * 16], [10, 11])
    assert off.is_settled("r")


def reference_refusal(direction: str, ids: np.ndarray, upper: int | None) -> bool:
    """Whether ``check_engine_blocks`` must refuse ``ids``: checked the plain way."""
    low = bool(len(ids)) and int(ids.min()) < 0
    high = upper is not None and bool(len(ids)) and int(ids.max()) >= upper
    repeats = direction == "load" and len(np.unique(ids)) < len(ids)
    return low or high or repeats


@pytest.mark.parametrize("n", [0, 1, 2, SMALL_IDS, SMALL_IDS + 1, 300])
def test_block_id_checks_refuse_exactly_the_bad_ids(n: int) -> None:
    """The short-job path (Python min/max/set) and the long one (ascending ends) refuse exactly
    what the plain checks refuse, with the same message."""
    rng = np.random.default_rng(n)
    for trial in range(200):
        upper = int(rng.integers(max(n, 1), 4 * n + 8))
        shape = trial % 5
        if shape == 0:
            ids = np.arange(n, dtype=np.int64) + int(rng.integers(-1, 2))
        elif shape == 1:
            ids = rng.permutation(upper)[:n].astype(np.int64)
        elif shape == 2:
            ids = np.sort(rng.integers(-2, upper + 2, n)).astype(np.int64)
        else:
            ids = rng.integers(-1, upper + 1, n).astype(np.int64)
        for direction in ("store", "load"):
            for bound in (upper, None):
                groups = None if bound is None else [bound]
                want = reference_refusal(direction, ids, bound)
                try:
                    check_engine_blocks("load" if direction == "load" else "store", ids, 0, groups)
                    got = None
                except ValueError as err:
                    got = str(err)
                assert (got is not None) == want, (direction, bound, ids, got)
                if got is not None:
                    assert got.startswith("expected ")


@pytest.mark.parametrize("cls", [TransferJob, JobResult, TransferSpec, StorePlan])
def test_the_written_out_inits_take_the_declared_fields(cls: type) -> None:
    """These frozen dataclasses write their fields in their own ``__init__`` (faster than the
    generated one): it must take exactly the declared fields with the declared defaults."""
    params = list(inspect.signature(cls).parameters.values())
    fields = dataclasses.fields(cls)
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields, strict=True):
        if f.default is not dataclasses.MISSING:
            assert p.default == f.default, f.name
        elif f.default_factory is not dataclasses.MISSING:
            assert p.default is None, f.name  # None stands for a fresh default
        else:
            assert p.default is inspect.Parameter.empty, f.name


def test_written_out_inits_keep_frozen_dataclass_behaviour() -> None:
    result = JobResult(3, True, 64, 0.5)
    assert result == JobResult(3, True, 64, 0.5) and result.final and result.error is None
    assert dataclasses.replace(result, ok=False) == JobResult(3, False, 64, 0.5)
    assert pickle.loads(pickle.dumps(result)) == result and hash(result) == hash(
        JobResult(3, True, 64, 0.5)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.ok = False  # type: ignore[misc]
    spec = TransferSpec.of("load", [1], [2])
    job = TransferJob(1, "r", "load", (b"k",), (spec,), 64)
    assert job.owner == "" and job != TransferJob(1, "r", "load", (b"k",), (spec,), 64)  # eq=False
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.specs = ()  # type: ignore[misc]
    plan = StorePlan([b"k"], np.zeros(1, np.int64))
    assert plan.evicted == [] and plan.positions.dtype == np.int64 and len(plan.positions) == 0
    assert plan.evicted is not StorePlan([], np.zeros(0, np.int64)).evicted
