"""vLLM 0.33.0's tier scenarios (``tests/vllm/upstream/``) run against vLLM's ``fs`` tier and ours.

Each scenario below is one of vLLM's own ``test_fs_tier.py`` / ``test_tiering_offloading.py`` /
``test_async_lookup.py`` scenarios that is not about files, written once over a ``kind`` fixture:
vLLM's ``FileSystemTierManager`` (the reference), ``KVOffloadDiskTier``, and
``KVOffloadValkeyTier`` on a real server. Specs are vLLM's test specs (a real ``OffloadingConfig``
inside a ``MagicMock``) or a bare ``MagicMock()``, as vLLM's tests pass them. Every load is checked
byte for byte. Where ours differs on purpose the test says so (docs/vllm.md gives the reason).
"""

from __future__ import annotations

import os
import time
from typing import Any
from unittest.mock import MagicMock

import numpy as np
import pytest

pytest.importorskip("vllm")
if not os.environ.get("CI"):  # under CI a missing Valkey client is a failure, not a skip
    pytest.importorskip("redis")

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    ReqContext,
)
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

from kvoffload.integrations.vllm.row_identity import layout_free, model_identity, row_fingerprint
from tests.vllm.tier_support import (
    CTX,
    END,
    KINDS,
    OURS,
    ROW_BYTES,
    ROWS,
    Build,
    drain,
    key,
    make_job,
    mock_spec,
    resolve,
    rows,
    store,
)

# -- lookups, stores, loads (test_fs_tier.py) ----------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_lookup_of_an_empty_tier_is_a_miss(build: Build, kind: str) -> None:
    assert resolve(build(kind), [key(1), key(2)]) == [LookupResult.MISS] * 2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", [0, 1, 2, 5])
def test_store_then_load_moves_the_bytes(build: Build, kind: str, batch: int) -> None:
    data = rows(random=True)
    expected = data[:batch].copy()
    tier = build(kind, data=data)
    keys = [key(i) for i in range(batch)]
    store(tier, keys, list(range(batch)))
    assert resolve(tier, keys) == [LookupResult.HIT] * batch
    data[:] = 0  # the load must bring the bytes back from the tier
    into = list(range(ROWS - batch, ROWS))
    tier.submit_load(make_job(2, keys, into, promotion=True))
    assert [r.success for r in drain(tier)] == [True]
    assert np.array_equal(data[ROWS - batch :], expected)
    assert not data[: ROWS - batch].any()  # no other row was written


@pytest.mark.parametrize("kind", KINDS)
def test_jobs_are_tracked_independently(build: Build, kind: str) -> None:
    tier = build(kind)
    tier.submit_store(make_job(1, [key(1)], [0]))
    tier.submit_store(make_job(2, [key(2)], [1]))
    assert {r.job_id for r in drain(tier)} == {1, 2}
    assert resolve(tier, [key(1), key(2)]) == [LookupResult.HIT] * 2


@pytest.mark.parametrize("kind", KINDS)
def test_load_of_a_missing_key_fails(build: Build, kind: str) -> None:
    tier = build(kind)
    tier.submit_load(make_job(1, [key(99)], [0], promotion=True))
    (result,) = drain(tier)
    assert not result.success and not result.successful_keys


@pytest.mark.parametrize("kind", KINDS)
def test_batch_load_with_a_missing_key_keeps_what_loaded(build: Build, kind: str) -> None:
    """vLLM's fs tier stops at the first bad block (keys after it are dropped even when good);
    ours load every key and report each one that loaded: a difference on purpose."""
    data = rows(random=True)
    expected = data[[0, 1]].copy()
    tier = build(kind, data=data)
    store(tier, [key(10), key(11)], [0, 1])
    data[:] = 0
    tier.submit_load(make_job(2, [key(10), key(99), key(11)], [4, 5, 6], promotion=True))
    (result,) = drain(tier)
    assert not result.success
    if kind == "fs":
        assert tuple(result.successful_keys) == (key(10),)
    else:
        assert tuple(result.successful_keys) == (key(10), key(11))
        assert np.array_equal(data[6], expected[1])
    assert np.array_equal(data[4], expected[0])


