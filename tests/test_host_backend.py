"""Byte-oracle tests of the host backend: real model shapes, every engine layout, many counts.

The oracle builds each expected host slot by hand from the engine tensors (per layout, in the
documented region order), independently of KVLayout's address arithmetic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvoffload.store.arena import HostArena
from kvoffload.transfer.host import HostBackend
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.shapes import MODELS, engine_tensors
from kvoffload.transfer.spec import TransferSpec

BLOCK_SIZE = 16
COUNTS = (1, 2, 7, 200)


def random_bf16(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen)
    return bits.view(torch.bfloat16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bf16 bits include NaNs, which torch.equal calls unequal)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def expected_slot(layout: str, tensors: list[torch.Tensor], block: int) -> np.ndarray:
    """One block's host slot as the layout table in kvoffload/transfer/layout.py defines it."""
    if layout == "kv_split":  # per layer [2, blocks, ...]: K then V of each layer
        pieces = [t[kv, block] for t in tensors for kv in (0, 1)]
    else:  # kv_pair / page / cross_layer: each tensor's block, in tensor order
        pieces = [t[block] for t in tensors]
    return np.concatenate([p.contiguous().view(torch.uint8).numpy().reshape(-1) for p in pieces])


def block_bytes(layout: str, tensors: list[torch.Tensor], block: int) -> np.ndarray:
    return expected_slot(layout, tensors, block)


@pytest.fixture(
    scope="module",
    params=[
        (m, lay)
        for m in MODELS
        if MODELS[m].dtype_bytes == 2 and MODELS[m].kv == 2  # the bf16 K+V shapes
        for lay in ("kv_split", "kv_pair", "page", "cross_layer")
    ],
    ids=str,
)
def engine(request):
    model, layout = request.param
    pool = max(COUNTS) + 24
    gen = torch.Generator().manual_seed(hash((model, layout)) % 2**31)
    tensors, block_dim = engine_tensors(
        MODELS[model], layout, pool, BLOCK_SIZE, lambda s: random_bf16(s, gen)
    )
    kv = KVLayout.from_tensors(tensors, block_size=BLOCK_SIZE, block_dim=block_dim)
    assert kv.slot_bytes == MODELS[model].block_bytes(BLOCK_SIZE)
    arena = HostArena(pool, kv.slot_bytes)
    arena.slots[:] = np.random.default_rng(1).integers(0, 256, arena.slots.shape, dtype=np.uint8)
    backend = HostBackend(kv, arena)
    yield layout, tensors, arena, backend, pool
    backend.close()
    arena.close()


@pytest.mark.parametrize("count", COUNTS)
def test_store_then_load_moves_exact_bytes(engine, count):
    layout, tensors, arena, backend, pool = engine
    rng = np.random.default_rng(count)
    blocks = rng.choice(pool, count, replace=False)
    slots = rng.choice(pool, count, replace=False)

    engine_before = [t.clone() for t in tensors]
    arena_before = arena.slots.copy()
    backend.submit([TransferSpec.of("store", blocks, slots)]).wait(60)
    for b, s in zip(blocks, slots, strict=True):
        assert np.array_equal(arena.slots[s], expected_slot(layout, tensors, int(b)))
    untouched = np.setdiff1d(np.arange(pool), slots)
    assert np.array_equal(arena.slots[untouched], arena_before[untouched])
    assert all(same_bits(a, b) for a, b in zip(tensors, engine_before, strict=True))

    dest = rng.choice(pool, count, replace=False)
    arena_before = arena.slots.copy()
    expected = {int(d): arena.slots[s].copy() for d, s in zip(dest, slots, strict=True)}
    others = np.setdiff1d(np.arange(pool), dest)
    others_before = {int(o): block_bytes(layout, tensors, int(o)) for o in others[:32]}
    pending = backend.submit([TransferSpec.of("load", dest, slots)])
    assert pending.wait(60) and pending.error() is None
    for d, want in expected.items():
        assert np.array_equal(block_bytes(layout, tensors, d), want)
    for o, want in others_before.items():
        assert np.array_equal(block_bytes(layout, tensors, o), want)
    assert np.array_equal(arena.slots, arena_before)


def test_numpy_arrays_work_too():
    rng = np.random.default_rng(0)
    k = [rng.integers(0, 2**16, (10, 16, 2, 8), dtype=np.uint16) for _ in range(3)]
    kv = KVLayout.from_tensors(k, block_size=16)
    with HostArena(4, kv.slot_bytes) as arena:
        backend = HostBackend(kv, arena)
        backend.copy([TransferSpec.of("store", [9, 0], [3, 1])])
        assert np.array_equal(
            arena.slots[3], np.concatenate([t[9].view(np.uint8).ravel() for t in k])
        )
        backend.copy([TransferSpec.of("load", [5], [1])])
        assert all(np.array_equal(t[5], t[0]) for t in k)
        backend.close()


def test_bad_transfers_are_clear_errors():
    k = [torch.zeros(8, 16, 1, 8, dtype=torch.bfloat16) for _ in range(2)]
    kv = KVLayout.from_tensors(k, block_size=16)
    with HostArena(4, kv.slot_bytes) as arena:
        backend = HostBackend(kv, arena)
        with pytest.raises(ValueError, match="distinct destination host slots"):
            backend.submit([TransferSpec.of("store", [1, 2], [3, 3])])
        with pytest.raises(ValueError, match="distinct destination engine blocks"):
            backend.submit([TransferSpec.of("load", [1, 1], [0, 2])])
        # each spec alone is fine; together one store writes slot 3 twice, one load block 1
        before = arena.slots.copy()
        for twice in (
            [TransferSpec.of("store", [1], [3]), TransferSpec.of("store", [2], [3])],
            [TransferSpec.of("load", [1], [0]), TransferSpec.of("load", [1], [2])],
        ):
            with pytest.raises(ValueError, match="got 1 duplicates"):
                backend.submit(twice)
        assert np.array_equal(arena.slots, before)
        # a store and a load of one submit are two jobs: the same slot in each is fine
        mixed = [TransferSpec.of("store", [1], [3]), TransferSpec.of("load", [2], [3])]
        assert backend.submit(mixed).wait(10)
        with pytest.raises(ValueError, match=r"engine block id in \[0, 8\), got 8"):
            backend.submit([TransferSpec.of("store", [8], [0])])
        with pytest.raises(ValueError, match=r"host slot in \[0, 4\), got -1"):
            backend.submit([TransferSpec.of("load", [0], [-1])])
        with pytest.raises(ValueError, match="as many host slots as engine blocks"):
            backend.submit([TransferSpec.of("load", [0, 1], [0])])
        with pytest.raises(ValueError, match="group in"):
            backend.submit([TransferSpec.of("load", [0], [0], group=1)])
        # a store that repeats a source block is fine: only destinations must be distinct
        backend.submit([TransferSpec.of("store", [1, 1], [0, 1])]).wait(10)
        assert np.array_equal(arena.slots[0], arena.slots[1])
        backend.close()


def test_copy_errors_come_back_through_pending():
    k = [torch.zeros(4, 16, 1, 8, dtype=torch.bfloat16)]
    kv = KVLayout.from_tensors(k, block_size=16)
    with HostArena(2, kv.slot_bytes) as arena:
        backend = HostBackend(kv, arena)
        bad = TransferSpec.of("store", [0], [5])  # bypasses validate: copy() raises in the thread
        pending = backend._pool.submit(backend.copy, [bad])
        with pytest.raises(IndexError):
            pending.result(10)
        backend.close()
