"""The rule that a lower-tier hit is loaded only when expected to beat recomputing it."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest

from kvoffload import prefix_block_keys
from kvoffload.offload.load_rule import LoadRule
from kvoffload.offload.lower import REMEASURE_MAX_S, REMEASURE_S, SAMPLE_BLOCKS, TierLookup
from kvoffload.store.index import FREE, READABLE
from kvoffload.store.tiers.base import Tier
from tests.tiers_support import (
    BS,
    NUM_BLOCKS,
    blocks_of,
    build,
    build_with,
    engine_kv,
    mover_of,
    run_job,
    wait_ready,
)

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
    assert rule.too_slow("valkey") and not rule.too_slow("unmeasured")
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


def test_report_prefill_refuses_bad_figures_and_a_closed_offloader(tmp_path):
    """Bad figures are refused with what was expected and leave the rule's rate as it was; a
    closed Offloader refuses the call as its other calls do."""
    local = build(engine_kv(0), host_blocks=4, disk_path=str(tmp_path))
    off = local.offloader
    off.report_prefill(1000, 0.5)
    rate = off.tier_stats()["rule"]["prefill_tokens_per_s"]
    bad = [("x", 1.0), (True, 1.0), (-1, 1.0), (10, float("nan")), (10, float("inf")), (10, -1.0)]
    for tokens, seconds in bad:
        with pytest.raises(ValueError, match="report_prefill: expected"):
            off.report_prefill(tokens, seconds)  # type: ignore[arg-type]
    assert off.tier_stats()["rule"]["prefill_tokens_per_s"] == rate
    local.close()
    with pytest.raises(ValueError, match="report_prefill: expected an open Offloader"):
        off.report_prefill(1000, 0.5)


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


def test_a_slower_tier_is_declined_without_a_lookup_then_remeasured(tmp_path):
    kv, local, keys = _spilled(tmp_path, 3)
    off = local.offloader
    clock = _Clock(off)
    assert wait_ready(local, keys[:2], 2) == 2  # no figures yet: taken, and the disk measured
    flow = off.tier_stats()["flow"]
    assert flow["loads_unmeasured"] == 2 and flow["loads_taken"] == 0
    assert off.tier_stats()["rule"]["disk_read_MBps"] > 0
    off.report_prefill(10**15, 1.0)  # an engine no tier can beat
    found = off.lookup_tiers(keys[:6])
    assert found == TierLookup(ready=2, pending=0, probing=False)  # the request recomputes 2..5
    assert off.tier_stats()["flow"]["declined_without_lookup"] == 4
    assert mover_of(local).in_flight == 0  # nothing asked of the disk
    clock.now += REMEASURE_S  # its re-measurement is due: a sample probed and read up
    assert off.lookup_tiers(keys[:6]).pending == 0  # still not reported while they come up
    for _ in range(2):  # the probe, then the reads
        assert mover_of(local).wait_idle(20)
        off.poll_tiers()
    assert [off.index.state(k) for k in keys[2:6]] == [READABLE] * 4  # up for later requests
    assert off.tier_stats()["flow"]["remeasured"] == 4
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
    assert flow["loads_taken"] == 4 and flow["declined_without_lookup"] == 0
    _load_equal(local, kv, keys[:6], [0, 1, 2, 3, 4, 5], [20, 21, 22, 23, 24, 25])
    local.close()


def test_a_remeasurement_reads_up_only_a_sample(tmp_path):
    kv = engine_kv(5, 160)
    local = build(kv, host_blocks=80, disk_path=str(tmp_path))
    off = local.offloader
    clock = _Clock(off)
    keys = prefix_block_keys(np.arange(150 * BS), BS)
    for i in range(0, 150, 10):
        run_job(local, off.schedule_store("a", keys[i : i + 10], list(range(i, i + 10))))
        assert off.drain_tiers(10)
    assert off.lookup(keys) == 0
    assert wait_ready(local, keys[:2], 2) == 2  # measures the disk
    off.report_prefill(10**15, 1.0)
    assert off.lookup_tiers(keys[:42]) == TierLookup(ready=2, pending=0, probing=False)
    assert off.tier_stats()["flow"]["declined_without_lookup"] == 40
    clock.now += REMEASURE_S
    assert off.lookup_tiers(keys[:42]) == TierLookup(ready=2, pending=0, probing=False)
    for _ in range(2):
        assert mover_of(local).wait_idle(20)
        off.poll_tiers()
    states = [off.index.state(k) for k in keys[2:42]]
    assert states == [READABLE] * SAMPLE_BLOCKS + [FREE] * (40 - SAMPLE_BLOCKS)
    n = 2 + SAMPLE_BLOCKS
    _load_equal(local, kv, keys[:n], list(range(n)), list(range(120, 120 + n)))
    local.close()


class _Clock:
    """The lower tiers' clock, moved by hand."""

    def __init__(self, off) -> None:
        self.now = 1000.0
        off.lower.clock = lambda: self.now


