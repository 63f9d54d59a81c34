"""The rule that a lower-tier hit is loaded only when expected to beat recomputing it."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload import prefix_block_keys
from kvoffload.offload.load_rule import LoadRule
from kvoffload.offload.lower import SAMPLE_BLOCKS, TierLookup
from kvoffload.store.index import FREE, READABLE
from tests.tiers_support import BS, blocks_of, build, engine_kv, mover_of, run_job, wait_ready

MiB = 1 << 20


def test_rule_weighs_load_against_recompute():
    rule = LoadRule(2 * MiB, block_tokens=16)
    assert rule.worth({"valkey": 8}) is None  # no figures: load, and measure
    rule.read("valkey", 8, 8 * 2 * MiB / 1e9)  # 1 GB/s
    assert rule.worth({"valkey": 8}) is None  # no prefill rate yet
    rule.prefill(16_000, 1.0)  # 16k tokens/s: 8 blocks recompute in 8 ms, load in 16.8 ms
    assert rule.recompute_seconds(8) == pytest.approx(8e-3)
    assert rule.load_seconds({"valkey": 8}) == pytest.approx(8 * 2 * MiB / 1e9)
    assert rule.worth({"valkey": 8}) is False
    rule.prefill(1_000, 1.0)  # a slower engine: EWMA 0.7 * 16k + 0.3 * 1k = 11.5k tokens/s
    assert rule.prefill_tokens_per_s == pytest.approx(11_500)
    rule.read("disk", 8, 8 * 2 * MiB / 40e9)  # 40 GB/s: 0.42 ms against 11 ms
    assert rule.worth({"disk": 8}) is True
    assert rule.worth({"disk": 4, "valkey": 4}) is True  # 8.8 ms against 11.1 ms
    assert rule.worth({"disk": 1, "unmeasured": 1}) is None
    assert set(rule.snapshot()) == {"prefill_tokens_per_s", "valkey_read_MBps", "disk_read_MBps"}


def test_rule_refuses_bad_arguments():
    with pytest.raises(ValueError, match="expected block_bytes > 0 and prefill_tokens_per_s >= 0"):
        LoadRule(0, 16)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        build(engine_kv(0), host_blocks=4, prefill_tokens_per_s=-1.0)


def _spilled(tmp_path, seed, **options):
    """20 blocks stored through an 8-block host onto disk: the first 8 are on disk only."""
    kv = engine_kv(seed)
    local = build(kv, host_blocks=8, disk_path=str(tmp_path), **options)
    keys = prefix_block_keys(np.arange(20 * BS), BS)
    for i in range(0, 20, 2):
        job = local.offloader.schedule_store("a", keys[i : i + 2], [i, i + 1])
        assert job is not None
        run_job(local, job)
        assert local.offloader.drain_tiers(10)
    assert local.offloader.lookup(keys) == 0
    return kv, local, keys


def _load_equal(local, kv, keys, src, dst):
    run_job(local, local.offloader.schedule_load("load", keys, dst))
    want, got = blocks_of(kv, src), blocks_of(kv, dst)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_slower_tier_is_declined_and_the_blocks_still_come_up(tmp_path):
    kv, local, keys = _spilled(tmp_path, 3)
    off = local.offloader
    assert wait_ready(local, keys[:2], 2) == 2  # no figures yet: taken, and the disk measured
    flow = off.tier_stats()["flow"]
    assert flow["loads_unmeasured"] == 2 and flow["loads_taken"] == 0
    assert off.tier_stats()["rule"]["disk_read_MBps"] > 0
    off.report_prefill(10**15, 1.0)  # an engine no tier can beat
    found = off.lookup_tiers(keys[:6])
    assert found == TierLookup(ready=2, pending=0, probing=False)  # the request recomputes 2..5
    assert off.tier_stats()["flow"]["loads_declined"] == 4
    assert off.lookup_tiers(keys[:6]).pending == 0  # still not reported while they come up
    assert mover_of(local).wait_idle(20)
    off.poll_tiers()
    assert [off.index.state(k) for k in keys[2:6]] == [READABLE] * 4  # up for later requests
    _load_equal(local, kv, keys[:6], [0, 1, 2, 3, 4, 5], [20, 21, 22, 23, 24, 25])
    local.close()


def test_a_faster_tier_is_taken(tmp_path):
    kv, local, keys = _spilled(tmp_path, 4, prefill_tokens_per_s=1.0)  # 1 token/s: loads win
    off = local.offloader
    assert wait_ready(local, keys[:2], 2) == 2
    found = off.lookup_tiers(keys[:6])
    assert found.ready == 2 and found.pending == 4
    assert wait_ready(local, keys[:6], 6) == 6
    flow = off.tier_stats()["flow"]
    assert flow["loads_taken"] == 4 and flow["loads_declined"] == 0
    _load_equal(local, kv, keys[:6], [0, 1, 2, 3, 4, 5], [20, 21, 22, 23, 24, 25])
    local.close()


def test_of_a_declined_load_only_a_sample_comes_up(tmp_path):
    kv = engine_kv(5, 160)
    local = build(kv, host_blocks=80, disk_path=str(tmp_path))
    off = local.offloader
    keys = prefix_block_keys(np.arange(150 * BS), BS)
    for i in range(0, 150, 10):
        run_job(local, off.schedule_store("a", keys[i : i + 10], list(range(i, i + 10))))
        assert off.drain_tiers(10)
    assert off.lookup(keys) == 0
    assert wait_ready(local, keys[:2], 2) == 2  # measures the disk
    off.report_prefill(10**15, 1.0)
    assert off.lookup_tiers(keys[:42]) == TierLookup(ready=2, pending=0, probing=False)
    assert off.tier_stats()["flow"]["loads_declined"] == 40
    assert mover_of(local).wait_idle(20)
    off.poll_tiers()
    states = [off.index.state(k) for k in keys[2:42]]
    assert states == [READABLE] * SAMPLE_BLOCKS + [FREE] * (40 - SAMPLE_BLOCKS)
    n = 2 + SAMPLE_BLOCKS
    _load_equal(local, kv, keys[:n], list(range(n)), list(range(120, 120 + n)))
    local.close()
