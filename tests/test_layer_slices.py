"""The layer-slice schedules the native engine is given (which regions each slice moves, which
slice holds each layer), and per-slice descriptors, on CPU with real bytes."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

from kvoffload.transfer.cuda.chunks import (
    bound_owner,
    bound_regions,
    first_slice_layers,
    load_schedules,
    slice_bounds,
    slice_count,
)
from kvoffload.transfer.descriptors import build_descriptors
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.shapes import LAYOUTS, MODELS, engine_tensors
from kvoffload.transfer.spec import TransferSpec


def layer_slices(layer_starts: tuple[int, ...], n_regions: int, slices: int) -> list[range]:
    """Each of ``slices`` near-equal runs of layers, as its regions."""
    layers = len(layer_starts) or n_regions
    return bound_regions(layer_starts, n_regions, slice_bounds(layers, slices))


def slice_of_layer(layer_starts: tuple[int, ...], n_regions: int, slices: int) -> np.ndarray:
    return bound_owner(slice_bounds(len(layer_starts) or n_regions, slices))


@pytest.mark.parametrize(("layers", "slices"), [(32, 1), (32, 8), (28, 8), (5, 5), (80, 3)])
def test_slices_cover_every_layer_once_in_order(layers, slices):
    starts = tuple(2 * i for i in range(layers))  # K and V per layer
    parts = layer_slices(starts, 2 * layers, slices)
    assert len(parts) == slices
    assert [r for p in parts for r in p] == list(range(2 * layers))  # all regions, in order
    sizes = [len(p) // 2 for p in parts]
    assert max(sizes) - min(sizes) <= 1  # near-equal runs of whole layers
    assert all(p.start % 2 == 0 for p in parts)  # never splits a layer's K from its V
    owner = slice_of_layer(starts, 2 * layers, slices)
    for layer in range(layers):
        assert 2 * layer in parts[int(owner[layer])]


def test_default_layer_starts_are_one_region_per_layer():
    assert layer_slices((), 6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert slice_of_layer((), 6, 3).tolist() == [0, 0, 1, 1, 2, 2]


def test_bad_slice_counts_raise_value_error():
    with pytest.raises(ValueError, match=r"expected 1 <= slices <= 4"):
        layer_slices((0, 1, 2, 3), 4, 5)
    with pytest.raises(ValueError, match=r"expected 1 <= slices <= 4"):
        layer_slices((0, 1, 2, 3), 4, 0)
    with pytest.raises(ValueError, match="min_slice_bytes"):
        slice_count(1 << 20, 4, 0, 8)


def test_slice_count_keeps_descriptors_large():
    assert slice_count(2 << 20, 32, 1 << 20, 8) == 2  # 2 MiB slots: two 1 MiB slices
    assert slice_count(2 << 20, 32, 256 << 10, 8) == 8
    assert slice_count(320 << 10, 80, 1 << 20, 8) == 1  # small slots: one slice (whole load)
    assert slice_count(6 << 20, 3, 1 << 20, 8) == 3  # never more slices than layers


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_slice_descriptors_together_move_a_whole_load(layout):
    """Per-slice descriptors (as the dma backend sends them, one batch per slice) copy exactly the
    bytes of the whole-slot descriptors."""
    pool = 6
    rng = np.random.default_rng(1)
    tensors, block_dim = engine_tensors(
        MODELS["qwen2.5-7b"], layout, pool, 16, lambda s: np.zeros(s, dtype=np.uint16)
    )
    kv = KVLayout.from_tensors(tensors, block_size=16, block_dim=block_dim)
    group = kv.groups[0]
    host = rng.integers(0, 256, (pool, group.slot_bytes), dtype=np.uint8)
    spec = TransferSpec.of("load", [4, 0, 2], [1, 5, 3])
    parts = layer_slices(group.layer_starts, len(group.regions), min(3, group.num_layers))
    for part in parts:
        table = build_descriptors(spec, group, host.ctypes.data, group.slot_bytes, regions=part)
        assert table.shape[1] == 3 * len(part)
        for src, dst, size in table.T.tolist():
            ctypes.memmove(dst, src, size)
    untouched = [b for b in range(pool) if b not in (4, 0, 2)]
    for t in tensors:
        assert not np.take(t, untouched, axis=block_dim).any()  # other blocks not written
    # every destination block now holds its slot's bytes, region by region
    for b, s in zip(spec.blocks, spec.slots, strict=True):
        for region, off in zip(group.regions, group.offsets, strict=True):
            page = (ctypes.c_uint8 * region.page_bytes).from_address(
                region.base + int(b) * region.block_stride
            )
            assert bytes(page) == host[s, off : off + region.page_bytes].tobytes()


def test_load_schedules_for_the_engine_on_qwen():
    """Every schedule ``NativeStagedBackend`` packs for Qwen2.5-7B (28 layers, K and V regions):
    equal counts of powers of two up to the most, and the most; ramped from 2 layers they have
    more slices than their count (2, 4, 8, then the equal share)."""
    starts = tuple(range(0, 56, 2))
    flat, plans = load_schedules(28, starts, 56, 7, 0)
    assert sorted(plans) == [1, 2, 4, 7]
    first, owner = plans[7]
    assert [len(p) for p in flat[first : first + 7]] == [8] * 7
    assert owner.tolist() == [k // 4 for k in range(28)]
    flat, plans = load_schedules(28, starts, 56, 3, 2)
    assert sorted(plans) == [1, 4, 5]  # counts 1, 2 and 3, ramped
    first, owner = plans[5]
    assert [len(p) for p in flat[first : first + 5]] == [4, 8, 16, 20, 8]
    assert owner.tolist()[:7] == [0, 0, 1, 1, 1, 1, 2]
    first, _ = plans[4]
    assert [len(p) for p in flat[first : first + 4]] == [4, 8, 16, 28]
    for count, (first, owner) in plans.items():  # every schedule covers every region once
        assert [r for p in flat[first : first + count] for r in p] == list(range(56))
        assert len(owner) == 28


@pytest.mark.parametrize(
    ("layers", "count", "first", "sizes"),
    [
        (32, 8, 0, [4] * 8),
        (32, 8, 1, [1, 2, 4, 4, 4, 4, 4, 4, 4, 1]),
        (32, 2, 1, [1, 2, 4, 8, 16, 1]),
        (28, 3, 2, [2, 4, 8, 10, 4]),
        (32, 32, 1, [1] * 32),
        (5, 1, 1, [5]),  # one slice: no ramp
        (3, 2, 8, [2, 1]),  # a first slice above the equal share is capped
    ],
)
def test_slice_bounds_ramp_from_the_first_slice_to_an_equal_share(layers, count, first, sizes):
    bounds = slice_bounds(layers, count, first)
    assert bounds[0] == 0 and bounds[-1] == layers
    assert np.diff(bounds).tolist() == sizes
    owner = bound_owner(bounds)
    assert len(owner) == layers and owner[0] == 0 and owner[-1] == len(sizes) - 1
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        assert (owner[a:b] == k).all()


def test_slice_bounds_refuse_bad_input():
    with pytest.raises(ValueError, match=r"expected 1 <= slices <= 4"):
        slice_bounds(4, 0)
    with pytest.raises(ValueError, match="expected first >= 0"):
        slice_bounds(4, 2, -1)


def test_the_first_slice_holds_the_fewest_layers_that_make_its_bytes():
    pages = [32 << 10] * 8  # K and V of 4 layers
    starts = (0, 2, 4, 6)
    assert first_slice_layers(pages, starts, 64 << 10) == 1
    assert first_slice_layers(pages, starts, 65 << 10) == 2
    assert first_slice_layers(pages, (), 64 << 10) == 2  # a region per layer
    assert first_slice_layers(pages, starts, 1 << 30) == 4  # at most every layer
    assert bound_regions(starts, 8, [0, 1, 4]) == [range(0, 2), range(2, 8)]
