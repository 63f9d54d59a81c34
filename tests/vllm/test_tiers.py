"""Contract tests: our disk and Valkey tiers under vLLM's real scheduler and tiering manager.

Both specs: vLLM's ``TieringOffloadingSpec`` (its CPU primary tier and shared region, our tiers as
``secondary_tiers`` entries; ``cpu_tiering.py`` replaces only its CUDA-only copy worker) and our
``KVOffloadSpec`` (flat ``disk_path``/``valkey_url`` keys). Real files, a real ``redis-server``,
and every load checked byte for byte by ``EngineSim`` against what the fake model wrote.

The pattern of most tests: a prefix is stored (host, then cascaded down), pushed out of the
8-chunk host tier by two other prefixes, and asked for again: its chunks come back up from the
lower tier (the lookup answers pending first, then hit), load, and match.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
if not os.environ.get("CI"):  # under CI a missing Valkey client is a failure, not a skip
    pytest.importorskip("redis")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import LookupResult, make_offload_key

from kvoffload.integrations.vllm.secondary import (
    KVOffloadDiskTier,
    KVOffloadValkeyTier,
    _KVOffloadTier,
)
from kvoffload.store.tiers.disk import HEAD_AREA
from kvoffload.store.tiers.local_server import LocalServer
from tests.tiers_support import running_server
from tests.vllm.faults import FaultPlan
from tests.vllm.harness import BLOCK, NUM_LAYERS, PAGE_BYTES, EngineSim

CHUNK_BYTES = NUM_LAYERS * PAGE_BYTES
MODULE = "kvoffload.integrations.vllm"
VLLM_SPEC = ("CPUTieringSpec", "tests.vllm.cpu_tiering")
OURS_SPEC = ("KVOffloadSpec", MODULE)
SPECS = pytest.mark.parametrize("spec", [VLLM_SPEC, OURS_SPEC], ids=["vllm_spec", "our_spec"])


def prompt(start: int, blocks: int = 5) -> list[int]:
    return list(range(start, start + blocks * BLOCK + 3))


def tier_config(spec: tuple[str, str], kind: str, **options: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` for one of our tiers under ``spec``, host = 8 chunks."""
    extra: dict[str, Any] = {"cpu_bytes_to_use": 8 * CHUNK_BYTES}
    if spec == OURS_SPEC:
        return {**extra, **options}
    entry = {"type": kind, "module_path": MODULE, **options}
    return {**extra, "secondary_tiers": [entry]}


def make_sim(tmp_path: Path, spec: tuple[str, str], extra: dict[str, Any], **kw: Any) -> EngineSim:
    connector: dict[str, Any] = {"connector": "KVOffloadConnector", "connector_module": MODULE}
    return EngineSim(
        tmp_path, extra_config=extra, spec=spec, **(connector if spec == OURS_SPEC else {}), **kw
    )


def lower_tier(sim: EngineSim) -> _KVOffloadTier:
    (tier,) = sim.scheduler_connector.scheduler.manager.secondary_tiers  # type: ignore[attr-defined]
    assert isinstance(tier, _KVOffloadTier)
    return tier


class Lookups:
    """Records what the tiering manager answered for each key (vLLM calls it per chunk)."""

    def __init__(self, sim: EngineSim) -> None:
        self.seen: dict[bytes, list[LookupResult]] = {}
        manager = sim.scheduler_connector.scheduler.manager
        real = manager.lookup

        def lookup(key: Any, req_context: Any, **kw: Any) -> LookupResult:
            result: LookupResult = real(key, req_context, **kw)
            self.seen.setdefault(bytes(key), []).append(result)
            return result

        manager.lookup = lookup  # type: ignore[method-assign]

    def of(self, sim: EngineSim, req_id: str) -> list[LookupResult]:
        first = sim.block_hashes[req_id][0]
        return self.seen.get(bytes(make_offload_key(first, 0)), [])


