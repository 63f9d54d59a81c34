"""The eviction window (``OffloadConfig.eviction_window``): a store that must evict n blocks picks
them among the policy's first n x window evictable ones, in the fewest runs of consecutive host
slots (``kvoffload/store/native/runs.c``), the native index and its Python model
(``tests/index_model.py``) side by side. The 10^5-step state machine draws the window too
(``tests/test_index_state_machine.py``)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvoffload.config import OffloadConfig
from kvoffload.offload import build_local
from kvoffload.store.index import BlockIndex
from kvoffload.transfer.layout import KVLayout
from tests.index_model import choose_runs
from tests.index_twin import TwinIndex


def keys(n: int, start: int = 0) -> list[bytes]:
    return [i.to_bytes(16, "big") for i in range(start, start + n)]


def runs(slots: list[int] | np.ndarray) -> int:
    s = sorted(int(x) for x in slots)
    return sum(1 for i, x in enumerate(s) if i == 0 or x != s[i - 1] + 1)


def interleaved(window: int, policy: str = "lru", slots: int = 16) -> TwinIndex:
    """A full index whose policy order is the odd slots, then the even ones: the victims of the
    exact order are scattered."""
    twin = TwinIndex(slots, 64, policy, window)
    for k in keys(slots):
        plan = twin.prepare_store([k])
        twin.complete_store(plan.keys, True, plan.slots)
    twin.touch(keys(slots)[0::2])
    twin.assert_same(keys(slots))
    return twin


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize(("window", "want_runs"), [(1, 4), (2, 4), (4, 1), (1024, 1)])
def test_a_store_into_a_fragmented_arena_gets_fewer_runs(
    policy: str, window: int, want_runs: int
) -> None:
    twin = interleaved(window, policy)
    order = [twin.native.slot_of(k) for k in keys(16)[1::2] + keys(16)[0::2]]
    plan = twin.prepare_store(keys(4, 100))
    assert runs(plan.slots) == want_runs
    assert set(plan.slots.tolist()) <= set(order[: 4 * window])  # from the window only
    assert len(plan.evicted) == 4
    twin.assert_same(keys(16) + keys(4, 100))
    twin.check_invariants()


def test_the_window_is_the_policys_order_where_runs_tie() -> None:
    """With every candidate a run of one the choice is the policy's first: the exact order."""
    assert choose_runs([9, 3, 7, 1, 5], 2) == [0, 1]
    assert choose_runs([9, 3, 7, 1, 5], 3) == [0, 1, 2]


def test_choose_runs_takes_the_shortest_covering_run_else_the_longest() -> None:
    # runs (by slot): 1-3 (ages 0,1,2), 10-11 (ages 3,4), 20 (age 5)
    slots = [1, 2, 3, 10, 11, 20]
    assert choose_runs(slots, 2) == [3, 4]  # 10-11 covers 2 exactly
    assert choose_runs(slots, 1) == [5]  # 20 covers 1 exactly
    assert choose_runs(slots, 3) == [0, 1, 2]
    assert choose_runs(slots, 4) == [0, 1, 2, 5]  # 1-3 whole, then 20 (shortest for 1)
    assert choose_runs(slots, 5) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("seed", range(40))
def test_choose_runs_is_the_fewest_runs(seed: int) -> None:
    """The choice's runs are the least any choice of as many candidates can have (the longest
    runs, the last cut), so never more than the policy's first ``want``."""
    rng = random.Random(seed)
    slots = rng.sample(range(64), rng.randint(2, 40))
    want = rng.randint(1, len(slots) - 1)
    got = choose_runs(slots, want)
    assert len(got) == want and len(set(got)) == want and got == sorted(got)
    lengths = sorted((len(r) for r in _runs_of(slots)), reverse=True)
    least = next(k for k in range(1, len(lengths) + 1) if sum(lengths[:k]) >= want)
    assert runs([slots[i] for i in got]) == least <= runs(slots[:want])


def _runs_of(slots: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for s in sorted(slots):
        if out and s == out[-1][-1] + 1:
            out[-1].append(s)
        else:
            out.append([s])
    return out


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_native_and_model_agree_under_random_stores(policy: str, window: int) -> None:
    """Stores of 1-12 blocks into a 48-slot index, loads and touches between them: the native
    index and the model agree call by call (``TwinIndex``), blocks being read never evicted."""
    rng = random.Random(f"{policy}{window}")
    twin = TwinIndex(48, 64, policy, window)
    stored: list[bytes] = []
    for step in range(400):
        new = keys(rng.randint(1, 12), 1000 * step)
        pinned = rng.sample(stored, min(len(stored), rng.randint(0, 3)))
        live = [k for k in pinned if twin.native.state(k)]
        slots = twin.prepare_load(live) if live else None
        plan = twin.prepare_store(new)
        twin.complete_store(plan.keys, rng.random() > 0.1, plan.slots)
        if live:
            assert all(twin.native.state(k) for k in live)  # a block being read is never a victim
            twin.complete_load(live, True, slots)
        stored = [k for k in stored + list(plan.keys) if twin.native.state(k)]
        if stored and rng.random() < 0.5:
            twin.touch(rng.sample(stored, min(len(stored), 6)))
    twin.check_invariants()


def test_refused_windows_change_nothing() -> None:
    for bad in (0, -1, 1025, 2.0, True, "4"):
        with pytest.raises(ValueError, match="expected eviction_window to be an int of 1 to 1024"):
            OffloadConfig(eviction_window=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="expected an eviction window of 1 to 1024"):
            BlockIndex(8, 64, "lru", bad)  # type: ignore[arg-type]


def test_the_offloader_uses_the_configs_window() -> None:
    kv = np.zeros((4, 64), np.uint8)
    layout = KVLayout.from_tensors([kv], block_size=16, block_dim=0)
    assert OffloadConfig().eviction_window == 4
    for window in (1, 4, 16):
        local = build_local(layout, OffloadConfig(host_capacity_blocks=8, eviction_window=window))
        try:
            assert local.offloader.index.window == window
        finally:
            local.close()
