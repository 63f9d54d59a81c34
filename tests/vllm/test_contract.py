"""Contract tests: ``KVOffloadSpec`` under vLLM 0.33's real scheduler and ``OffloadingConnector``.

Each test drives ``EngineSim`` (see ``harness.py``): vLLM's scheduler and connector code, KV
caches allocated by vLLM on CPU, the ``host`` backend moving real bytes, and every completed load
checked byte for byte against what the fake model wrote when the block was first computed.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from kvoffload.transfer.host import HostBackend
from tests.vllm.faults import FaultPlan
from tests.vllm.harness import BLOCK, NUM_LAYERS, PAGE_BYTES, VLLM_VERSION, EngineSim

CHUNK_BYTES = NUM_LAYERS * PAGE_BYTES  # one block of the one full-attention group
RECOVERING: dict[str, Any] = {
    "connector": "KVOffloadConnector",
    "connector_module": "kvoffload.integrations.vllm",
}


def prompt(start: int, blocks: int, extra: int = 3) -> list[int]:
    return list(range(start, start + blocks * BLOCK + extra))


def assert_released(sim: EngineSim) -> None:
    """Nothing in flight, nothing being written, no chunk pinned by a reader."""
    assert not sim.busy()
    assert sim.engine.in_flight() == 0
    index = sim.host.tier.index
    index.check_invariants()
    assert index.num_writing == 0
    readable = index.num_readable
    assert len(index.evict(readable)) == readable, "a chunk is still pinned by a reader"


def loaded_blocks(sim: EngineSim, req_id: str) -> list[tuple[list[int], list[int]]]:
    return [(r.group_sizes, r.block_indices) for r in sim.verified_loads if r.req_id == req_id]


def test_stored_prefix_is_a_full_hit_on_the_next_request(tmp_path: Path) -> None:
    sim = EngineSim(tmp_path)
    p = prompt(100, 5)
    first = sim.add(p)
    sim.run()
    assert sim.host.tier.stats.stores == 5  # every full prompt block, none of the tail
    sim.drop_gpu_prefix_cache()
    second = sim.add(p)
    sim.run()
    assert loaded_blocks(sim, second) == [([5], [0])]
    assert sim.host.tier.stats.hits == 5
    assert sim.outputs[second] == sim.outputs[first] == [7, 7]
    assert_released(sim)


def test_partial_hit_loads_the_shared_prefix_and_stores_the_rest(tmp_path: Path) -> None:
    sim = EngineSim(tmp_path)
    shared = prompt(100, 5)
    sim.add(shared)
    sim.run()
    sim.drop_gpu_prefix_cache()
    diverging = shared[: 3 * BLOCK] + prompt(900, 3, extra=5)
    second = sim.add(diverging)
    sim.run()
    assert loaded_blocks(sim, second) == [([3], [0])]
    assert sim.host.tier.stats.stores == 5 + 3  # its own 3 new blocks, not the hit
    sim.drop_gpu_prefix_cache()
    third = sim.add(diverging)
    sim.run()
    assert loaded_blocks(sim, third) == [([6], [0])]
    assert_released(sim)


def test_hit_past_the_gpu_prefix_cache_loads_only_the_missing_blocks(tmp_path: Path) -> None:
    sim = EngineSim(tmp_path)
    p = prompt(100, 5)
    sim.add(p)
    sim.run()
    sim.drop_gpu_prefix_cache()
    short = sim.add([*p[: 2 * BLOCK], 5, 6, 7])  # brings blocks 0-1 back into the GPU cache
    sim.run()
    assert loaded_blocks(sim, short) == [([2], [0])]
    full = sim.add(p)
    sim.run()
    assert loaded_blocks(sim, full) == [([3], [2])]  # blocks 2-4 from host, 0-1 from GPU
    assert_released(sim)


def test_failed_load_is_reported_and_the_blocks_recomputed(tmp_path: Path) -> None:
    faults = FaultPlan()
    sim = EngineSim(tmp_path, backend_factory=faults.factory, **RECOVERING)
    p = prompt(100, 5)
    first = sim.add(p)
    sim.run()
    sim.drop_gpu_prefix_cache()
    faults.loads = 1
    second = sim.add(p)
    sim.run()
    assert faults.failed == ["load"]
    assert second in sim.failed_recving
    assert loaded_blocks(sim, second) == []
    assert sim.outputs[second] == sim.outputs[first]
    stats = sim.host.tier.stats
    assert stats.misses == 2  # the failed chunks were dropped: the retry looked them up again
    if VLLM_VERSION >= (0, 33):
        assert stats.stores == 10  # and stored what it recomputed
    else:  # vLLM 0.32 does not offer a retried request's chunks again: the next request does
        assert stats.stores == 5
        sim.drop_gpu_prefix_cache()
        sim.add(p)
        sim.run()
        assert stats.stores == 10
    sim.drop_gpu_prefix_cache()
    third = sim.add(p)
    sim.run()
    assert loaded_blocks(sim, third) == [([5], [0])]  # the recomputed bytes round-trip
    assert_released(sim)


def test_failed_store_never_becomes_a_hit(tmp_path: Path) -> None:
    faults = FaultPlan(stores=1)
    sim = EngineSim(tmp_path, backend_factory=faults.factory, **RECOVERING)
    p = prompt(100, 5)
    sim.add(p)
    sim.run()
    assert faults.failed == ["store"]
    assert sim.host.tier.index.num_readable == 0
    sim.drop_gpu_prefix_cache()
    second = sim.add(p)
    sim.run()
    assert loaded_blocks(sim, second) == []  # recomputed, and stored this time
    sim.drop_gpu_prefix_cache()
    third = sim.add(p)
    sim.run()
    assert loaded_blocks(sim, third) == [([5], [0])]
    assert_released(sim)


def test_stock_connector_stops_on_a_failed_load(tmp_path: Path) -> None:
    """vLLM 0.33's own OffloadingConnector asserts that transfers succeed: loud, never wrong KV."""
    faults = FaultPlan()
    sim = EngineSim(tmp_path, backend_factory=faults.factory)
    p = prompt(100, 5)
    sim.add(p)
    sim.run()
    sim.drop_gpu_prefix_cache()
    faults.loads = 1
    sim.add(p)
    with pytest.raises(AssertionError):
        sim.run()


