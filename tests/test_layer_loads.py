"""Per-layer load completion: layers as the layout counts them, and ``wait_on(layer=i)`` returning
once layer i's bytes are in place (on the host backend, while later layers are still held back)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvoffload as kvo
from kvoffload.store.arena import HostArena
from kvoffload.transfer.host import HostBackend
from kvoffload.transfer.layout import LayerGroup, Region
from kvoffload.transfer.spec import TransferSpec

LAYERS, BLOCKS, BS = 4, 6, 16


def kv_split_tensors() -> list[np.ndarray]:
    """Per layer one [2, blocks, bs, 2 heads, 8] uint8 array of random bytes."""
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, (2, BLOCKS, BS, 2, 8), dtype=np.uint8) for _ in range(LAYERS)]


def test_each_tensor_is_a_layer():
    split = KVLayoutOf(kv_split_tensors(), block_dim=1)
    assert split.groups[0].layer_starts == (0, 2, 4, 6)
    assert split.groups[0].num_layers == LAYERS
    assert list(split.groups[0].layer_regions(2)) == [4, 5]
    pages = KVLayoutOf([t[0] for t in kv_split_tensors()], block_dim=0)
    assert pages.groups[0].layer_starts == (0, 1, 2, 3)
    cross = KVLayoutOf([np.zeros((BLOCKS, LAYERS, 2, BS, 16), dtype=np.uint8)], block_dim=0)
    assert cross.groups[0].num_layers == 1  # one region holds every layer: one "layer"
    with pytest.raises(ValueError, match=r"expected a layer in \[0, 4\)"):
        split.groups[0].layer_regions(4)
    with pytest.raises(ValueError, match=r"expected a layer in \[0, 4\)"):
        split.groups[0].layer_regions(True)


def test_layer_starts_are_checked():
    region = Region(4096, 64, 64, 4)
    assert LayerGroup((region,) * 3).num_layers == 3  # default: a region per layer
    for bad in ((1,), (0, 0), (0, 3), (0, 2, 1)):
        with pytest.raises(ValueError, match="expected layer_starts ascending from 0"):
            LayerGroup((region,) * 3, layer_starts=bad)


class HeldAtLayer(HostBackend):
    """Copies really move bytes, but stop before the first region of ``hold`` until released."""

    hold = 1

    def __init__(self, layout: kvo.KVLayout, arena: HostArena) -> None:
        super().__init__(layout, arena)
        self.reached = threading.Event()
        self.release = threading.Event()

    def _copy_region(self, spec: TransferSpec, r: int) -> None:
        if r == self.layout.groups[spec.group].layer_starts[self.hold]:
            self.reached.set()
            assert self.release.wait(30)
        super()._copy_region(spec, r)


def KVLayoutOf(tensors: list[np.ndarray], block_dim: int) -> kvo.KVLayout:
    return kvo.KVLayout.from_tensors(tensors, block_size=BS, block_dim=block_dim)


def held_setup() -> tuple[list[np.ndarray], kvo.LocalOffload, HeldAtLayer, kvo.TransferWorker]:
    """KV tensors, a local offload, and a second worker on ``HeldAtLayer`` over the same store,
    once blocks 0-2 are stored (under ``stored_keys()``) through the local worker."""
    tensors = kv_split_tensors()
    local = kvo.build_local(KVLayoutOf(tensors, 1), kvo.OffloadConfig(host_capacity_blocks=8))
    off = local.offloader
    held = HeldAtLayer(local.worker.backend.layout, local.arena)
    worker = kvo.TransferWorker(held, off)
    store = off.schedule_store("a", stored_keys(), [0, 1, 2])
    assert store is not None
    local.worker.submit(store)
    assert not local.worker.wait([store.job_id], 30)
    off.complete(local.worker.get_finished())
    return tensors, local, held, worker


def stored_keys() -> list[bytes]:
    return kvo.prefix_block_keys(np.arange(3 * BS), BS)


def test_wait_on_a_layer_returns_once_that_layer_has_arrived():
    tensors, local, held, worker = held_setup()
    off = local.offloader
    keys = stored_keys()
    try:
        before = [t.copy() for t in tensors]
        dst = [5, 4, 3]
        load = off.schedule_load("b", keys, dst)
        worker.submit(load)
        assert held.reached.wait(30)  # layer 0 copied, layer 1 held back
        worker.wait_on(load.job_id, layer=0)  # returns: layer 0 is there
        layer_waiter = worker.layer_waiter(load.job_id)
        layer_waiter(0)  # so does the bound waiter
        for bad in (LAYERS, -1, True, np.int64(0)):
            with pytest.raises(ValueError, match=r"expected a layer in \[0, 4\)"):
                layer_waiter(bad)
        assert np.array_equal(tensors[0][:, dst], before[0][:, [0, 1, 2]])
        for later in range(1, LAYERS):  # not written yet: still the old bytes
            assert np.array_equal(tensors[later][:, dst], before[later][:, dst])
        with pytest.raises(ValueError, match=r"expected a layer in \[0, 4\)"):
            worker.wait_on(load.job_id, layer=LAYERS)
        waited = threading.Event()

        def wait_last() -> None:
            layer_waiter(LAYERS - 1)
            worker.wait_on(load.job_id, layer=LAYERS - 1)
            waited.set()

        waiter = threading.Thread(target=wait_last)
        waiter.start()
        assert not waited.wait(0.2)  # the last layer waits for the held copy
        held.release.set()
        waiter.join(30)
        assert waited.is_set()
        for layer in range(LAYERS):
            assert np.array_equal(tensors[layer][:, dst], before[layer][:, [0, 1, 2]])
        assert not worker.wait([load.job_id], 30)
        off.complete(worker.get_finished())
        assert off.is_settled("b")
    finally:
        held.release.set()
        worker.close()
        local.close()


class FailsAtLayer(HostBackend):
    def _copy_region(self, spec: TransferSpec, r: int) -> None:
        if r == self.layout.groups[spec.group].layer_starts[2]:
            raise OSError("injected copy failure at layer 2")
        super()._copy_region(spec, r)


def test_a_failed_copy_fails_the_layers_it_did_not_copy():
    tensors = kv_split_tensors()  # alive while the backend copies into them
    layout = KVLayoutOf(tensors, 1)
    backend = FailsAtLayer(layout, HostArena(BLOCKS, layout.slot_bytes))
    try:
        pending = backend.submit([TransferSpec.of("load", [0, 1], [0, 1])])
        pending.wait_on(layer=1)  # copied before the failure
        with pytest.raises(OSError, match="injected copy failure"):
            pending.wait_on(layer=2)
        with pytest.raises(OSError, match="injected copy failure"):
            pending.wait_on(layer=3)
        with pytest.raises(OSError, match="injected copy failure"):
            pending.wait_on()
        wait = pending.layer_waiter(None, LAYERS)  # bound: the same answers
        wait(1)
        for failed in (2, 3):
            with pytest.raises(OSError, match="injected copy failure"):
                wait(failed)
        with pytest.raises(ValueError, match=r"expected a layer in \[0, 4\), got 4"):
            wait(LAYERS)
    finally:
        backend.close()