# -- KV events (test_fs_tier.py) -----------------------------------------------------------------


def events_spec() -> Any:
    return mock_spec(events=True)


@pytest.mark.parametrize("kind", KINDS)
def test_a_store_emits_one_stored_event(build: Build, kind: str) -> None:
    tier = build(kind, spec=events_spec(), enable_kv_events=True, locality="LOCAL")
    store(tier, [key(1), key(2)], [0, 1])
    (event,) = list(tier.take_events())
    assert event.keys == [key(1), key(2)] and not event.removed
    assert event.medium == Medium.STORAGE and event.locality is Locality.LOCAL
    assert list(tier.take_events()) == []  # taken once
    tier.submit_load(make_job(2, [key(1)], [3], promotion=True))
    assert [r.success for r in drain(tier)] == [True]
    assert list(tier.take_events()) == []  # a load announces nothing new


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec_events", [False, True])
def test_events_need_the_entry_and_vllms_switch(build: Build, kind: str, spec_events: bool) -> None:
    spec = mock_spec(events=spec_events)
    tier = build(kind, spec=spec, **({} if spec_events else {"enable_kv_events": True}))
    store(tier, [key(1)], [0])
    assert list(tier.take_events()) == []


@pytest.mark.parametrize("kind", OURS)
def test_ownership_names_the_tier(build: Build, kind: str) -> None:
    tier = build(kind, spec=events_spec(), enable_kv_events=True)
    store(tier, [key(1)], [0])
    (event,) = list(tier.take_events())
    assert event.ownership == tier.tier_type and event.removal_expected


@pytest.mark.parametrize("kind", KINDS)
def test_cascade_through_the_tiering_manager_emits_the_tiers_event(build: Build, kind: str) -> None:
    data = rows()
    region = MagicMock()
    region.create_kv_memoryview.return_value = data.data
    primary = CPUPrimaryTierOffloadingManager(num_chunks=ROWS, mmap_region=region)
    tier = build(kind, spec=events_spec(), data=data, enable_kv_events=True)
    manager = TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier])
    manager.on_new_request(CTX)
    assert manager.prepare_store([key(1), key(2)], CTX) is not None
    manager.complete_store([key(1), key(2)], CTX)
    events: list[Any] = []
    deadline = time.monotonic() + 10
    while not any(e.medium == Medium.STORAGE for e in events):
        assert time.monotonic() < deadline, "no event from the tier"
        manager.on_schedule_end(END)
        events.extend(manager.take_events())
        time.sleep(0.01)
    (stored,) = [e for e in events if e.medium == Medium.STORAGE]
    assert set(stored.keys) == {key(1), key(2)} and not stored.removed


# -- TP sizes (test_fs_tier.py: test_fs_tier_cross_tp_round_trip) --------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_replicated_chunks_written_at_tp2_are_hits_at_tp4(build: Build, kind: str) -> None:
    data = rows(random=True)
    expected = data[0].copy()
    writer = build(kind, spec=mock_spec(tp_size=2, replicated_layout=True), data=data)
    store(writer, [key(7)], [0])
    writer.shutdown()  # the disk tier's directory is one process's at a time
    into = rows()
    spec = mock_spec(tp_size=4, replicated_layout=True)
    reader = build(kind, spec=spec, data=into)
    assert resolve(reader, [key(7)]) == [LookupResult.HIT]
    reader.submit_load(make_job(2, [key(7)], [1], promotion=True))
    assert [r.success for r in drain(reader)] == [True]
    assert np.array_equal(into[1], expected)
    reader.shutdown()
    sharded = build(kind, spec=mock_spec(tp_size=4), data=rows())
    assert resolve(sharded, [key(7)]) == [LookupResult.MISS]  # per-rank bytes: never shared


# -- a bare MagicMock spec, the tiering manager's scenarios (test_tiering_offloading.py) ---------


