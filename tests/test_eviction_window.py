"""The eviction window (``OffloadConfig.eviction_window``): a store that must evict n blocks picks
them among the policy's first n x window evictable ones (at most num_slots / 16 more) by runs of
consecutive host slots, the oldest first (``kvoffload/store/native/runs.c``), the native index and
its Python model (``tests/index_model.py``) side by side. The 10^5-step state machine draws the
window too (``tests/test_index_state_machine.py``)."""

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


def interleaved(window: int, policy: str = "lru", slots: int = 256) -> TwinIndex:
    """A full index whose policy order starts with slots 1, 3, ..., 15, then 0, 2, ..., 14: the
    first victims of the exact order are scattered, the first 16 one run."""
    twin = TwinIndex(slots, 64, policy, window)
    for k in keys(slots):
        plan = twin.prepare_store([k])
        twin.complete_store(plan.keys, True, plan.slots)
    twin.touch(keys(16)[0::2])
    twin.touch(keys(slots)[16:])
    twin.assert_same(keys(slots))
    return twin


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize(("window", "want_runs"), [(1, 4), (2, 4), (4, 1), (1024, 1)])
def test_a_store_into_a_fragmented_arena_gets_fewer_runs(
    policy: str, window: int, want_runs: int
) -> None:
    twin = interleaved(window, policy)
    order = [twin.native.slot_of(k) for k in keys(16)[1::2] + keys(16)[0::2]]
    plan = twin.prepare_store(keys(4, 1000))
    assert runs(plan.slots) == want_runs
    assert set(plan.slots.tolist()) <= set(order[: 4 * window])  # from the window only
    assert order[0] in plan.slots  # the oldest always goes
    assert len(plan.evicted) == 4
    twin.assert_same(keys(256) + keys(4, 1000))
    twin.check_invariants()


def test_the_window_reaches_at_most_a_sixteenth_of_the_slots_past_the_exact_victims() -> None:
    """64 slots: a window of 1024 looks at 4 + 64 // 16 = 8 candidates, the odd slots 1-15."""
    twin = interleaved(1024, slots=64)
    plan = twin.prepare_store(keys(4, 1000))
    assert set(plan.slots.tolist()) <= {1, 3, 5, 7, 9, 11, 13, 15} and runs(plan.slots) == 4
    twin.check_invariants()


def test_choose_runs_takes_the_oldest_with_its_run() -> None:
    # runs (by slot): 1-3 (ages 0, 1, 2), 10-11 (ages 3, 4), 20 (age 5)
    slots = [1, 2, 3, 10, 11, 20]
    assert choose_runs(slots, 3) == [0, 1, 2]
    assert choose_runs(slots, 4) == [0, 1, 2, 3]  # then the oldest left, its run cut to 1
    assert choose_runs(slots, 5) == [0, 1, 2, 3, 4]
    # a run longer than needed gives its older end: ages by slot 1: 5, 2: 0, 3: 1, 4: 2
    assert choose_runs([2, 3, 4, 9, 8, 1], 2) == [0, 1]  # slots 2-3 (youngest 1) over 3-4 (2)
    assert choose_runs([4, 3, 2, 9, 8, 1], 2) == [0, 1]  # slots 3-4 (youngest 1) over 1-2 (5)


def test_every_candidate_a_run_of_one_is_the_exact_order() -> None:
    assert choose_runs([9, 3, 7, 1, 5], 2) == [0, 1]
    assert choose_runs([9, 3, 7, 1, 5], 3) == [0, 1, 2]


@pytest.mark.parametrize("seed", range(60))
def test_choose_runs_never_makes_more_runs_than_the_exact_order(seed: int) -> None:
    """The oldest candidate always goes; each run taken holds one of the exact order's victims,
    so the victims are in no more runs than the exact order's."""
    rng = random.Random(seed)
    slots = rng.sample(range(64), rng.randint(2, 40))
    want = rng.randint(1, len(slots) - 1)
    got = choose_runs(slots, want)
    assert len(got) == want and len(set(got)) == want and got == sorted(got)
    assert got[0] == 0
    assert runs([slots[i] for i in got]) <= runs(slots[:want])


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_native_and_model_agree_under_random_stores(policy: str, window: int) -> None:
    """Stores of 1-12 blocks into a 192-slot index, loads and touches between them: the native
    index and the model agree call by call (``TwinIndex``), blocks being read never evicted."""
    rng = random.Random(f"{policy}{window}")
    twin = TwinIndex(192, 64, policy, window)
    stored: list[bytes] = []
    for step in range(600):
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
    assert twin.native.stats.evictions > 1000
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
    assert OffloadConfig().eviction_window == 1
    for window in (1, 4, 16):
        local = build_local(layout, OffloadConfig(host_capacity_blocks=8, eviction_window=window))
        try:
            assert local.offloader.index.window == window
        finally:
            local.close()
