"""Lower tiers through the engine-neutral API: write-behind, promotion, failures as misses."""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import pytest

from kvoffload import prefix_block_keys
from kvoffload.offload.lower import TierLookup
from kvoffload.store.index import READABLE, WRITING
from kvoffload.store.tiers.disk import HEAD_AREA, DiskTier
from tests.tiers_support import (
    BS,
    blocks_of,
    build,
    build_with,
    engine_kv,
    mover_of,
    run_job,
    running_server,
    tier_of,
    wait_ready,
)


def store(local, req, keys, blocks):
    job = local.offloader.schedule_store(req, keys, blocks)
    if job is not None:
        run_job(local, job)


def load_and_check(local, kv, keys, src_blocks, dst_blocks):
    """Load ``keys`` into ``dst_blocks`` and check them against the blocks they were stored from."""
    want = blocks_of(kv, src_blocks)
    run_job(local, local.offloader.schedule_load("load", keys, dst_blocks))
    got = blocks_of(kv, dst_blocks)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_disk_holds_what_the_host_evicted_and_promotes_it(tmp_path):
    kv = engine_kv(0)
    local = build(kv, host_blocks=8, disk_path=str(tmp_path))
    off = local.offloader
    keys = prefix_block_keys(np.arange(20 * BS), BS)
    for i in range(0, 20, 2):  # 20 blocks through an 8-block host
        store(local, "a", keys[i : i + 2], [i, i + 1])
        assert off.drain_tiers(10)
    assert off.lookup(keys) == 0  # the first blocks left the host long ago
    flow = off.tier_stats()["flow"]
    assert flow["written"] == 20 and flow["lost"] == 0

    found = off.lookup_tiers(keys[:3])
    assert found == TierLookup(ready=0, pending=3, probing=False)
    assert [off.index.state(k) for k in keys[:3]] == [WRITING] * 3  # pending, not readable
    assert wait_ready(local, keys[:3], 3) == 3
    load_and_check(local, kv, keys[:3], [0, 1, 2], [20, 21, 22])
    assert off.tier_stats()["flow"]["promoted"] == 3
    reads = off.tier_stats()["read_seconds"]["disk"]  # one read op per lookup that promoted
    assert reads["count"] >= 1 and reads["sum"] > 0 and sum(reads["counts"]) == reads["count"]
    local.close()


def test_lookup_tiers_without_tiers_is_lookup():
    kv = engine_kv(1)
    local = build(kv, host_blocks=4)
    keys = prefix_block_keys(np.arange(4 * BS), BS)
    store(local, "a", keys[:2], [0, 1])
    assert local.offloader.lookup_tiers(keys) == TierLookup(2, 0, False)
    assert local.offloader.tier_stats() == {} and local.mover is None
    local.close()


def test_corrupt_disk_block_becomes_a_miss_never_wrong_bytes(tmp_path):
    kv = engine_kv(2)
    local = build(kv, host_blocks=8, disk_path=str(tmp_path))
    off = local.offloader
    keys = prefix_block_keys(np.arange(12 * BS), BS)
    for i in range(0, 12, 4):
        store(local, "a", keys[i : i + 4], [i, i + 1, i + 2, i + 3])
        assert off.drain_tiers(10)
    disk = tier_of(local, "disk")
    fd, offset = disk._locate(disk._where[keys[1]])
    where = offset + HEAD_AREA + 600  # one payload byte of block 1, flipped on disk
    os.pwrite(fd, bytes([os.pread(fd, 1, where)[0] ^ 0xFF]), where)
    assert off.lookup_tiers(keys[:2]).pending == 2
    assert wait_ready(local, keys[:2], 2) == 1  # block 0 promoted, block 1 failed its checksum
    assert off.index.state(keys[1]) not in (READABLE, WRITING)
    flow = off.tier_stats()["flow"]
    assert (flow["promoted"], flow["promote_failures"]) == (1, 1)
    assert off.tier_stats()["tiers"]["disk"]["corrupt"] == 1
    load_and_check(local, kv, keys[:1], [0], [30])
    local.close()


class GatedDisk(DiskTier):
    """A real disk tier whose writes wait at a gate the test opens (then write real bytes)."""

    gate = threading.Event()

    def put(self, keys, payloads):
        assert self.gate.wait(30)
        return super().put(keys, payloads)


def test_block_being_written_down_is_never_evicted(tmp_path):
    kv = engine_kv(3)
    GatedDisk.gate.clear()
    local = build_with(kv, 4, lambda nbytes: [GatedDisk(tmp_path, "ab" * 16, nbytes, 1 << 20)])
    off = local.offloader
    gated = tier_of(local, "disk")
    keys = prefix_block_keys(np.arange(8 * BS), BS)
    try:
        store(local, "a", keys[:2], [0, 1])  # stored, now pinned: their writes wait at the gate
        assert off.lower is not None and off.lower.backlog == 2
        plan_job = off.schedule_store("b", keys[2:6], [2, 3, 4, 5])
        assert plan_job is not None and plan_job.keys == tuple(keys[2:4])  # only the free slots
        run_job(local, plan_job)
        assert off.lookup(keys[:2]) == 2  # not evicted while being written
    finally:
        GatedDisk.gate.set()
    assert off.drain_tiers(10)
    assert off.tier_stats()["flow"]["written"] == 4
    store(local, "c", keys[4:8], [4, 5, 6, 7])  # now they may go: their bytes are on disk
    assert off.lookup(keys[:2]) == 0 and gated.contains(keys[:2]) == [True, True]
    local.close()


