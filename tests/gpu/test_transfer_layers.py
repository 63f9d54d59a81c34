"""Per-layer load completion on the CUDA backends: ``wait_on(stream, layer=i)`` orders a stream
after layer i's bytes, for every model shape and engine layout. The native ``staged`` engine cuts a
load into layer slices (each with its event); ``dma`` and ``sm`` wait for the whole load.

The load is held back on the GPU (ordered after a sleeping stream) and its destination blocks are
poisoned first, so a layer event recorded too early shows as poisoned bytes read on the side
stream. Later layers may or may not be written when layer i is read; only layer i is checked.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvoffload.store.arena import HostArena
from kvoffload.transfer.cuda.chunks import first_slice_layers
from kvoffload.transfer.cuda.dma import DmaBackend
from kvoffload.transfer.cuda.sm import SmBackend
from kvoffload.transfer.cuda.staged import NativeStagedBackend
from kvoffload.transfer.cuda.staged_config import FIRST_SLICE_BYTES, StagedConfig
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.pinning import cuda_pin
from kvoffload.transfer.shapes import LAYOUTS, MODELS, engine_tensors
from kvoffload.transfer.spec import TransferSpec
from tests.gpu.test_engine_flags import fine

pytestmark = pytest.mark.gpu
POOL = 12
SLEEP_CYCLES = 100_000_000  # ~50 ms of GPU sleep: the load starts after every wait is enqueued

BACKENDS = {
    "staged": lambda kv, a: sliced(kv, a),
    # ramped slices: the first holds one layer where a layer is >= 64 KiB a block
    "staged-ramp": lambda kv, a: sliced(kv, a, first_slice_bytes=FIRST_SLICE_BYTES),
    # one layer per slice where possible, two DMA streams, tiny areas: many chunks per slice
    "staged-fine": lambda kv, a: NativeStagedBackend(kv, a, config=most_slices(fine(kv))),
    # coupled loads: each chunk's copy and scatter on its staging area's DMA stream
    "staged-coupled": lambda kv, a: sliced(kv, a, load_coupled=True),
    "staged-coupled-fine": lambda kv, a: NativeStagedBackend(
        kv, a, config=most_slices(fine(kv, coupled=True))
    ),
    "dma": lambda kv, a: DmaBackend(kv, a),
    "sm": lambda kv, a: SmBackend(kv, a),
}


def most_slices(config: StagedConfig) -> StagedConfig:
    """The most slices the byte rules allow, not the cheapest count."""
    return dataclasses.replace(config, plan_link_GBps=0.0)


def sliced(kv, arena, **fields):
    """The native core, slicing even these small test loads by layer (by default a load is cut
    into at most one slice per ``SLICE_TRANSFER_BYTES``, and where few blocks' wire time is below
    the enqueue cost of more slices, into fewer)."""
    config = StagedConfig(layer_slice_transfer_bytes=1, plan_link_GBps=0.0, **fields)
    return NativeStagedBackend(kv, arena, config=config)


def slices(pending) -> int:
    """How many layer slices (events) a load was cut into; 0 for a store or a whole-load wait."""
    owner = getattr(pending, "layer_slice", None)
    return 0 if owner is None else int(owner.max()) + 1


@pytest.fixture(scope="module", params=[(m, lay) for m in MODELS for lay in LAYOUTS], ids=str)
def engine(request):
    model, layout = request.param
    tensors, block_dim = engine_tensors(
        MODELS[model], layout, POOL, 16, lambda s: torch.zeros(s, dtype=torch.int16, device="cuda")
    )
    kv = KVLayout.from_tensors(tensors, block_size=16, block_dim=block_dim)
    arena = HostArena(POOL, kv.slot_bytes, pin=cuda_pin)
    arena.slots[:] = np.random.default_rng(5).integers(1, 256, arena.slots.shape, dtype=np.uint8)
    yield tensors, block_dim, kv, arena
    arena.close()


@pytest.mark.parametrize("name", list(BACKENDS))
def test_wait_on_a_layer_orders_the_stream_after_that_layer(engine, name):
    tensors, block_dim, kv, arena = engine
    group = kv.groups[0]
    backend = BACKENDS[name](kv, arena)
    try:
        dest, slots = [7, 2, 9, 4, 11], [3, 8, 0, 5, 10]
        index = torch.tensor(dest, device="cuda")
        for t in tensors:  # poison: -1 never occurs in the arena's bytes (1..255 each)
            t.index_fill_(block_dim, index, -1)
        late = torch.cuda.Stream()
        with torch.cuda.stream(late):
            torch.cuda._sleep(SLEEP_CYCLES)
        pending = backend.submit([TransferSpec.of("load", dest, slots)], order_after=late)
        side = torch.cuda.Stream()
        seen = []
        for layer in range(group.num_layers):
            pending.wait_on(side, layer=layer)
            with torch.cuda.stream(side):
                seen.append(tensors[layer].index_select(block_dim, index))  # layer i = tensor i
        side.synchronize()
        assert pending.wait(30) and pending.error() is None
        for layer, got in enumerate(seen):
            regions = group.layer_regions(layer)
            first, end = group.offsets[regions.start], group.offsets[regions.stop - 1]
            end += group.regions[regions.stop - 1].page_bytes  # a layer's regions are adjacent
            want = arena.slots[slots][:, first:end]
            got_bytes = got.movedim(block_dim, 0).contiguous().view(torch.uint8).cpu().numpy()
            assert np.array_equal(got_bytes.reshape(len(dest), -1), want), f"layer {layer}"
        if name in ("staged-fine", "staged-coupled-fine"):
            assert slices(pending) == group.num_layers  # a slice per layer
        if name == "staged-ramp" and slices(pending) > 1:
            pages = [r.page_bytes for r in group.regions]
            first = first_slice_layers(pages, group.layer_starts, FIRST_SLICE_BYTES)
            assert (pending.layer_slice[:first] == 0).all()
            assert (pending.layer_slice[first:] > 0).all()
    finally:
        backend.close()


@pytest.mark.parametrize(("direction", "events"), [("load", 1), ("store", 0)])
def test_small_loads_and_stores_are_one_piece_and_a_layer_wait_waits_for_all(
    engine, direction, events
):
    """2 blocks are far below ``SLICE_TRANSFER_BYTES``: the native core's load is one slice; a
    store has no layer events. Either way a wait for the last layer is a wait for the whole
    copy."""
    _tensors, _block_dim, kv, arena = engine
    backend = NativeStagedBackend(kv, arena)
    try:
        pending = backend.submit([TransferSpec.of(direction, [1, 2], [1, 2])])
        assert slices(pending) == events
        side = torch.cuda.Stream()
        pending.wait_on(side, layer=kv.groups[0].num_layers - 1)
        side.synchronize()
        assert pending.wait(5) and pending.error() is None
    finally:
        backend.close()
