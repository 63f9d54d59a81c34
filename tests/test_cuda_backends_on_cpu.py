"""The ``dma`` and ``sm`` backends' host logic on CPU (``tests/fake_cuda.py``): descriptor tables,
kernel arguments, ordering and failures, with real bytes checked against the host backend. The
native ``staged`` core's are in tests/test_native_engine.py (it reuses ``Pair`` from here).

Each operation runs when it is enqueued, so these tests cannot see GPU-side races (the GPU tests
under tests/gpu do); they do see every address and size the host computes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvoffload.store.arena import HostArena
from kvoffload.transfer.host import HostBackend
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.shapes import MODELS, engine_tensors
from kvoffload.transfer.spec import TransferSpec
from tests.fake_cuda import Calls, cuda_layout, fake_cuda, no_pin

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
    from kvoffload.transfer.cuda.dma import DmaBackend
    from kvoffload.transfer.cuda.sm import SmBackend

    backends = {
        "dma": lambda: DmaBackend(kv, arena),
        "dma-one-per-piece": lambda: DmaBackend(kv, arena, merge=False),
        "sm": lambda: SmBackend(kv, arena),
    }
    return backends[name]()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", SHAPES)
@pytest.mark.parametrize("name", ["dma", "dma-one-per-piece", "sm"])
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


@pytest.mark.parametrize("name", ["dma", "sm"])
def test_a_mixed_submit_moves_both_directions_and_ends_after_both(fake_cuda: Calls, name):
    pair = Pair("llama3-8b", "page")
    backend = make(name, pair.kv, pair.arena)
    try:
        specs = [
            TransferSpec.of("load", [3, 5], [10, 11]),
            TransferSpec.of("store", [1, 2, 4], [0, 1, 2]),
        ]
        start = len(fake_cuda.log)
        pending = backend.submit(specs)
        assert pending.wait(10) and pending.error() is None
        pair.oracle.copy(specs)
        pair.check()
        store, load = (int(backend.streams[d].cuda_stream) for d in ("store", "load"))
        done = pending.event  # recorded on the store stream, waited on by the load stream, last
        assert fake_cuda.log[-3:] == [
            ("record", store, done),
            ("wait", load, done),
            ("record", load, done),
        ]
        # the caller's stream (7: fake_cuda's current stream) is recorded first; both wait for it
        order = fake_cuda.log[start]
        assert order[:2] == ("record", 7)
        assert ("wait", store, order[2]) in fake_cuda.log[start:]
        assert ("wait", load, order[2]) in fake_cuda.log[start:]
    finally:
        backend.close()
        pair.close()


@pytest.mark.parametrize("name", ["dma", "sm"])
def test_a_refused_copy_is_the_transfers_error_and_wait_on_raises_it(fake_cuda: Calls, name):
    """The driver refuses the first copy (dma: the batch; sm: the id upload): ``submit`` returns a
    pending that is done with that error; ``wait_on`` (any layer) still orders the stream after
    what was enqueued and raises it; the next transfer runs."""
    pair = Pair("llama3-8b", "kv_split")
    backend = make(name, pair.kv, pair.arena)
    real = backend.driver.memcpy_batch if name == "dma" else backend.driver.memcpy

    def refuse(*args: Any) -> None:
        raise RuntimeError("copy refused")

    setattr(backend.driver, "memcpy_batch" if name == "dma" else "memcpy", refuse)
    try:
        load = [TransferSpec.of("load", [1, 2, 3], [4, 5, 6])]
        pending = backend.submit(load)
        assert pending.wait(10)
        assert isinstance(pending.error(), RuntimeError)
        for layer in (0, None):
            with pytest.raises(RuntimeError, match="copy refused"):
                pending.wait_on(99, layer=layer)
            assert fake_cuda.log[-1] == ("wait", 99, pending.event)
        pair.check()  # nothing moved
        setattr(backend.driver, "memcpy_batch" if name == "dma" else "memcpy", real)
        ok = backend.submit(load)
        assert ok.wait(10) and ok.error() is None
        pair.oracle.copy(load)
        pair.check()
    finally:
        backend.close()
        pair.close()


@pytest.mark.parametrize("name", ["dma", "sm"])
def test_a_layer_wait_is_a_wait_for_the_whole_transfer(fake_cuda: Calls, name):
    """No layer slices: every layer of a load orders the stream after the transfer's one event;
    a layer that is not an int >= 0 is refused."""
    pair = Pair("llama3-8b", "page")
    backend = make(name, pair.kv, pair.arena)
    try:
        load = [TransferSpec.of("load", [3, 5, 8], [1, 2, 0])]
        pending = backend.submit(load)
        for layer in (0, 31, None):
            pending.wait_on(98, layer=layer)
            assert fake_cuda.log[-1] == ("wait", 98, pending.event)
        for bad in (-1, 1.5, "0", True):
            with pytest.raises(ValueError, match="expected layer None or an int >= 0"):
                pending.wait_on(98, layer=bad)
        assert pending.wait(10) and pending.error() is None
        pair.oracle.copy(load)
        pair.check()
    finally:
        backend.close()
        pair.close()


def test_the_ids_a_kernel_reads_are_held_until_its_transfer_is_done(
    fake_cuda: Calls, monkeypatch: pytest.MonkeyPatch
):
    """``sm`` uploads block and slot ids for its kernel: the backend keeps them until the
    transfer's event has passed (checked at the next submit), then lets them go."""
    from kvoffload.transfer.cuda import driver

    pair = Pair("llama3-8b", "page")
    backend = make("sm", pair.kv, pair.arena)
    passed: set[int] = set()
    monkeypatch.setattr(driver, "event_done", lambda event: event in passed)
    try:
        first = backend.submit([TransferSpec.of("store", [1, 2], [3, 4])])
        assert list(backend._held) == [first] and first.keep
        second = backend.submit([TransferSpec.of("store", [5], [6])])
        assert list(backend._held) == [first, second]  # the first event has not passed
        passed.add(first.event)
        third = backend.submit([TransferSpec.of("store", [7], [8])])
        assert list(backend._held) == [second, third]
        passed.update((second.event, third.event))
        for p in (first, second, third):
            assert p.wait(10) and p.error() is None
        for s in ([1, 2], [3, 4]), ([5], [6]), ([7], [8]):
            pair.oracle.copy([TransferSpec.of("store", *s)])
        pair.check()
    finally:
        backend.close()
        assert not backend._held
        pair.close()


