"""Issue 19 items 1-3 on our tiers: KV events for what each tier stores and drops, ``touch``, and
a bad ``disk_path`` refused at engine start under both specs.

Events are checked at three levels: the tier's ``OffloadingEvent`` list, vLLM's own
translation of them into ``BlockStored`` / ``BlockRemoved`` inside a real scheduler (``EngineSim``
with KV events on), and against what the tier holds afterwards (``contains``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
if not os.environ.get("CI"):  # under CI a missing Valkey client is a failure, not a skip
    pytest.importorskip("redis")

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.kv_offload.base import Medium, OffloadingEvent, OffloadKey

from kvoffload.integrations.vllm.tier_events import Residency
from kvoffload.store.tiers.disk import record_bytes_for
from tests.vllm.test_tiers import (
    OURS_SPEC,
    SPECS,
    lower_tier,
    make_sim,
    prompt,
    settle,
    tier_config,
)
from tests.vllm.tier_support import ROW_BYTES, Build, drain, key, make_job, mock_spec, store


def events_of(tier: Any) -> tuple[list[OffloadKey], list[OffloadKey]]:
    """(stored, removed) keys of the tier's events since the last call."""
    stored: list[OffloadKey] = []
    removed: list[OffloadKey] = []
    for event in tier.take_events():
        (removed if event.removed else stored).extend(event.keys)
    return stored, removed


def small_disk(build: Build, records: int, **entry: Any) -> Any:
    spec = mock_spec(events=True)
    capacity = records * record_bytes_for(ROW_BYTES)
    return build("disk", spec=spec, enable_kv_events=True, disk_capacity_bytes=capacity, **entry)


# -- what the disk tier drops --------------------------------------------------------------------


def test_disk_evictions_are_announced_removed(build: Build) -> None:
    tier = small_disk(build, records=3)
    keys = [key(i) for i in range(5)]
    for i, k in enumerate(keys):  # one job each: the oldest goes first once 3 are held
        store(tier, [k], [i], job=i)
    stored, removed = events_of(tier)
    assert stored == keys
    assert removed == keys[:2]
    assert tier.tier.contains(keys) == [False, False, True, True, True]
    assert events_of(tier) == ([], [])  # each announced once


def test_touch_keeps_a_chunk_on_disk(build: Build) -> None:
    tier = small_disk(build, records=3)
    for i in range(3):
        store(tier, [key(i)], [i], job=i)
    tier.touch([key(0)], None)  # key 0 becomes the most recently used
    store(tier, [key(3)], [3], job=3)
    assert tier.tier.contains([key(i) for i in range(4)]) == [True, False, True, True]
    assert events_of(tier)[1] == [key(1)]


def test_untouched_the_oldest_chunk_goes(build: Build) -> None:
    """The control for the test above: the same sequence without the touch."""
    tier = small_disk(build, records=3)
    for i in range(4):
        store(tier, [key(i)], [i], job=i)
    assert tier.tier.contains([key(i) for i in range(4)]) == [False, True, True, True]


def test_chunks_found_on_disk_after_a_restart_are_announced_when_met(build: Build) -> None:
    capacity = 4 * record_bytes_for(ROW_BYTES)
    first = build("disk", spec=mock_spec(events=True), disk_capacity_bytes=capacity)  # no events
    store(first, [key(1)], [0])
    first.shutdown()  # the directory is one process's at a time
    tier = small_disk(build, records=4)
    assert events_of(tier) == ([], [])  # found by the restart scan: not announced yet
    store(tier, [key(1), key(2)], [0, 1])  # key 1 is already held: not written again
    assert events_of(tier) == ([key(1), key(2)], [])
    assert tier.tier.stats.puts == 1


def test_a_partly_failed_store_announces_what_was_written(build: Build) -> None:
    """vLLM's fs tier announces nothing for a job with a failed block; ours announce each chunk
    that was written (it is held and readable): a difference on purpose."""
    tier = small_disk(build, records=4)
    disk = tier.tier
    put = disk.put

    def second_fails(keys: Any, payloads: Any) -> list[bool]:
        ok = put(keys[:1], payloads[:1])  # really written
        return [*ok, *([False] * (len(keys) - 1))]

    disk.put = second_fails
    tier.submit_store(make_job(1, [key(1), key(2)], [0, 1]))
    (result,) = drain(tier)
    assert not result.success
    assert events_of(tier) == ([key(1)], [])
    assert disk.contains([key(1), key(2)]) == [True, False]


def test_a_corrupt_disk_value_is_announced_removed(build: Build) -> None:
    tier = small_disk(build, records=4)
    store(tier, [key(1), key(2)], [0, 1])
    events_of(tier)
    disk = tier.tier
    fd, offset = disk._locate(disk._where[key(2)])
    os.pwrite(fd, b"\xff" * 64, offset + 4096)  # inside the payload
    tier.submit_load(make_job(2, [key(1), key(2)], [4, 5], promotion=True))
    (result,) = drain(tier)
    assert tuple(result.successful_keys) == (key(1),)
    assert events_of(tier) == ([], [key(2)])


# -- what the Valkey tier learns -----------------------------------------------------------------


