"""Ordering and completion of the CUDA backends: stores after compute, loads before attention,
bounded waits, the legacy-stream refusal, mixed submits."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvoffload.store.arena import HostArena
from kvoffload.transfer.cuda.dma import DmaBackend
from kvoffload.transfer.cuda.driver import CudaDriver
from kvoffload.transfer.cuda.engine import NativeStagedBackend
from kvoffload.transfer.cuda.sm import SmBackend
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.pinning import cuda_pin
from kvoffload.transfer.shapes import MODELS, engine_tensors
from kvoffload.transfer.spec import TransferSpec

POOL = 24
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU sleep on a ~2 GHz part

FACTORIES = {"dma": DmaBackend, "sm": SmBackend, "staged": NativeStagedBackend}


@pytest.fixture(scope="module")
def engine():
    tensors, block_dim = engine_tensors(
        MODELS["llama3-8b"], "page", POOL, 16, lambda s: torch.randn(s, device="cuda").bfloat16()
    )
    kv = KVLayout.from_tensors(tensors, block_size=16, block_dim=block_dim)
    arena = HostArena(POOL, kv.slot_bytes, pin=cuda_pin)
    yield tensors, kv, arena
    arena.close()


def slot_of(tensors, block):
    return torch.cat([t[block].reshape(-1).view(torch.uint8) for t in tensors]).cpu().numpy()


@pytest.mark.parametrize("name", list(FACTORIES))
def test_store_waits_for_the_compute_that_wrote_the_blocks(engine, name):
    tensors, kv, arena = engine
    backend = FACTORIES[name](kv, arena)
    try:
        compute = torch.cuda.Stream()
        new = [torch.randn_like(t[3], dtype=torch.float32).bfloat16() for t in tensors]
        with torch.cuda.stream(compute):
            torch.cuda._sleep(SLEEP_CYCLES)  # the "model" is still busy ...
            for t, v in zip(tensors, new, strict=True):
                t[3].copy_(v)  # ... when it writes block 3
            pending = backend.submit([TransferSpec.of("store", [3], [5])])  # no host sync
        assert pending.wait(30)
        expected = torch.cat([v.reshape(-1).view(torch.uint8) for v in new]).cpu().numpy()
        assert np.array_equal(arena.slots[5, : kv.slot_bytes], expected)
    finally:
        backend.close()


@pytest.mark.parametrize("name", list(FACTORIES))
def test_load_then_wait_on_orders_the_engine_stream(engine, name):
    tensors, kv, arena = engine
    backend = FACTORIES[name](kv, arena)
    try:
        arena.slots[7] = np.random.default_rng(3).integers(0, 256, arena.slot_bytes, np.uint8)
        late = torch.cuda.Stream()
        with torch.cuda.stream(late):
            torch.cuda._sleep(SLEEP_CYCLES)  # holds the load back ~0.1 s
        pending = backend.submit([TransferSpec.of("load", [9], [7])], order_after=late)
        engine_stream = torch.cuda.Stream()
        pending.wait_on(engine_stream)
        with torch.cuda.stream(engine_stream):
            seen = [t[9].clone() for t in tensors]  # "attention" reads the loaded block
        engine_stream.synchronize()
        got = torch.cat([s.reshape(-1).view(torch.uint8) for s in seen]).cpu().numpy()
        assert np.array_equal(got, arena.slots[7, : kv.slot_bytes])
    finally:
        backend.close()


def test_wait_is_bounded_and_done_is_honest(engine):
    _tensors, kv, arena = engine
    backend = NativeStagedBackend(kv, arena)
    try:
        late = torch.cuda.Stream()
        with torch.cuda.stream(late):
            torch.cuda._sleep(4 * SLEEP_CYCLES)
        pending = backend.submit([TransferSpec.of("store", [1, 2], [1, 2])], order_after=late)
        t0 = time.perf_counter()
        assert pending.wait(0.02) is False
        assert time.perf_counter() - t0 < 0.2
        assert not pending.done()
        assert pending.wait(30)
        assert pending.done() and pending.error() is None
    finally:
        backend.close()


def test_mixed_submit_moves_both_directions(engine):
    tensors, kv, arena = engine
    backend = NativeStagedBackend(kv, arena)
    try:
        arena.slots[11] = np.random.default_rng(5).integers(0, 256, arena.slot_bytes, np.uint8)
        want_slot = slot_of(tensors, 4)
        want_block = arena.slots[11, : kv.slot_bytes].copy()
        pending = backend.submit(
            [TransferSpec.of("store", [4], [12]), TransferSpec.of("load", [6], [11])]
        )
        assert pending.wait(30) and pending.error() is None
        assert np.array_equal(arena.slots[12, : kv.slot_bytes], want_slot)
        assert np.array_equal(slot_of(tensors, 6), want_block)
    finally:
        backend.close()


@pytest.mark.parametrize("use_batch", [True, False])
def test_legacy_null_stream_is_refused(use_batch):
    driver = CudaDriver.load(use_batch=use_batch)
    src = torch.empty(64, dtype=torch.uint8, device="cuda")
    dst = torch.empty(64, dtype=torch.uint8, device="cuda")
    table = np.array([[src.data_ptr()], [dst.data_ptr()], [64]], dtype=np.int64)
    for handle in (0, 1):
        with pytest.raises(ValueError, match="legacy default"):
            driver.memcpy_batch(table, handle)


def test_batch_entry_point_resolves_on_a_12_8_driver():
    driver = CudaDriver.load()
    if driver.version < 12080:
        pytest.skip(f"driver {driver.version} predates cuMemcpyBatchAsync")
    assert driver.batch is not None


def test_bad_input_raises_value_error_before_any_copy(engine):
    _tensors, kv, arena = engine
    backend = DmaBackend(kv, arena)
    try:
        with pytest.raises(ValueError, match="host slot"):
            backend.submit([TransferSpec.of("store", [0], [POOL])])
        with pytest.raises(ValueError, match="order_after"):
            backend.submit([TransferSpec.of("store", [0], [0])], order_after="soon")
    finally:
        backend.close()


@pytest.mark.parametrize("name", list(FACTORIES))
def test_empty_transfers_complete_and_touch_nothing(engine, name):
    _tensors, kv, arena = engine
    backend = FACTORIES[name](kv, arena)
    try:
        before = arena.slots.copy()
        for specs in ([], [TransferSpec.of("store", [], [])], [TransferSpec.of("load", [], [])]):
            pending = backend.submit(specs)
            assert pending.wait(30) and pending.error() is None
        assert np.array_equal(arena.slots, before)
    finally:
        backend.close()


def test_calibrate_writes_a_table_the_auto_backend_uses(engine, tmp_path, monkeypatch):
    import argparse

    from kvoffload.calibrate import measure
    from kvoffload.transfer.calibration import load_cached, save
    from kvoffload.transfer.registry import make_backend

    monkeypatch.setenv("KVOFFLOAD_CACHE_DIR", str(tmp_path))
    args = argparse.Namespace(
        pieces=[4096, 1 << 20], blocks=[4], methods=["staged", "dma"], reps=1, out=None
    )
    table = measure(args)
    assert len(table.entries) == 2 * 2 * 3  # pieces x methods x (store, load, both)
    assert all(e.gbps > 0 for e in table.entries)
    save(table)
    cached = load_cached(table.device, table.driver)
    assert cached is not None and cached.entries == table.entries
    tensors, kv, arena = engine
    auto = make_backend("auto", kv, arena)
    try:
        assert auto.planner.table.entries == table.entries  # type: ignore[attr-defined]
        assert auto.submit([TransferSpec.of("store", [2], [3])]).wait(30)
        assert np.array_equal(arena.slots[3, : kv.slot_bytes], slot_of(tensors, 2))
        assert set(auto.backends) <= {"staged", "dma"}  # type: ignore[attr-defined]
    finally:
        auto.close()