def test_valkey_tier_probe_then_promote_then_load():
    kv = engine_kv(4)
    with running_server() as server:
        writer = build(kv, host_blocks=8, valkey_url=server.url)
        keys = prefix_block_keys(np.arange(4 * BS), BS)
        store(writer, "a", keys, [0, 1, 2, 3])
        assert writer.offloader.drain_tiers(10)
        assert writer.offloader.tier_stats()["tiers"]["valkey"]["puts"] == 4
        writer.close()

        reader = build(kv, host_blocks=8, valkey_url=server.url)  # knows nothing yet
        first = reader.offloader.lookup_tiers(keys)
        assert first == TierLookup(ready=0, pending=0, probing=True)
        assert wait_ready(reader, keys, 4) == 4
        load_and_check(reader, kv, keys, [0, 1, 2, 3], [10, 11, 12, 13])
        flow = reader.offloader.tier_stats()["flow"]
        assert flow["probes"] == 4 and flow["promoted"] == 4
        reader.close()


def test_valkey_hit_is_kept_on_local_disk(tmp_path):
    kv = engine_kv(5)
    with running_server() as server:
        writer = build(kv, host_blocks=8, valkey_url=server.url)
        keys = prefix_block_keys(np.arange(2 * BS), BS)
        store(writer, "a", keys, [0, 1])
        assert writer.offloader.drain_tiers(10)
        writer.close()
        reader = build(kv, host_blocks=8, disk_path=str(tmp_path), valkey_url=server.url)
        assert wait_ready(reader, keys, 2) == 2
        assert reader.offloader.drain_tiers(10)
        assert tier_of(reader, "disk").contains(keys) == [True, True]
        reader.close()


def test_valkey_down_never_raises_and_misses(tmp_path):
    kv = engine_kv(6)
    with running_server() as server:
        local = build(kv, host_blocks=4, valkey_url=server.url, valkey_timeout_s=0.3)
        off = local.offloader
        keys = prefix_block_keys(np.arange(8 * BS), BS)
        server.kill()
        for i in range(0, 8, 2):
            store(local, "a", keys[i : i + 2], [i, i + 1])
            assert off.lookup_tiers(keys).pending == 0
            assert off.drain_tiers(10)  # the writes fail at once: nothing waits on the server
        assert off.lookup_tiers(keys) == TierLookup(0, 0, False)  # evicted from host: misses
        assert off.lookup(keys[4:]) == 4  # the host tier is unaffected
        stats = off.tier_stats()
        assert stats["flow"]["written"] == 0 and stats["flow"]["write_failures"] == 8
        local.close()


class StuckProbe(DiskTier):
    """A tier whose presence is unknown and whose probe blocks until the test releases it."""

    name = "stuck"
    release = threading.Event()

    def contains(self, keys):
        return [None] * len(keys)

    def probe(self, keys):
        assert self.release.wait(30)
        return [False] * len(keys)


def test_lookup_never_waits_for_a_tier(tmp_path):
    kv = engine_kv(7)
    StuckProbe.release.clear()
    local = build_with(kv, 8, lambda nbytes: [StuckProbe(tmp_path, "cd" * 16, nbytes, 1 << 20)])
    keys = prefix_block_keys(np.arange(4 * BS), BS)
    try:
        found = local.offloader.lookup_tiers(keys)  # returns while the probe is stuck
        assert found == TierLookup(0, 0, True)
        assert local.offloader.lookup_tiers(keys) == TierLookup(0, 0, True)  # asked only once
        assert mover_of(local).in_flight == 1
    finally:
        StuckProbe.release.set()
    assert mover_of(local).wait_idle(10)
    local.offloader.poll_tiers()
    assert local.offloader.tier_stats()["flow"]["probes"] == 4
    local.close()


def test_config_requires_model_id_with_tiers(tmp_path):
    from kvoffload import OffloadConfig

    with pytest.raises(ValueError, match="expected model_id"):
        OffloadConfig(disk_path=str(tmp_path))
    with pytest.raises(ValueError, match="valkey_url like redis://"):
        OffloadConfig(valkey_url="localhost:6379", model_id="m")
    with pytest.raises(ValueError, match="disk_capacity_bytes to be a positive int"):
        OffloadConfig(disk_path=str(tmp_path), model_id="m", disk_capacity_bytes=0)


class BrokenWrites(DiskTier):
    """A real disk tier whose writes raise (a tier bug): the mover must turn each into a miss."""

    def put(self, keys, payloads):
        raise RuntimeError("broken tier")


def test_tier_errors_are_misses_and_their_log_is_rate_limited(tmp_path, caplog):
    kv = engine_kv(8)
    local = build_with(kv, 8, lambda nbytes: [BrokenWrites(tmp_path, "ef" * 16, nbytes, 1 << 20)])
    off, mover = local.offloader, mover_of(local)
    keys = prefix_block_keys(np.arange(8 * BS), BS)
    with caplog.at_level(logging.ERROR, logger="kvoffload.offload.tiers"):
        for i in range(8):  # 8 write ops, each raising on a mover thread
            store(local, "a", keys[i : i + 1], [i])
            assert off.drain_tiers(10)
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and errors[0].exc_info is not None  # the first, with traceback
        assert "broken tier" in errors[0].getMessage()
        mover._failures.every_s = 0.0  # the next interval: one line with the count, no traceback
        store(local, "b", [prefix_block_keys(np.arange(BS), BS, salt=b"x")[0]], [0])
        assert off.drain_tiers(10)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and not errors[1].exc_info
    assert "(7 more like it not logged)" in errors[1].getMessage()
    assert off.tier_stats()["flow"]["write_failures"] == 9 and off.index.num_readable == 8
    local.close()