def test_preemption_releases_what_it_held(tmp_path: Path) -> None:
    # 11 usable GPU blocks; two requests that each grow to 8 blocks force preemptions.
    sim = EngineSim(tmp_path, num_gpu_blocks=12, max_model_len=160)
    a = sim.add(prompt(100, 3, extra=8), max_tokens=60)
    b = sim.add(prompt(500, 3, extra=8), max_tokens=60)
    sim.run(max_steps=400)
    preempted = [r for r in (a, b) if sim.preemptions.get(r)]
    assert preempted, "the test did not preempt anything"
    assert len(sim.outputs[a]) == len(sim.outputs[b]) == 60
    assert sim.host.tier.stats.stores >= 6  # both prompts' full blocks
    assert_released(sim)


def test_abort_releases_a_load_and_a_store_in_flight(tmp_path: Path) -> None:
    sim = EngineSim(tmp_path)
    p = prompt(100, 5)
    sim.add(p)
    sim.run()
    sim.drop_gpu_prefix_cache()
    loading = sim.add(p)
    sim.step(drain=False)  # the load job is submitted and may still be copying
    sim.abort(loading)
    storing = sim.add(prompt(700, 4), max_tokens=20)
    sim.step(drain=False)
    sim.step(drain=False)  # its store job is submitted
    sim.abort(storing)
    sim.run()
    assert loading not in sim.scheduler.requests and storing not in sim.scheduler.requests
    assert_released(sim)