def cascaded(build: Build, kind: str) -> tuple[Any, ...]:
    """vLLM's tiering manager over its CPU primary and our tier (built from a bare ``MagicMock``
    spec, as vLLM's tests build theirs): 3 random chunks stored, cascaded down, then the primary
    reset; returns (rows, their bytes, primary, tier, manager, keys, a new request)."""
    data = rows(random=True)
    expected = data[:3].copy()
    region = MagicMock()
    region.create_kv_memoryview.return_value = data.data
    primary = CPUPrimaryTierOffloadingManager(num_chunks=ROWS, mmap_region=region)
    tier = build(kind, spec=MagicMock(), data=data)
    manager = TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier])
    chunks = [key(i) for i in range(3)]
    manager.on_new_request(CTX)
    manager.prepare_store(chunks, CTX)
    manager.complete_store(chunks, CTX)  # cascaded to our tier
    tier.drain_jobs()
    manager.on_schedule_end(END)
    manager.reset_cache()  # the primary forgets; the tier keeps them
    if hasattr(manager, "on_reset_flushed"):  # vLLM 0.33 holds promotions until then
        manager.on_reset_flushed()
    data[:] = 0
    other = ReqContext(req_id="again")
    manager.on_new_request(other)
    return data, expected, primary, tier, manager, chunks, other


def promote(manager: Any, chunks: list[Any], req: ReqContext) -> list[LookupResult]:
    """Look ``chunks`` up step after step until no promotion is pending."""
    deadline = time.monotonic() + 10
    while True:
        answers = [manager.lookup(c, req) for c in chunks]
        if not {LookupResult.HIT_PENDING, LookupResult.RETRY} & set(answers):
            return answers
        assert time.monotonic() < deadline, answers
        manager.on_schedule_end(END)
        time.sleep(0.01)


@pytest.mark.parametrize("kind", OURS)
def test_promotion_through_the_tiering_manager(build: Build, kind: str) -> None:
    data, expected, primary, _, manager, chunks, other = cascaded(build, kind)
    assert promote(manager, chunks, other) == [LookupResult.HIT] * 3
    spec = primary.prepare_load(chunks, other)
    assert np.array_equal(data[np.asarray(spec.block_ids)], expected)


@pytest.mark.parametrize("kind", OURS)
def test_a_failed_promotion_keeps_only_the_chunks_that_loaded(build: Build, kind: str) -> None:
    """test_tiering_offloading.py's test_failed_promotion_keeps_only_successful_chunks, with a
    real failure: the middle chunk is damaged on disk / deleted from the server."""
    import redis

    data, expected, primary, tier, manager, chunks, other = cascaded(build, kind)
    if kind == "disk":
        fd, offset = tier.tier._locate(tier.tier._where[chunks[1]])
        os.pwrite(fd, b"\xff" * 64, offset + 4096)
    else:
        redis.Redis.from_url(tier.options.config.valkey_url).delete(tier.tier.key_name(chunks[1]))
    promote(manager, chunks, other)
    assert [primary.lookup(c, other) for c in chunks] == [
        LookupResult.HIT,
        LookupResult.MISS,
        LookupResult.HIT,
    ]
    kept = [chunks[0], chunks[2]]
    spec = primary.prepare_load(kept, other)
    assert np.array_equal(data[np.asarray(spec.block_ids)], expected[[0, 2]])


def test_the_fingerprint_drops_the_parallel_layout_only_where_rows_are_layout_free() -> None:
    def fingerprint(**kw: Any) -> str:
        return row_fingerprint(mock_spec(**kw), ROW_BYTES, "m")

    assert fingerprint(tp_size=2, replicated_layout=True) == fingerprint(
        tp_size=4, replicated_layout=True
    )
    assert fingerprint(tp_size=2) != fingerprint(tp_size=4)
    assert fingerprint(tp_size=4) != fingerprint(tp_size=4, replicated_layout=True)
    bare = MagicMock()  # every attribute a mock: read as unknown, never serialized
    assert row_fingerprint(bare, ROW_BYTES, "m") == row_fingerprint(MagicMock(), ROW_BYTES, "m")
    assert not layout_free(bare)
    assert model_identity(bare) == "unknown@unknown|kv=unknown"
