"""The CUDA backends' host logic on CPU (``tests/fake_cuda.py``): chunking, staging offsets,
descriptor tables, layer slices and submission, with real bytes checked against the host backend.

Each operation runs when it is enqueued, so these tests cannot see GPU-side races (the GPU tests
under tests/gpu do); they do see every address and size the host computes.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from kvoffload.store.arena import HostArena
from kvoffload.transfer.host import HostBackend
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.shapes import MODELS, engine_tensors
from kvoffload.transfer.spec import TransferSpec
from tests.fake_cuda import Calls, cuda_layout, fake_cuda, no_pin
from tests.transfer_support import HeldAfterFirstSlice

__all__ = ["fake_cuda"]  # the fixture, used by name

POOL = 24
SLOT_PAD = 4096
LAYOUTS = ("kv_split", "page", "cross_layer")
SHAPES = ("llama3-8b", "llama3-70b-tp8-fp8", "deepseek-v2-lite-mla")


class Pair:
    """One engine twice (the "GPU" one, driven by the backend under test, and the oracle's), and
    one arena twice, all in CPU memory."""

    def __init__(self, model: str, layout: str) -> None:
        rng = np.random.default_rng(len(model) * 7 + len(layout))

        def fill(shape: tuple[int, ...]) -> np.ndarray:
            return rng.integers(0, 1 << 16, shape, dtype=np.uint16)

        self.mine, block_dim = engine_tensors(MODELS[model], layout, POOL, 16, fill)
        self.theirs = [t.copy() for t in self.mine]
        kv = KVLayout.from_tensors(self.mine, block_size=16, block_dim=block_dim)
        self.kv = cuda_layout(kv)
        self.kv_oracle = KVLayout.from_tensors(self.theirs, block_size=16, block_dim=block_dim)
        slot = kv.slot_bytes + SLOT_PAD
        self.arena = HostArena(POOL, slot, pin=no_pin)
        self.arena_oracle = HostArena(POOL, slot)
        noise = rng.integers(0, 256, (POOL, slot), dtype=np.uint8)
        self.arena.slots[:] = noise
        self.arena_oracle.slots[:] = noise
        self.oracle = HostBackend(self.kv_oracle, self.arena_oracle)

    def check(self) -> None:
        assert np.array_equal(self.arena.slots, self.arena_oracle.slots), "host slots differ"
        for i, (a, b) in enumerate(zip(self.mine, self.theirs, strict=True)):
            assert np.array_equal(a, b), f"engine tensor {i} differs"

    def close(self) -> None:
        self.oracle.close()
        self.arena.close()
        self.arena_oracle.close()


def make(name: str, kv: KVLayout, arena: HostArena) -> Any:
    from kvoffload.transfer.cuda.base import FIRST_SLICE_BYTES
    from kvoffload.transfer.cuda.dma import DmaBackend
    from kvoffload.transfer.cuda.sm import SmBackend
    from kvoffload.transfer.cuda.staged import StagedBackend, StagedConfig

    fine = StagedConfig(
        staging_bytes=4 * kv.slot_bytes,
        depth=2,
        first_chunk_bytes=1,
        dma_streams=2,
        layer_slice_bytes=8,
        max_layer_slices=1024,
        layer_slice_transfer_bytes=1,
    )
    backends = {
        "staged": lambda: StagedBackend(kv, arena),
        "staged-sync": lambda: StagedBackend(kv, arena, submit_thread=False),
        "staged-fine": lambda: StagedBackend(kv, arena, config=fine),
        "staged-ramp": lambda: StagedBackend(
            kv, arena, config=StagedConfig(first_slice_bytes=FIRST_SLICE_BYTES)
        ),
        "dma": lambda: DmaBackend(kv, arena),
        "dma-one-per-piece": lambda: DmaBackend(kv, arena, merge=False),
        "sm": lambda: SmBackend(kv, arena),
    }
    backend = backends[name]()
    backend.min_slice_transfer_bytes = 1  # slice even these small loads by layer
    return backend


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", SHAPES)
@pytest.mark.parametrize(
    "name",
    ["staged", "staged-sync", "staged-fine", "staged-ramp", "dma", "dma-one-per-piece", "sm"],
)
def test_store_then_load_moves_the_oracles_bytes(fake_cuda: Calls, model, layout, name):
    pair = Pair(model, layout)
    backend = make(name, pair.kv, pair.arena)
    rng = np.random.default_rng(3)
    try:
        for count in (13, 1, 7, 0):
            blocks = rng.choice(POOL, count, replace=False)
            slots = rng.choice(POOL, count, replace=False)
            store = [TransferSpec.of("store", blocks, slots)]
            pending = backend.submit(store)
            assert pending.wait(10) and pending.error() is None
            pair.oracle.copy(store)
            pair.check()
            dest = rng.choice(POOL, count, replace=False)
            load = [TransferSpec.of("load", dest, rng.permutation(slots))]
            pending = backend.submit(load)
            assert pending.wait(10) and pending.error() is None
            pair.oracle.copy(load)
            pair.check()
    finally:
        backend.close()
        pair.close()


def test_a_mixed_submit_moves_both_directions(fake_cuda: Calls):
    pair = Pair("llama3-8b", "page")
    backend = make("staged", pair.kv, pair.arena)
    try:
        specs = [
            TransferSpec.of("load", [3, 5], [10, 11]),
            TransferSpec.of("store", [1, 2, 4], [0, 1, 2]),
        ]
        pending = backend.submit(specs)
        assert pending.wait(10) and pending.error() is None
        pair.oracle.copy(specs)
        pair.check()
    finally:
        backend.close()
        pair.close()


def test_a_failed_enqueue_is_the_transfers_error_and_layer_waits_raise_it(fake_cuda: Calls):
    pair = Pair("llama3-8b", "kv_split")
    backend = make("staged", pair.kv, pair.arena)
    broken = threading.Event()

    def refuse(table: np.ndarray, stream: int) -> None:
        broken.set()
        raise RuntimeError("copy refused")

    backend.driver.memcpy_batch = refuse
    try:
        pending = backend.submit([TransferSpec.of("load", [1, 2, 3], [4, 5, 6])])
        assert pending.wait(10)
        assert isinstance(pending.error(), RuntimeError)
        with pytest.raises(RuntimeError, match="copy refused"):
            pending.wait_on(None, layer=0)
        assert broken.is_set()
    finally:
        backend.close()
        pair.close()


def test_a_layer_wait_waits_on_the_host_only_for_its_slice(fake_cuda: Calls):
    """The lane thread is held before slice 1 of a load: a wait for layer 0 returns at once and
    makes the stream wait on slice 0's event; a wait for the last layer returns only once the
    thread goes on, and waits on the last slice's event."""
    pair = Pair("llama3-8b", "page")
    backend = make("staged", pair.kv, pair.arena)
    load = [TransferSpec.of("load", [3, 5, 8], [1, 2, 0])]
    hold = HeldAfterFirstSlice(backend, load, timeout=10)
    go = hold.go
    try:
        pending = backend.submit(load)
        assert hold.held.wait(10)
        events = pending.layer_events
        assert len(events) == 16  # 32 layers, 2 MiB slots: 16 slices of 128 KiB
        pending.wait_on(99, layer=0)
        assert fake_cuda.log[-1] == ("wait", 99, events[0])
        assert not pending.done()
        waited = threading.Event()

        def wait_last() -> None:
            pending.wait_on(98, layer=31)
            waited.set()

        waiter = threading.Thread(target=wait_last)
        waiter.start()
        assert not waited.wait(0.2)  # slice 9 is not recorded yet
        go.set()
        waiter.join(10)
        assert waited.is_set()
        assert ("wait", 98, events[-1]) in fake_cuda.log
        assert pending.wait(10) and pending.error() is None
        pair.oracle.copy(load)
        pair.check()
    finally:
        go.set()
        backend.close()
        pair.close()


def test_submit_checked_checks_ranges_only_and_refuses_before_any_copy(fake_cuda: Calls):
    pair = Pair("llama3-8b", "kv_split")
    backend = make("dma", pair.kv, pair.arena)
    try:
        for bad, match in (
            (TransferSpec.of("load", [1, POOL], [0, 1]), r"engine block id in \[0, 24\), got 24"),
            (TransferSpec.of("store", [1, 2], [-1, 1]), r"host slot in \[0, 24\), got -1"),
            (TransferSpec.of("store", [1, 2], [0]), "as many host slots"),
            (TransferSpec("load", np.array([1]), np.array([1]), 1), r"group in \[0, 1\)"),
        ):
            with pytest.raises(ValueError, match=match):
                backend.submit_checked([bad])
        assert fake_cuda.descriptors == 0
        # distinctness is the caller's: submit refuses a load into one block twice ...
        twice = [TransferSpec.of("load", [4, 4], [0, 1])]
        with pytest.raises(ValueError, match="duplicates"):
            backend.submit(twice)
        # ... and submit_checked moves well-formed transfers like submit
        store = [TransferSpec.of("store", [1, 2, 3], [5, 6, 7])]
        assert backend.submit_checked(store).wait(10)
        pair.oracle.copy(store)
        pair.check()
    finally:
        backend.close()
        pair.close()


def test_a_worker_hands_its_offloaders_jobs_to_submit_checked():
    """A worker is built only with an Offloader that checks block ids against the same layout
    (and owns no more slots than the arena), so it always skips the backend's full validation;
    the bytes still move."""
    import kvoffload as kvo
    from kvoffload.offload import Offloader, TransferWorker

    class Counting(HostBackend):
        checked = 0

        def submit_checked(self, specs: Any) -> Any:
            Counting.checked += 1
            return super().submit_checked(specs)

    kv = [np.random.default_rng(1).integers(0, 256, (8, 16, 64), dtype=np.uint8)]
    layout = KVLayout.from_tensors(kv, block_size=16)
    config = kvo.OffloadConfig(host_capacity_blocks=4)
    local = kvo.build_local(layout, config)
    worker = TransferWorker(Counting(layout, local.arena), local.offloader)
    unchecked = Offloader(config, layout.slot_bytes)  # no engine_blocks: only ">= 0" checked
    try:
        (key,) = kvo.prefix_block_keys(np.arange(16), 16)
        job = local.offloader.schedule_store("r", [key], [5])
        assert job is not None
        worker.submit(job)
        assert worker.wait([job.job_id], 30) == set()
        local.offloader.complete(worker.get_finished())
        assert Counting.checked == 1
        assert np.array_equal(local.arena.slots[job.specs[0].slots[0], :1024], kv[0][5].ravel())
        backend = Counting(layout, local.arena)
        with pytest.raises(ValueError, match="built for this backend's layout"):
            TransferWorker(backend, unchecked)
        backend.close()
    finally:
        worker.close()
        local.close()