def settle(sim: EngineSim, timeout: float = 20.0) -> None:
    """Step until the lower tiers have written everything they were given."""
    deadline = time.monotonic() + timeout
    manager = sim.scheduler_connector.scheduler.manager
    while any(t.has_pending_work() for t in manager.secondary_tiers):  # type: ignore[attr-defined]
        sim.step()
        assert time.monotonic() < deadline, "the lower tier did not settle"
        time.sleep(0.005)


def store_then_evict(sim: EngineSim, start: int = 100) -> list[int]:
    """Run prefix ``start`` (stored, cascaded down), then two others that push it out of host."""
    lower_tier(sim)  # one of ours
    return store_then_evict_any(sim, start)


def store_then_evict_any(sim: EngineSim, start: int = 100) -> list[int]:
    p = prompt(start)
    sim.add(p)
    sim.run()
    settle(sim)
    for other in (start + 500, start + 1000):
        sim.add(prompt(other))
        sim.run()
    settle(sim)
    sim.drop_gpu_prefix_cache()
    return p


def loaded(sim: EngineSim, req_id: str) -> list[tuple[list[int], list[int]]]:
    return [(r.group_sizes, r.block_indices) for r in sim.verified_loads if r.req_id == req_id]


@pytest.fixture
def server() -> Iterator[LocalServer]:
    with running_server() as s:
        yield s