def test_a_bad_order_after_is_refused_before_anything_is_enqueued(fake_cuda: Calls):
    pair = Pair("llama3-8b", "page")
    backend = make("dma", pair.kv, pair.arena)
    try:
        before = len(fake_cuda.log)
        with pytest.raises(ValueError, match="expected order_after to be 'current', None"):
            backend.submit([TransferSpec.of("store", [1], [1])], order_after="soon")
        assert len(fake_cuda.log) == before
        pair.check()
        store = [TransferSpec.of("store", [1], [1])]
        assert backend.submit(store, order_after=None).wait(10)  # ordered after nothing
        assert not any(e[0] == "wait" for e in fake_cuda.log[before:])
        pair.oracle.copy(store)
        pair.check()
    finally:
        backend.close()
        pair.close()


def test_a_closed_backend_refuses_submits(fake_cuda: Calls):
    pair = Pair("llama3-8b", "page")
    backend = make("dma", pair.kv, pair.arena)
    backend.close()
    try:
        with pytest.raises(ValueError, match="expected an open dma backend, got a closed one"):
            backend.submit([TransferSpec.of("store", [1], [1])])
        backend.close()  # twice: nothing left to do
    finally:
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


def test_a_background_step_reaches_the_backend_only_when_asked():
    """``step(background=True)`` passes ``background=True`` to ``submit_checked``; a plain step
    passes no keyword, so a backend written before the option keeps working."""
    import kvoffload as kvo
    from kvoffload.offload import TransferWorker

    seen: list[dict[str, Any]] = []

    class Recording(HostBackend):
        def submit_checked(self, specs: Any, **kw: Any) -> Any:
            seen.append(kw)
            return super().submit_checked(specs, **kw)

    kv = [np.random.default_rng(2).integers(0, 256, (8, 16, 64), dtype=np.uint8)]
    layout = KVLayout.from_tensors(kv, block_size=16)
    local = kvo.build_local(layout, kvo.OffloadConfig(host_capacity_blocks=4))
    worker = TransferWorker(Recording(layout, local.arena), local.offloader)
    try:
        keys = kvo.prefix_block_keys(np.arange(32), 16)
        for key, block, background in ((keys[0], 1, False), (keys[1], 2, True)):
            job = local.offloader.schedule_store("r", [key], [block])
            assert job is not None
            worker.step([job], background=background)
            assert worker.wait([job.job_id], 30) == set()
            local.offloader.complete(worker.get_finished())
            slot = job.specs[0].slots[0]
            assert np.array_equal(local.arena.slots[slot, :1024], kv[0][block].ravel())
        assert seen == [{}, {"background": True}]
    finally:
        worker.close()
        local.close()


def test_a_worker_hands_its_offloaders_jobs_to_submit_checked():
    """A worker is built only with an Offloader that checks block ids against the same layout
    (and owns no more slots than the arena), so it always skips the backend's full validation;
    the bytes still move."""
    import kvoffload as kvo
    from kvoffload.offload import Offloader, TransferWorker

    class Counting(HostBackend):
        checked = 0

        def submit_checked(self, specs: Any, **kw: Any) -> Any:
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
