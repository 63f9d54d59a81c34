"""The vLLM adapter's vLLM-free parts: options, canonical layout, transfer plans, engine, tier."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.config import OffloadConfig
from kvoffload.integrations.vllm.canonical import layout_from_canonical
from kvoffload.integrations.vllm.engine import TransferEngine
from kvoffload.integrations.vllm.options import VLLM_KEYS, parse_options
from kvoffload.integrations.vllm.plan import plan_transfers
from kvoffload.integrations.vllm.tier import HIT, MISS, PENDING, HostTier
from kvoffload.store.arena import HostArena
from kvoffload.transfer.host import HostBackend
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import TransferSpec
from tests.gpu.test_vllm_worker_gpu import (
    Ref,
    Tensor,
    canonical_caches,
    rank_round_trip,
    round_trip,
)
from tests.vllm.faults import FaultPlan

# -- options ----------------------------------------------------------------------------------


def test_options_leave_vllm_keys_to_vllm_and_validate_ours() -> None:
    extra = {k: object() for k in VLLM_KEYS if k != "canonical_layout"}
    options = parse_options(
        {**extra, "cpu_bytes_to_use": 3 << 30, "eviction_policy": "arc", "backend": "host"}
    )
    assert options.cpu_bytes_to_use == 3 << 30
    assert options.config == OffloadConfig(
        host_capacity_bytes=3 << 30, eviction_policy="arc", backend="host"
    )
    assert parse_options({"cpu_bytes_to_use": float(1 << 30)}).cpu_bytes_to_use == 1 << 30


def test_the_eviction_window_option_reaches_the_host_tiers_index() -> None:
    options = parse_options({"cpu_bytes_to_use": 1 << 30, "eviction_window": "8"})
    assert options.config.eviction_window == 8
    assert parse_options({"cpu_bytes_to_use": 1 << 30}).config.eviction_window == 1
    with pytest.raises(ValueError, match="expected eviction_window to be an integer"):
        parse_options({"cpu_bytes_to_use": 1 << 30, "eviction_window": "wide"})
    with pytest.raises(ValueError, match="expected eviction_window to be an int of 1 to 1024"):
        parse_options({"cpu_bytes_to_use": 1 << 30, "eviction_window": "0"})
    tier = HostTier(16, 64, "lru", window=options.config.eviction_window)
    tier.reset()
    assert tier.index.window == 8


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": -1}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 1.5}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": True}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 1 << 30, "evicton_policy": "lru"}, r"unknown.*evicton_policy"),
        ({"cpu_bytes_to_use": 1 << 30, "eviction_policy": "fifo"}, r"eviction_policy.*'lru'"),
        ({"cpu_bytes_to_use": 1 << 30, "backend": "cuda"}, r"backend.*'staged'"),
        ({"cpu_bytes_to_use": 1 << 30, "pin_memory": "yes"}, "pin_memory"),
        ({"cpu_bytes_to_use": 1 << 30, "host_capacity_blocks": 4}, "not supported with vLLM"),
        ({"cpu_bytes_to_use": 1 << 30, "canonical_layout": True}, "canonical_layout"),
    ],
)
def test_bad_options_name_the_key(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_options(extra)


# -- canonical layout -------------------------------------------------------------------------


def test_layout_has_one_region_per_reference_with_the_unpadded_page() -> None:
    caches = canonical_caches("cpu", 3, page=3072, padded=3584, groups=2, seed=0)
    layout = layout_from_canonical(caches.tensors, caches.group_refs, block_size=16)
    assert len(layout.groups) == 2
    for group in layout.groups:
        assert [r.base for r in group.regions] == [t.tensor.data_ptr() for t in caches.tensors]
        assert {(r.block_stride, r.page_bytes, r.num_blocks) for r in group.regions} == {
            (3584, 3072, 64)
        }
    assert layout.slot_bytes == 3 * 3072
    assert layout.device == "cpu" and not layout.is_cuda


def test_layout_rejects_bad_references() -> None:
    caches = canonical_caches("cpu", 2, page=1024, padded=1024, groups=1, seed=0)
    with pytest.raises(ValueError, match=r"tensors in \[0, 2\), got 5"):
        layout_from_canonical(caches.tensors, [[Ref(5, 1024)]], 16)
    with pytest.raises(ValueError, match="at most 1024 bytes"):
        layout_from_canonical(caches.tensors, [[Ref(0, 2048)]], 16)
    with pytest.raises(ValueError, match="0 tensors"):
        layout_from_canonical([], [[]], 16)


# -- transfer plans ---------------------------------------------------------------------------


def oracle_slots(
    group_sizes: Sequence[int], starts: Sequence[int], chunks: Sequence[int], bpc: int
) -> list[list[int]]:
    """Block k of a group run sits (skip + k) blocks into its chunks (vLLM's sub-block rule)."""
    out: list[list[int]] = []
    used = 0
    for size, start in zip(group_sizes, starts, strict=True):
        if size == 0:
            out.append([])
            continue
        skip = start % bpc
        mine = chunks[used : used + (skip + size + bpc - 1) // bpc]
        out.append([mine[(skip + k) // bpc] * bpc + (skip + k) % bpc for k in range(size)])
        used += len(mine)
    return out


@given(
    bpc=st.integers(1, 4),
    groups=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 9)), min_size=1, max_size=4),
)
def test_plan_matches_the_sub_block_rule(bpc: int, groups: list[tuple[int, int]]) -> None:
    sizes = [g[0] for g in groups]
    starts = [g[1] for g in groups]
    n_chunks = sum((s % bpc + n + bpc - 1) // bpc for n, s in groups if n)
    chunks = list(range(100, 100 + n_chunks))[::-1]
    blocks = list(range(sum(sizes)))
    specs = plan_transfers("load", blocks, sizes, starts, chunks, bpc)
    want = oracle_slots(sizes, starts, chunks, bpc)
    assert [s.group for s in specs] == [g for g, n in enumerate(sizes) if n]
    assert [s.slots.tolist() for s in specs] == [w for w in want if w]
    assert np.concatenate([s.blocks for s in specs] or [np.zeros(0)]).tolist() == blocks


def test_plan_rejects_counts_that_do_not_add_up() -> None:
    with pytest.raises(ValueError, match="host chunks"):
        plan_transfers("store", [1, 2, 3], [3], [0], [7], 2)  # needs 2 chunks
    with pytest.raises(ValueError, match="host chunks"):
        plan_transfers("store", [1, 2], [3], [0], [7, 8], 2)  # 2 blocks, 3 claimed
    with pytest.raises(ValueError, match="one block index per group"):
        plan_transfers("store", [1], [1], [0, 0], [7], 1)


# -- the engine -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "blocks_per_chunk", "groups"), [("plain", 1, 1), ("padded", 1, 2), ("plain", 2, 2)]
)
def test_round_trip_on_cpu(shape: str, blocks_per_chunk: int, groups: int) -> None:
    """The GPU test's code path, with CPU tensors and the host backend on both sides."""
    round_trip("cpu", "host", shape, blocks_per_chunk, groups)


def small_engine(**kwargs: object) -> tuple[TransferEngine, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    kv = torch.randint(-128, 128, (32, 256), generator=gen).to(torch.int8)
    layout = layout_from_canonical([Tensor(kv, 256)], [[Ref(0, 256)]], 16)
    return TransferEngine(layout, 8, 1, OffloadConfig(), **kwargs), kv  # type: ignore[arg-type]


def test_a_failed_copy_is_reported_not_raised() -> None:
    faults = FaultPlan(stores=1)
    eng, kv = small_engine(backend_factory=faults.factory)
    try:
        eng.submit(1, "store", [3, 4], [2], [0], [0, 1])
        eng.submit(2, "store", [5], [1], [0], [2])
        eng.drain()
        first, second = eng.get_finished()
        assert (first.job_id, first.ok, first.nbytes) == (1, False, 0)
        assert first.error is not None and "injected store failure" in first.error
        assert (second.job_id, second.ok, second.nbytes) == (2, True, 256)
        assert np.array_equal(eng.arena.slots[2, :256], kv[5].view(torch.uint8).numpy())
        assert not eng.arena.slots[:2].any()  # the failed job wrote nothing
        assert eng.get_finished() == []  # each job reported once
    finally:
        eng.close()


def test_bad_jobs_raise_at_submit() -> None:
    eng, _ = small_engine()
    try:
        with pytest.raises(ValueError, match="host slot"):
            eng.submit(1, "store", [3], [1], [0], [8])  # 8 chunks: 0..7
        eng.submit(2, "store", [3], [1], [0], [1])
        with pytest.raises(ValueError, match="already in flight"):
            eng.submit(2, "store", [4], [1], [0], [2])
    finally:
        eng.close()


class GatedHost(HostBackend):
    """Regular loads wait at a gate; expedited ones are told apart by their first block (0)."""

    gate = threading.Event()

    def copy(self, specs: Sequence[TransferSpec]) -> None:
        if specs and specs[0].direction == "load" and specs[0].blocks[0] != 0:
            assert self.gate.wait(10)
        super().copy(specs)


def test_expedited_loads_do_not_queue_behind_regular_loads() -> None:
    def factory(layout: KVLayout, arena: HostArena) -> HostBackend:
        return _Lanes(layout, arena)

    eng, kv = small_engine(backend_factory=factory)
    try:
        eng.submit(1, "store", [7], [1], [0], [0])
        eng.drain()
        GatedHost.gate.clear()
        eng.submit(2, "load", [9], [1], [0], [0])  # blocked at the gate
        eng.submit(3, "load", [0], [1], [0], [0], expedited=True)
        eng.wait([3])
        assert [r.job_id for r in eng.get_finished()] == [1, 3]
        assert torch.equal(kv[0], kv[7])
        GatedHost.gate.set()
        eng.drain()
        assert [r.job_id for r in eng.get_finished()] == [2]
        assert torch.equal(kv[9], kv[7])
    finally:
        GatedHost.gate.set()
        eng.close()


class _Lanes(GatedHost):
    """The gated copy, on as many threads as lanes (the stock host backend has one)."""

    def __init__(self, layout: KVLayout, arena: HostArena) -> None:
        super().__init__(layout, arena)
        from concurrent.futures import ThreadPoolExecutor

        self._pool.shutdown()
        self._pool = ThreadPoolExecutor(3)


# -- the host tier ----------------------------------------------------------------------------


def keys(*names: str) -> list[bytes]:
    return [n.encode() + b"\x00\x00\x00\x00" for n in names]


def test_tier_lookup_states_and_two_phase_store() -> None:
    tier = HostTier(4, 1000)
    a, b = keys("a", "b")
    assert tier.lookup(a) == MISS
    plan = tier.prepare_store([a, b])
    assert plan is not None and plan.keys == [a, b] and len(set(plan.slots.tolist())) == 2
    assert tier.lookup(a) == PENDING
    tier.complete_store({b, a})
    assert tier.lookup(a) == HIT and tier.lookup(b) == HIT
    assert tier.stats.stores == 2 and tier.stats.hits == 2 and tier.stats.misses == 1
    assert tier.usage() == 0.5


def test_tier_gives_up_the_tail_of_a_prefix_first() -> None:
    tier = HostTier(4, 1000)
    prefix = keys("p0", "p1", "p2", "p3")
    assert tier.prepare_store(prefix) is not None
    tier.complete_store(set(prefix))  # vLLM hands an unordered set
    plan = tier.prepare_store(keys("q0", "q1"))
    assert plan is not None and plan.evicted == [prefix[3], prefix[2]]
    assert [tier.lookup(k) for k in prefix] == [HIT, HIT, MISS, MISS]


def test_tier_refuses_a_store_when_everything_is_pinned() -> None:
    tier = HostTier(2, 1000)
    held = keys("a", "b")
    assert tier.prepare_store(held) is not None
    tier.complete_store(held)
    tier.prepare_load(held)
    assert tier.prepare_store(keys("c")) is None
    assert tier.store_refusals == 1
    tier.complete_load(held)
    plan = tier.prepare_store(keys("c"))
    assert plan is not None and len(plan.evicted) == 1


def test_tier_failed_store_drop_and_reset() -> None:
    tier = HostTier(4, 1000, events=True)
    a, b, c = keys("a", "b", "c")
    assert tier.prepare_store([a, b]) is not None
    tier.complete_store([a, b], success=False)
    assert tier.lookup(a) == MISS and tier.index.num_free == 4
    assert tier.prepare_store([a, b, c]) is not None
    tier.complete_store([a, b, c])
    assert tier.drop([b]) == [b] and tier.lookup(b) == MISS
    tier.prepare_load([a])  # pinned
    assert tier.prepare_store(keys("d")) is not None  # being written
    tier.reset()  # forgets all of it: vLLM discards jobs in flight at a reset
    assert tier.index.num_free == 4 and tier.lookup(a) == MISS
    assert tier.stats.stores == 3  # counters survive a reset
    events = [(e.keys, e.removed, e.metadata_only) for e in tier.take_events()]
    assert events == [
        ([a, b], True, True),
        ([a, b, c], False, False),
        ([b], True, False),
    ]
    assert tier.take_events() == []


def test_rank_slots_in_a_shared_region_on_cpu() -> None:
    """The GPU test of KVOffloadSpec's shared host region, with the host backend."""
    rank_round_trip("cpu", "host")