def test_a_valkey_value_found_gone_is_announced_removed(build: Build) -> None:
    import redis

    spec = mock_spec(events=True)
    tier = build("valkey", spec=spec, enable_kv_events=True)
    store(tier, [key(1), key(2)], [0, 1])
    assert events_of(tier) == ([key(1), key(2)], [])
    redis.Redis.from_url(tier.options.config.valkey_url).delete(tier.tier.key_name(key(2)))
    tier.tier._known.clear()  # as after KNOWN_PRESENT_S: the server is asked again
    tier.submit_load(make_job(2, [key(1), key(2)], [4, 5], promotion=True))
    drain(tier)
    assert events_of(tier) == ([], [key(2)])


def test_another_instances_value_is_announced_when_this_one_reads_it(build: Build) -> None:
    spec = mock_spec(events=True)
    writer = build("valkey", spec=spec)  # no events: another engine
    store(writer, [key(5)], [0])
    reader = build("valkey", spec=spec, enable_kv_events=True)
    assert events_of(reader) == ([], [])  # it cannot know what others wrote
    reader.submit_load(make_job(1, [key(5)], [3], promotion=True))
    assert [r.success for r in drain(reader)] == [True]
    assert events_of(reader) == ([key(5)], [])


def test_touch_resets_the_valkey_servers_lru_clock(build: Build) -> None:
    """The server orders ``allkeys-lru`` eviction by each value's idle time (whole seconds)."""
    import redis

    tier = build("valkey")
    store(tier, [key(1), key(2)], [0, 1])
    client = redis.Redis.from_url(tier.options.config.valkey_url)
    time.sleep(2.1)
    tier.touch([key(1)], None)
    tier.drain_jobs()
    idle = [client.object("idletime", tier.tier.key_name(key(i))) for i in (1, 2)]
    assert idle[0] == 0 and idle[1] >= 2


def test_keys_not_seen_for_the_ttl_are_announced_removed() -> None:
    residency = Residency(Medium.STORAGE, None, "KVOffloadValkeyTier", expire_s=0.05)
    residency.stored([key(1), key(2)])
    residency.take()
    time.sleep(0.03)
    residency.seen([key(2)])  # read again: its TTL was refreshed
    time.sleep(0.03)
    (event,) = residency.take()
    assert event.removed and event.keys == [key(1)]


def test_past_max_keys_the_oldest_is_announced_removed() -> None:
    residency = Residency(Medium.STORAGE, None, "t", max_keys=2)
    residency.stored([key(1), key(2), key(3)])
    events = residency.take()
    assert [(e.removed, e.keys) for e in events] == [
        (False, [key(1), key(2), key(3)]),
        (True, [key(1)]),
    ]


def test_events_are_vllms_event_type() -> None:
    residency = Residency(Medium.STORAGE, None, "t")
    residency.stored([key(1)])
    (event,) = residency.take()
    assert isinstance(event, OffloadingEvent)


# -- through vLLM's scheduler: its BlockStored / BlockRemoved ------------------------------------


@SPECS
def test_vllm_publishes_our_tiers_blocks(tmp_path: Path, spec: Any) -> None:
    entry = {"disk_path": str(tmp_path / "disk")}
    if spec != OURS_SPEC:
        entry["enable_kv_events"] = True  # type: ignore[assignment]
    sim = make_sim(tmp_path, spec, tier_config(spec, "KVOffloadDiskTier", **entry), kv_events=True)
    published: list[Any] = []
    sim.scheduler.kv_event_publisher.publish = lambda batch: published.extend(batch.events)
    sim.add(prompt(100))
    sim.run()
    settle(sim)
    for _ in range(3):  # events are taken once per step
        sim.step()
    tier = lower_tier(sim)
    on_disk = [e for e in published if getattr(e, "medium", None) == "STORAGE"]
    assert on_disk and all(isinstance(e, BlockStored) for e in on_disk)
    assert {e.ownership for e in on_disk} == {"KVOffloadDiskTier"}
    hashes = [h for e in on_disk for h in e.block_hashes]
    assert len(hashes) == len(set(hashes)) == tier.tier.num_blocks == 5  # type: ignore[attr-defined]
    assert not [e for e in published if isinstance(e, BlockRemoved) and e.medium == "STORAGE"]


# -- a bad disk_path stops the engine ------------------------------------------------------------


def unwritable(tmp_path: Path) -> str:
    if os.geteuid() != 0:
        path = tmp_path / "ro"
        path.mkdir(mode=0o555)
        return str(path)
    return "/sys"  # root may write anywhere its mode bits forbid; not into sysfs


@SPECS
@pytest.mark.parametrize(
    ("where", "reason"),
    [
        ("under_a_file", "disk_path.*cannot create it"),
        ("a_file", "disk_path.*not a directory"),
        ("unwritable", "disk_path.*not writable"),
    ],
)
def test_a_bad_disk_path_stops_the_engine(
    tmp_path: Path, spec: Any, where: str, reason: str
) -> None:
    (tmp_path / "file").write_bytes(b"x")
    path = {
        "under_a_file": str(tmp_path / "file" / "kv"),
        "a_file": str(tmp_path / "file"),
        "unwritable": unwritable(tmp_path),
    }[where]
    with pytest.raises(ValueError, match=reason):
        make_sim(tmp_path, spec, tier_config(spec, "KVOffloadDiskTier", disk_path=path))