def wait_up(tier: _KVOffloadTier, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not tier.tier.up:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the Valkey tier did not come back"
        time.sleep(0.05)


# -- a prefix comes back up ------------------------------------------------------------------


@SPECS
def test_prefix_evicted_from_host_comes_back_from_disk(tmp_path: Path, spec: Any) -> None:
    extra = tier_config(spec, "KVOffloadDiskTier", disk_path=str(tmp_path / "disk"))
    sim = make_sim(tmp_path, spec, extra)
    lookups = Lookups(sim)
    p = store_then_evict(sim)
    first_outputs = sim.outputs["r0"]
    lookups.seen.clear()
    again = sim.add(p)
    sim.run()
    answers = lookups.of(sim, again)
    assert answers[0] is LookupResult.HIT_PENDING  # promotion started: pending first
    assert LookupResult.HIT in answers[1:]  # then a hit
    assert loaded(sim, again) == [([5], [0])]  # then the load, its bytes checked
    assert sim.outputs[again] == first_outputs
    tier = lower_tier(sim)
    assert isinstance(tier, KVOffloadDiskTier)
    assert tier.tier.stats.gets == 5 and tier.tier.stats.corrupt == 0
    # the read ops reached vLLM's stats as a declared histogram (vllm:kvoffload_disk_read_seconds)
    total = OffloadingConnectorStats()
    for payload in sim.stats_payloads:
        total.aggregate(OffloadingConnectorStats(data=payload))
    flat = total.reduce()
    assert flat["vllm:kvoffload_disk_read_seconds_count"] >= 1
    assert flat["vllm:kvoffload_disk_read_seconds_sum"] > 0
    assert "vllm:kvoffload_disk_read_seconds" in KVOffloadDiskTier.build_metric_definitions({})


@SPECS
def test_prefix_evicted_from_host_comes_back_from_valkey(
    tmp_path: Path, spec: Any, server: LocalServer
) -> None:
    extra = tier_config(spec, "KVOffloadValkeyTier", valkey_url=server.url)
    sim = make_sim(tmp_path, spec, extra)
    lookups = Lookups(sim)
    p = store_then_evict(sim)
    tier = lower_tier(sim)
    assert isinstance(tier, KVOffloadValkeyTier)
    tier.tier._known.clear()  # type: ignore[attr-defined]  # as another engine: nothing known
    lookups.seen.clear()
    again = sim.add(p)
    sim.run()
    answers = lookups.of(sim, again)
    assert answers[0] is LookupResult.RETRY  # unknown: one EXISTS probe, the lookup never waits
    assert LookupResult.HIT_PENDING in answers and answers[-1] is LookupResult.HIT
    assert loaded(sim, again) == [([5], [0])]
    assert sim.outputs[again] == sim.outputs["r0"]
    assert tier.tier.stats.gets == 5


# -- failures are misses -----------------------------------------------------------------------


@SPECS
def test_corrupt_disk_value_is_a_miss(tmp_path: Path, spec: Any) -> None:
    extra = tier_config(spec, "KVOffloadDiskTier", disk_path=str(tmp_path / "disk"))
    sim = make_sim(tmp_path, spec, extra)
    p = store_then_evict(sim)
    disk = lower_tier(sim).tier
    for rec in list(disk._where.values()):  # type: ignore[attr-defined]
        fd, offset = disk._locate(rec)  # type: ignore[attr-defined]
        os.pwrite(fd, b"\xff" * 64, offset + HEAD_AREA + 128)  # damage every payload
    again = sim.add(p)
    sim.run()
    assert loaded(sim, again) == []  # nothing loaded: recomputed
    assert sim.outputs[again] == sim.outputs["r0"]
    assert disk.stats.corrupt >= 1 and disk.stats.gets == 0


def valkey_stored(
    tmp_path: Path, spec: Any, server: LocalServer
) -> tuple[EngineSim, _KVOffloadTier, list[int]]:
    """An engine whose Valkey tier (0.2 s timeout) holds a prefix the host no longer has."""
    extra = tier_config(spec, "KVOffloadValkeyTier", valkey_url=server.url, valkey_timeout_s=0.2)
    sim = make_sim(tmp_path, spec, extra)
    return sim, lower_tier(sim), store_then_evict(sim)


@SPECS
def test_valkey_killed_then_back(tmp_path: Path, spec: Any, server: LocalServer) -> None:
    sim, tier, p = valkey_stored(tmp_path, spec, server)
    server.kill()  # its blocks are gone with it
    again = sim.add(p)
    sim.run()
    assert loaded(sim, again) == [] and sim.outputs[again] == sim.outputs["r0"]
    other = sim.add(prompt(2000))  # stores go on (their writes to Valkey fail: misses later)
    sim.run()
    assert len(sim.outputs[other]) == 2
    assert tier.tier.stats.put_failures + tier.tier.stats.put_skipped > 0
    server.start()
    wait_up(tier)
    q = store_then_evict(sim, start=3000)
    back = sim.add(q)
    sim.run()
    assert loaded(sim, back) == [([5], [0])]  # hits resume
    assert tier.tier.stats.reconnects >= 1


@SPECS
def test_valkey_frozen_then_thawed(tmp_path: Path, spec: Any, server: LocalServer) -> None:
    sim, tier, p = valkey_stored(tmp_path, spec, server)
    tier.tier._known.clear()  # type: ignore[attr-defined]  # lookups must ask the server
    server.pause()  # SIGSTOP: connections stay open, nothing answers
    try:
        again = sim.add(p)
        sim.run()
        assert loaded(sim, again) == [] and sim.outputs[again] == sim.outputs["r0"]
        assert not tier.tier.up  # type: ignore[attr-defined]
    finally:
        server.resume()
    wait_up(tier)
    sim.drop_gpu_prefix_cache()
    for other in (5000, 5500):  # push the recomputed prefix out of host again
        sim.add(prompt(other))
        sim.run()
    settle(sim)
    sim.drop_gpu_prefix_cache()
    # "absent" answers learnt while it was frozen expire after KNOWN_ABSENT_S (1 s): skip the wait
    tier.tier._known.clear()  # type: ignore[attr-defined]
    back = sim.add(p)
    sim.run()
    assert loaded(sim, back) == [([5], [0])]  # the server kept its data: hits resume


def test_foreign_valkey_value_is_a_miss(tmp_path: Path, server: LocalServer) -> None:
    extra = tier_config(OURS_SPEC, "KVOffloadValkeyTier", valkey_url=server.url)
    sim = make_sim(tmp_path, OURS_SPEC, extra)
    p = store_then_evict(sim)
    tier = lower_tier(sim)
    import redis

    client = redis.Redis.from_url(server.url)
    names = client.keys(b"kvoffload:*")
    assert len(names) >= 5
    for name in names:  # another writer's bytes under our names: right size, wrong content
        client.set(name, b"\x00" * len(client.get(name) or b""))
    tier.tier._known.clear()  # type: ignore[attr-defined]
    again = sim.add(p)
    sim.run()
    assert loaded(sim, again) == [] and sim.outputs[again] == sim.outputs["r0"]
    assert tier.tier.stats.corrupt >= 1 and tier.tier.stats.gets == 0


# -- restart, identity, options ---------------------------------------------------------------


@SPECS
def test_restart_hits_what_the_last_engine_stored(tmp_path: Path, spec: Any) -> None:
    extra = tier_config(spec, "KVOffloadDiskTier", disk_path=str(tmp_path / "disk"))
    first = make_sim(tmp_path, spec, extra)
    p = prompt(100)
    first.add(p)
    first.run()
    settle(first)
    first.close()  # releases the disk directory
    second = make_sim(tmp_path, spec, extra)
    again = second.add(p)
    second.run()
    assert loaded(second, again) == [([5], [0])]
    assert second.outputs[again] == first.outputs["r0"]


def test_another_model_id_never_reads_the_blocks(tmp_path: Path) -> None:
    disk = str(tmp_path / "disk")
    first = make_sim(tmp_path, OURS_SPEC, tier_config(OURS_SPEC, "", disk_path=disk))
    first.add(prompt(100))
    first.run()
    settle(first)
    fingerprint = lower_tier(first).fingerprint
    first.close()
    extra = tier_config(OURS_SPEC, "", disk_path=disk, model_id="another/model@v2")
    second = make_sim(tmp_path, OURS_SPEC, extra)
    assert lower_tier(second).fingerprint != fingerprint
    again = second.add(prompt(100))
    second.run()
    assert loaded(second, again) == []  # recomputed: the first model's blocks are not its


@SPECS
@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"disk_path": "x", "disk_capacity_bytes": -1}, "disk_capacity_bytes"),
        ({"disk_path": "x", "disk_capcity_bytes": 1 << 30}, "disk_capcity_bytes"),
        ({"disk_path": "x", "valkey_ttl_s": 5}, "valkey_ttl_s"),
        ({"disk_path": "x", "locality": "NEARBY"}, "locality"),
        ({"disk_capacity_bytes": 1 << 30}, "disk_path"),
    ],
)
def test_bad_tier_options_stop_vllm_at_start_up(
    tmp_path: Path, spec: Any, options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        make_sim(tmp_path, spec, tier_config(spec, "KVOffloadDiskTier", **options))


# -- our spec: failures that never reach a lower tier -------------------------------------------


def test_failed_store_is_never_written_down(tmp_path: Path) -> None:
    faults = FaultPlan(stores=1)
    extra = tier_config(OURS_SPEC, "", disk_path=str(tmp_path / "disk"))
    sim = make_sim(tmp_path, OURS_SPEC, extra, backend_factory=faults.factory)
    sim.add(prompt(100))
    sim.run()
    settle(sim)
    assert faults.failed == ["store"]
    assert lower_tier(sim).tier.num_blocks == 0  # type: ignore[attr-defined]
    assert sim.host.tier.index.num_readable == 0


def test_our_spec_takes_vllms_own_fs_tier_too(tmp_path: Path) -> None:
    """secondary_tiers entries other than ours run under KVOffloadSpec as under vLLM's spec."""
    extra = {
        "cpu_bytes_to_use": 8 * CHUNK_BYTES,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "fs")}],
    }
    sim = make_sim(tmp_path, OURS_SPEC, extra)
    (tier,) = sim.scheduler_connector.scheduler.manager.secondary_tiers  # type: ignore[attr-defined]
    assert type(tier).__name__ == "FileSystemTierManager"
    p = store_then_evict_any(sim)
    again = sim.add(p)
    sim.run()
    assert loaded(sim, again) == [([5], [0])]
    assert sim.outputs[again] == sim.outputs["r0"]