class CountingTier(Tier):
    """A remote tier in memory, as Valkey looks to the scheduler: real bytes, presence unknown
    (None) until a probe, a read or a write tells, and every call counted."""

    name = "remote"

    def __init__(self, block_bytes: int) -> None:
        super().__init__("ab" * 16, block_bytes)
        self.blocks: dict[bytes, bytes] = {}
        self.known: set[bytes] = set()
        self.calls: Counter[str] = Counter()
        self.written: list[bytes] = []
        self.lock = threading.Lock()

    def put(self, keys, payloads):
        self._check_sizes(keys, payloads)
        with self.lock:
            self.calls["put"] += 1
            for key, payload in zip(keys, payloads, strict=True):
                self.blocks[key] = bytes(payload)
                self.known.add(key)
                self.written.append(key)
        return [True] * len(keys)

    def get(self, keys, outs):
        self._check_sizes(keys, outs)
        with self.lock:
            self.calls["get"] += 1
            found = [self.blocks.get(key) for key in keys]
        for out, data in zip(outs, found, strict=True):
            if data is not None:
                out[:] = data
        return [data is not None for data in found]

    def contains(self, keys):
        with self.lock:
            self.calls["contains"] += 1
            return [True if key in self.known else None for key in keys]

    def probe(self, keys):
        with self.lock:
            self.calls["probe"] += 1
            held = [key in self.blocks for key in keys]
            self.known.update(k for k, h in zip(keys, held, strict=True) if h)
            return held

    def discard(self, keys):
        with self.lock:
            for key in keys:
                self.blocks.pop(key, None)
                self.known.discard(key)

    def forget(self) -> None:
        """As a new process's client: it knows nothing until it asks."""
        with self.lock:
            self.known.clear()
            self.calls.clear()


def _remote(host_blocks: int, num_blocks: int = NUM_BLOCKS):
    kv = engine_kv(7, num_blocks)
    tiers: list[CountingTier] = []

    def make(block_bytes: int) -> list[CountingTier]:
        tiers.append(CountingTier(block_bytes))
        return tiers

    local = build_with(kv, host_blocks, make)
    return kv, local, tiers[0]


def _spill(local, keys, n: int) -> None:
    """Store ``keys[:n]`` from engine blocks 0..n-1, two at a time, each written down."""
    off = local.offloader
    for i in range(0, n, 2):
        run_job(local, off.schedule_store("a", keys[i : i + 2], [i, i + 1]))
        assert off.drain_tiers(10)


def test_a_declined_tier_is_never_touched_and_recomputed_blocks_are_not_written_twice():
    _, local, tier = _remote(host_blocks=8)
    off = local.offloader
    keys = prefix_block_keys(np.arange(24 * BS), BS)
    _spill(local, keys, 20)
    assert off.lookup(keys) == 0 and len(tier.blocks) == 20
    off.lower.rule.read("remote", 1, 1.0)  # measured: one 8 KiB block a second
    off.report_prefill(16_000, 1.0)  # a block recomputes in 1 ms
    tier.forget()
    clock = _Clock(off)
    for _ in range(50):
        assert off.lookup_tiers(keys[:20]) == TierLookup(ready=0, pending=0, probing=False)
        clock.now += REMEASURE_S / 100
    assert tier.calls == Counter()  # no contains, no probe, no read, on any thread
    assert mover_of(local).in_flight == 0
    # each lookup walks at most half the host's 8 slots past its host prefix: 4 keys declined
    assert off.tier_stats()["flow"]["declined_without_lookup"] == 50 * 4
    # The request recomputes 0..3 (the engine's blocks 0..3 hold their KV) and stores them with
    # 20..23, which are new: the remote tier is asked first and gets only the new blocks.
    written = len(tier.written)
    ids = [0, 1, 2, 3, 20, 21, 22, 23]
    run_job(local, off.schedule_store("b", keys[:4] + keys[20:24], ids))
    assert off.drain_tiers(10)
    assert tier.written[written:] == keys[20:24]
    # a probe per write op (of 4 blocks: the backlog is half the host's 8 slots), a put only for
    # the op of new blocks, no read
    assert tier.calls == Counter(contains=8, probe=2, put=1)
    local.close()


