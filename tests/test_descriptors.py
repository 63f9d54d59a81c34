"""Descriptor building and coalescing, the copy kernel's tiles, and the driver wrapper's error
reporting, on CPU with real bytes."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvoffload.transfer.cuda.chunks import tile
from kvoffload.transfer.cuda.driver import CudaCopyError, CudaDriver
from kvoffload.transfer.descriptors import build_descriptors, coalesce
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.shapes import MODELS, engine_tensors
from kvoffload.transfer.spec import TransferSpec

LAYOUTS = ("kv_split", "kv_pair", "page", "cross_layer")


def layout_of(model: str, layout: str, pool: int = 12) -> tuple[KVLayout, list[np.ndarray]]:
    tensors, block_dim = engine_tensors(
        MODELS[model], layout, pool, 16, lambda s: np.empty(s, dtype=np.uint16)
    )
    return KVLayout.from_tensors(tensors, block_size=16, block_dim=block_dim), tensors


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("direction", ["store", "load"])
def test_descriptors_match_a_per_piece_loop(layout, direction):
    kv, _ = layout_of("qwen2.5-7b", layout)
    group = kv.groups[0]
    rng = np.random.default_rng(3)
    spec = TransferSpec.of(direction, rng.permutation(12)[:7], rng.permutation(12)[:7])
    base, slot_bytes = 1 << 40, group.slot_bytes + 512
    out = np.full((3, 7 * len(group.regions) + 5), -1, dtype=np.int64)
    table = build_descriptors(spec, group, base, slot_bytes, out=out)
    want = []
    for b, s in zip(spec.blocks, spec.slots, strict=True):
        for region, off in zip(group.regions, group.offsets, strict=True):
            engine = region.base + int(b) * region.block_stride
            host = base + int(s) * slot_bytes + off
            pair = (engine, host) if direction == "store" else (host, engine)
            want.append((*pair, region.page_bytes))
    assert table.tolist() == np.array(want).T.tolist()
    assert (out[:, table.shape[1] :] == -1).all()  # nothing written past the transfer


def test_descriptor_buffer_of_the_wrong_shape_is_refused():
    kv, _ = layout_of("llama3-8b", "page")
    spec = TransferSpec.of("store", [0, 1], [0, 1])
    with pytest.raises(ValueError, match=r"\(3, >=64\)"):
        build_descriptors(spec, kv.groups[0], 0, kv.slot_bytes, out=np.empty((3, 10), np.int64))


def test_coalesce_merges_only_continuations():
    table = np.array(
        [[0, 10, 20, 100, 110], [1000, 1010, 1020, 2000, 3000], [10, 10, 10, 10, 10]],
        dtype=np.int64,
    )
    merged = coalesce(table)
    assert merged.tolist() == [[0, 100, 110], [1000, 2000, 3000], [30, 10, 10]]
    assert merged[2].sum() == table[2].sum()
    for few in (table[:, :0], table[:, :1], table[:, 3:]):  # nothing to merge: the table itself
        assert coalesce(few) is few


def test_coalesced_copies_move_the_same_bytes():
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 4096, dtype=np.uint8)
    sizes = np.full(64, 64, dtype=np.int64)
    order = np.sort(rng.choice(64, 64, replace=False))  # contiguous runs with random cuts
    order[20:30] = order[20:30][::-1]
    s = src.ctypes.data + order * 64
    for table in (np.stack([s, np.arange(64) * 64, sizes]),):
        dst_a = np.zeros(4096, dtype=np.uint8)
        dst_b = np.zeros(4096, dtype=np.uint8)
        t = table.copy()
        t[1] += dst_a.ctypes.data
        merged = coalesce(t)
        assert merged.shape[1] < 64
        for a, d, n in t.T.tolist():
            ctypes.memmove(d, a, n)
        m = merged.copy()
        m[1] += dst_b.ctypes.data - dst_a.ctypes.data
        for a, d, n in m.T.tolist():
            ctypes.memmove(d, a, n)
        assert np.array_equal(dst_a, dst_b)


@pytest.mark.parametrize("page", [8, 4096, 8192, 32768, 2 << 20, 640 << 10])
def test_kernel_tile_covers_a_page_within_the_tile(page):
    jobs, words = tile(page, 32768)
    assert jobs * words * 8 <= 32768
    assert words & (words - 1) == 0 and jobs >= 1
    assert words * 8 >= min(page, 32768)


class FakeCopies:
    """cuMemcpyAsync / cuMemcpyBatchAsync stand-ins that move real host bytes."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.calls = 0

    def copy(self, dst: int, src: int, n: int, stream: int) -> int:
        if self.calls == self.fail_at:
            return 1
        self.calls += 1
        ctypes.memmove(dst, src, n)
        return 0

    def batch(self, dsts, srcs, sizes, count, attrs, idx, nattr, fail, stream) -> int:
        d = np.ctypeslib.as_array((ctypes.c_int64 * count).from_address(dsts))
        s = np.ctypeslib.as_array((ctypes.c_int64 * count).from_address(srcs))
        z = np.ctypeslib.as_array((ctypes.c_int64 * count).from_address(sizes))
        for i in range(count):
            if i == self.fail_at:
                ctypes.cast(fail, ctypes.POINTER(ctypes.c_size_t))[0] = i
                return 1
            ctypes.memmove(int(d[i]), int(s[i]), int(z[i]))
        return 0


def host_table(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(n)
    src = rng.integers(0, 256, n * 32, dtype=np.uint8)
    dst = np.zeros(n * 32, dtype=np.uint8)
    perm = rng.permutation(n)
    table = np.stack(
        [src.ctypes.data + perm * 32, dst.ctypes.data + np.arange(n) * 32, np.full(n, 32)]
    ).astype(np.int64)
    return table, src, dst


@pytest.mark.parametrize("use_batch", [True, False])
def test_memcpy_batch_and_its_fallback_move_the_same_bytes(use_batch):
    fake = FakeCopies()
    driver = CudaDriver(fake.batch if use_batch else None, fake.copy, 12080)
    table, src, dst = host_table(9)
    driver.memcpy_batch(table, stream=7)
    perm = (table[0] - src.ctypes.data) // 32
    assert np.array_equal(dst.reshape(9, 32), src.reshape(9, 32)[perm])


@pytest.mark.parametrize("use_batch", [True, False])
def test_a_refused_copy_names_the_failing_descriptor(use_batch):
    fake = FakeCopies(fail_at=4)
    driver = CudaDriver(fake.batch if use_batch else None, fake.copy, 12080)
    table, _, _ = host_table(9)
    with pytest.raises(CudaCopyError, match="descriptor 4 of 9") as err:
        driver.memcpy_batch(table, stream=7)
    assert err.value.index == 4


@pytest.mark.parametrize("handle", [0, 1])
def test_the_legacy_null_stream_is_refused_before_any_copy(handle):
    fake = FakeCopies()
    driver = CudaDriver(fake.batch, fake.copy, 12080)
    table, _, dst = host_table(3)
    with pytest.raises(ValueError, match="legacy default"):
        driver.memcpy_batch(table, handle)
    assert fake.calls == 0 and not dst.any()