def test_sliding_window_model_groups(tmp_path: Path) -> None:
    sim = EngineSim(tmp_path, sliding_window=2 * BLOCK, max_model_len=512)
    assert len(sim.groups) == 2  # full attention, sliding window
    p = prompt(100, 6)
    first = sim.add(p)
    sim.run()
    sim.drop_gpu_prefix_cache()
    second = sim.add(p)
    sim.run()
    ((sizes, starts),) = loaded_blocks(sim, second)
    assert sizes[0] == 6 and starts[0] == 0  # every block of the full-attention group
    assert 0 < sizes[1] < 6 and starts[1] + sizes[1] == 6  # only the window's tail blocks
    assert sim.outputs[second] == sim.outputs[first]
    assert_released(sim)


def test_eviction_under_a_small_cpu_bytes_to_use(tmp_path: Path) -> None:
    sim = EngineSim(tmp_path, extra_config={"cpu_bytes_to_use": 8 * CHUNK_BYTES})
    tier = sim.host.tier
    assert tier.num_chunks == 8
    old = prompt(100, 5)
    new = prompt(600, 5)
    sim.add(old)
    sim.run()
    sim.add(new)
    sim.run()
    assert tier.stats.evictions == 2  # the least recently used: the last two blocks of `old`
    assert tier.index.num_readable == 8
    sim.drop_gpu_prefix_cache()
    hit = sim.add(new)
    sim.run()
    assert loaded_blocks(sim, hit) == [([5], [0])]
    head = sim.add(old)  # its head outlived its tail
    sim.run()
    assert loaded_blocks(sim, head) == [([3], [0])]
    assert tier.index.num_readable == 8  # storing its tail again evicted two more
    assert_released(sim)


def test_blocks_per_chunk_two(tmp_path: Path) -> None:
    """Offload chunks of two GPU blocks: a hit starting inside a chunk skips its first half."""
    sim = EngineSim(tmp_path, extra_config={"block_size": 2 * BLOCK})
    p = prompt(100, 6)
    sim.add(p)
    sim.run()
    assert sim.host.tier.stats.stores == 3
    sim.drop_gpu_prefix_cache()
    short = sim.add([*p[: 3 * BLOCK], 5, 6])  # blocks 0-2 from host (chunk 1 half used)
    sim.run()
    assert loaded_blocks(sim, short) == [([2], [0])]  # whole chunks only: blocks 0-1
    full = sim.add(p)
    sim.run()
    (record,) = [r for r in sim.verified_loads if r.req_id == full]
    assert sum(record.group_sizes) >= 3
    assert_released(sim)