def test_remeasurements_are_paced_and_a_faster_tier_is_taken_again():
    kv, local, tier = _remote(host_blocks=40, num_blocks=64)
    off = local.offloader
    keys = prefix_block_keys(np.arange(60 * BS), BS)
    _spill(local, keys, 60)  # 0..19 on the remote tier only, 20..59 on host too
    assert off.lookup(keys) == 0
    off.lower.rule.read("remote", 1, 1.0)
    off.report_prefill(16_000, 1.0)
    clock = _Clock(off)
    start = clock.now
    unknown = prefix_block_keys(np.arange(10**5, 10**5 + 20 * BS), BS)  # held nowhere
    probes_at = []
    for tenth in range(0, 3200):  # 320 s in tenths
        clock.now = start + tenth / 10
        probes = tier.calls["probe"]
        assert off.lookup_tiers(unknown).hit == 0
        assert mover_of(local).wait_idle(20)
        off.poll_tiers()
        if tier.calls["probe"] > probes:
            probes_at.append(tenth / 10)
    # first REMEASURE_S after it was found slow, then every 10, 20, 40, 80, 80 s
    assert REMEASURE_S == 5.0 and REMEASURE_MAX_S == 80.0
    assert probes_at == [5.0, 15.0, 35.0, 75.0, 155.0, 235.0, 315.0]
    assert tier.calls["get"] == 0  # the probes found nothing to read
    # The tier got fast: the next re-measurement reads up what it found (at memory speed, which
    # raises its rate), and from then on lookups ask it and load from it.
    clock.now += REMEASURE_MAX_S
    assert off.lookup_tiers(keys[:20]).hit == 0
    for _ in range(2):  # the probe, then the reads
        assert mover_of(local).wait_idle(20)
        off.poll_tiers()
    assert tier.calls["get"] >= 1 and off.tier_stats()["flow"]["remeasured"] == 20
    assert not off.lower.rule.too_slow("remote")
    assert wait_ready(local, keys[:40], 40) == 40
    assert off.tier_stats()["flow"]["loads_taken"] > 0
    _load_equal(local, kv, keys[:8], list(range(8)), list(range(40, 48)))
    local.close()


def test_the_decision_is_exported_as_a_metric():
    pytest.importorskip("prometheus_client")
    from kvoffload.metrics import OffloadCollector

    _, local, _tier = _remote(host_blocks=8)
    off = local.offloader
    keys = prefix_block_keys(np.arange(10 * BS), BS)
    _spill(local, keys, 10)
    off.lower.rule.read("remote", 1, 1.0)
    off.report_prefill(16_000, 1.0)
    assert off.lookup_tiers(keys).ready == 0
    flow = {}
    for family in OffloadCollector(off).collect():
        if family.name.endswith("tier_flow"):
            flow = {s.labels["counter"]: s.value for s in family.samples}
    # keys 0..3, the half of the 8-block host's slots a lookup looks at: the walk stops at key 0,
    # and the request recomputes from there (2 and 3 on host included)
    assert flow["declined_without_lookup"] == 4
    assert flow["remeasured"] == 0 and "loads_declined" not in flow
    local.close()


class _CountingStates:
    """``BlockIndex.state`` with every key it is asked about recorded."""

    def __init__(self, index) -> None:
        self.asked: list[bytes] = []
        self._state = index.state
        index.state = self

    def __call__(self, key):
        self.asked.append(key)
        return self._state(key)


def test_a_declined_lookup_reads_no_host_state_past_where_it_stops():
    """The only tier that could continue the walk is declined: the keys after the first miss are
    counted, not walked, whatever their number; when a re-measurement is due its sample still
    holds only keys absent from host."""
    kv, local, tier = _remote(host_blocks=64, num_blocks=64)
    off = local.offloader
    keys = prefix_block_keys(np.arange(40 * BS), BS)
    _spill(local, keys, 40)  # 0..39 on the remote tier and on host
    off.index.remove(keys[:2] + keys[4:40])  # on host: 2 and 3 only
    off.lower.rule.read("remote", 1, 1.0)
    off.report_prefill(16_000, 1.0)
    tier.forget()
    clock = _Clock(off)
    states = _CountingStates(off.index)
    assert off.lookup_tiers(keys) == TierLookup(ready=0, pending=0, probing=False)
    assert states.asked == [keys[0]]  # the first key, found on no tier asked; nothing after it
    assert off.tier_stats()["flow"]["declined_without_lookup"] == 32  # half the 64 host slots
    assert tier.calls == Counter()
    clock.now += REMEASURE_S  # due: a sample of the keys absent from host, probed and read up
    assert off.lookup_tiers(keys).hit == 0
    for _ in range(2):  # the probe, then the reads
        assert mover_of(local).wait_idle(20)
        off.poll_tiers()
    # the 32 keys looked at, less 2 and 3 (on host: not asked about)
    sample = [keys[0], keys[1], *keys[4:32]]
    assert len(sample) < SAMPLE_BLOCKS and off.tier_stats()["flow"]["remeasured"] == len(sample)
    assert [off.index.state(k) for k in sample] == [READABLE] * len(sample)
    assert [off.index.state(k) for k in keys[32:40]] == [FREE] * 8
    _load_equal(local, kv, keys[:8], list(range(8)), list(range(40, 48)))
    local.close()