def test_metrics_reach_vllm_connector_stats(tmp_path: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

    from kvoffload.integrations.vllm.spec import KVOffloadSpec

    sim = EngineSim(tmp_path)
    p = prompt(100, 5)
    sim.add(p)
    sim.run()
    sim.drop_gpu_prefix_cache()
    sim.add(p)
    sim.run()
    total = OffloadingConnectorStats()
    for payload in sim.stats_payloads:
        total.aggregate(OffloadingConnectorStats(data=payload))
    flat = total.reduce()
    assert flat["vllm:kv_offload_store_bytes"] == 5 * CHUNK_BYTES
    assert flat["vllm:kv_offload_load_bytes"] == 5 * CHUNK_BYTES
    assert flat["vllm:kv_offload_load_time"] > 0
    assert flat["vllm:kvoffload_host_stored_chunks"] == 5
    assert flat["vllm:kvoffload_host_loaded_chunks"] == 5
    assert flat["vllm:kv_offload_tiering_chunk_hits:('0:primary',)"] == 5  # vLLM's own counter
    # every name we report is declared, so vLLM's Prometheus logger registers it
    extra = sim.config.kv_transfer_config.kv_connector_extra_config  # type: ignore[union-attr]
    declared = KVOffloadSpec.build_metric_definitions(extra)
    reported = {name.split(":(")[0].removesuffix("_count").removesuffix("_sum") for name in flat}
    assert {n for n in reported if "kvoffload" in n or "tiering" in n} <= set(declared)
    if VLLM_VERSION >= (0, 33):  # vllm:kv_offload_config_info
        (info,) = sim.manager.config_info()
        assert info["kvoffload_host_chunks"] == (1 << 20) // CHUNK_BYTES
        assert set(info) <= set(KVOffloadSpec.config_info_keys(extra))


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"evicton_policy": "lru"}, "evicton_policy"),
        ({"eviction_policy": "fifo"}, "eviction_policy"),
        ({"backend": "cuda"}, "backend"),
        ({"cpu_bytes_to_use": CHUNK_BYTES - 1}, "cpu_bytes_to_use"),
        ({"host_capacity_bytes": 1 << 20}, "host_capacity_bytes"),
    ],
)
def test_bad_options_fail_when_vllm_builds_the_connector(
    tmp_path: Path, extra: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        EngineSim(tmp_path, extra_config=extra)


# -- sync loads (vLLM 0.33): a failed one on a model with two KV-cache groups --------------------

SYNC = {"sync_load_budget_bytes": 1 << 20}
needs_sync = pytest.mark.skipif(VLLM_VERSION < (0, 33), reason="vLLM 0.32 has no sync loads")


def sync_sim(tmp_path: Path, groups: int) -> tuple[EngineSim, FaultPlan, list[int], str]:
    """A recovering engine with sync loads (two groups: a sliding-window model) whose prompt is
    stored and dropped from the GPU cache, ready to be loaded again; and its first request."""
    faults = FaultPlan()
    window: dict[str, Any] = {"sliding_window": 2 * BLOCK, "max_model_len": 512}
    sim = EngineSim(
        tmp_path,
        extra_config=SYNC,
        backend_factory=faults.factory,
        **(window if groups == 2 else {}),
        **RECOVERING,
    )
    assert len(sim.groups) == groups
    p = prompt(100, 6 if groups == 2 else 5)
    first = sim.add(p)
    sim.run()
    sim.drop_gpu_prefix_cache()
    return sim, faults, p, first


@needs_sync
def test_failed_sync_load_on_a_two_group_model_is_retried_through_a_second_path(
    tmp_path: Path,
) -> None:
    sim, faults, p, first = sync_sim(tmp_path, groups=2)
    faults.loads = 1
    second = sim.add(p)
    sim.run()
    assert faults.failed == ["load"]  # the first copy failed, the retry did not
    ((record,),) = [[r for r in sim.verified_loads if r.req_id == second]]
    assert record.sync  # a load the step waited on, its bytes checked
    assert sim.outputs[second] == sim.outputs[first]
    assert_released(sim)


@needs_sync
def test_sync_load_failing_twice_on_a_two_group_model_stops_before_the_step(
    tmp_path: Path,
) -> None:
    """vLLM 0.33 cannot recompute it (invalid_block_ids need one group): loud, never wrong KV."""
    sim, faults, p, _ = sync_sim(tmp_path, groups=2)
    faults.loads = 2
    sim.add(p)
    with pytest.raises(RuntimeError, match="sync_load_budget_bytes to 0"):
        sim.run()


@needs_sync
def test_sync_load_failing_twice_on_one_group_is_recomputed(tmp_path: Path) -> None:
    sim, faults, p, first = sync_sim(tmp_path, groups=1)
    faults.loads = 2
    second = sim.add(p)
    sim.run()
    assert faults.failed == ["load", "load"]
    assert loaded_blocks(sim, second) == []
    assert [r.req_id for r in sim.invalid_loads] == [second]  # invalid blocks: recomputed
    assert sim.outputs[second] == sim.outputs[first]
    assert_released(sim)


# -- vLLM's own flags and sizing ---------------------------------------------------------------


def test_kv_offloading_size_flag_combines_with_our_connector(tmp_path: Path) -> None:
    from kvoffload.integrations.vllm.connector import KVOffloadConnector

    sim = EngineSim(tmp_path, kv_offloading_size=1 / 1024, **RECOVERING)  # 1 MiB
    kv = sim.config.kv_transfer_config
    assert kv is not None and kv.kv_connector == "OffloadingConnector"  # vLLM renamed it
    assert type(sim.scheduler_connector) is KVOffloadConnector
    assert sim.host.tier.num_chunks == (1 << 20) // CHUNK_BYTES
    p = prompt(100, 5)
    sim.add(p)
    sim.run()
    sim.drop_gpu_prefix_cache()
    second = sim.add(p)
    sim.run()
    assert loaded_blocks(sim, second) == [([5], [0])]


def test_cpu_bytes_to_use_counts_every_rank_like_vllms_own_spec() -> None:
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    from kvoffload.integrations.vllm.spec import KVOffloadSpec
    from tests.vllm.harness import offloading_config

    config = offloading_config(world_size=4, block_bytes=64 << 10, cpu_bytes=64 << 20)
    ours = KVOffloadSpec(config)
    assert ours.num_chunks == (64 << 20) // (4 * (64 << 10)) == 256
    assert ours.region_bytes <= 64 << 20  # the total across the 4 ranks, not per rank
    assert ours.num_chunks == CPUOffloadingSpec(config).num_chunks


class HeldLoads(HostBackend):
    """The host backend, whose loads stop before layer ``hold`` until ``release`` (once armed)."""

    hold = 1

    def __init__(self, layout: Any, arena: Any, gate: threading.Event, armed: list[bool]) -> None:
        super().__init__(layout, arena)
        self.gate, self.armed = gate, armed

    def _copy_region(self, spec: Any, r: int) -> None:
        if self.armed[0] and spec.direction == "load" and r == self.hold:
            assert self.gate.wait(30), "layer 1 was never released"
        super()._copy_region(spec, r)


@needs_sync
def test_per_layer_sync_load_runs_layer_0_while_layer_1_is_still_copying(tmp_path: Path) -> None:
    from tests.vllm.harness import page_pattern

    gate, armed = threading.Event(), [False]
    seen: dict[str, tuple[bool, bool]] = {}  # layer -> (its pages loaded, next layer's loaded)

    def sync_pages_ok(layer: str) -> bool:
        ok = True
        for record in [r for r in sim.loads.values() if r.sync]:
            hashes = sim.block_hashes[record.req_id]
            for k, block in enumerate(record.block_ids):
                want = page_pattern(hashes[record.block_indices[0] + k], layer)
                ok &= bool(np.array_equal(sim.page(layer, block), want))
        return ok

    def on_layer(layer: str) -> None:
        layers = list(sim.kv_caches)
        nxt = layers[layers.index(layer) + 1] if layer != layers[-1] else None
        seen[layer] = (sync_pages_ok(layer), nxt is not None and sync_pages_ok(nxt))
        gate.set()  # layer 0's attention has run: let the copy go on

    sim = EngineSim(
        tmp_path,
        extra_config={**SYNC, "per_layer_loads": True},
        backend_factory=lambda layout, arena: HeldLoads(layout, arena, gate, armed),
        on_layer=on_layer,
        **RECOVERING,
    )
    p = prompt(100, 5)
    first = sim.add(p)
    sim.run()
    sim.drop_gpu_prefix_cache()
    armed[0] = True
    second = sim.add(p)
    sim.run()
    layers = list(sim.kv_caches)
    assert seen[layers[0]] == (True, False)  # layer 0 in place while layer 1 was held back
    assert all(seen[layer][0] for layer in layers)  # every layer in place before its attention
    ((record,),) = [[r for r in sim.verified_loads if r.req_id == second]]
    assert record.sync and sim.outputs[second] == sim.outputs[first]
    assert_released(sim)


def test_per_layer_loads_ask_vllm_for_piecewise_cuda_graphs() -> None:
    from kvoffload.integrations.vllm.connector import KVOffloadConnector

    assert KVOffloadConnector.requires_piecewise_for_cudagraph({**SYNC, "per_layer_loads": True})
    assert not KVOffloadConnector.requires_piecewise_for_cudagraph({"per_layer_loads": True})
    assert not KVOffloadConnector.requires_piecewise_for_cudagraph(SYNC)


def test_a_vllm_outside_the_tested_range_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    import kvoffload.integrations.vllm as adapter

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    adapter.check_vllm_version.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"supports vLLM 0\.32, 0\.33.*got vLLM 0\.34\.0"):
            adapter.KVOffloadSpec  # noqa: B018 (the attribute access is the import)
    finally:
        adapter.check_vllm_version.cache_clear()
