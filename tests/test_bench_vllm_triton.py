"""``vllm-triton`` (kvoffload/bench/vllm_triton.py): vLLM's chunk rule, its descriptor order, and
the backend's bytes, on CPU through ``tests/fake_cuda.py`` with a launcher doing what the Triton
kernel does (piece by piece, from the uploaded tables); on a GPU, the real kernel against the host
backend's bytes."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from kvoffload.bench.vllm_triton import (
    VllmTritonBackend,
    VllmTritonConfig,
    chunk_bytes,
    piece_table,
)
from kvoffload.transfer.descriptors import region_arrays
from kvoffload.transfer.spec import TransferSpec
from tests.fake_cuda import Calls, fake_cuda
from tests.test_cuda_backends_on_cpu import POOL, Pair

__all__ = ["fake_cuda"]  # the fixture, used by name


def test_importing_the_backend_module_does_not_import_triton():
    code = (
        "import sys, kvoffload.bench.vllm_triton; "
        "assert 'triton' not in sys.modules, 'triton imported'; "
        "assert 'kvoffload.bench.vllm_triton_kernel' not in sys.modules, 'kernel imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("pages", "expected"),
    [
        ([2048], 2048),  # fp8 TP8 pieces: one step of 2 KiB
        ([2048, 3000], 4096),
        ([4096, 4096], 4096),
        ([18432], 8192),  # MLA latent pieces: capped
        ([65536], 8192),
        ([8], 8),
    ],
)
def test_chunk_is_vllms_next_power_of_two_of_the_largest_page_capped_at_8k(pages, expected):
    assert chunk_bytes(pages, 8192) == expected


def test_chunk_of_no_pages_is_refused():
    with pytest.raises(ValueError, match="expected at least one page size"):
        chunk_bytes([], 8192)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"programs": 0}, "expected programs > 0, got 0"),
        ({"max_chunk_bytes": 6000}, "power of two >= 8, got 6000"),
        ({"max_chunk_bytes": 4}, "power of two >= 8, got 4"),
    ],
)
def test_config_refuses_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        VllmTritonConfig(**kw)


def test_defaults_are_vllms():
    cfg = VllmTritonConfig()
    assert (cfg.programs, cfg.max_chunk_bytes) == (12, 8192)


@pytest.mark.parametrize("direction", ["store", "load"])
def test_piece_table_is_region_major_with_the_layouts_addresses(direction):
    pair = Pair("llama3-8b", "kv_split")
    try:
        group = pair.kv.groups[0]
        spec = TransferSpec.of(direction, [5, 0, 17], [3, 9, 1])
        regions = range(2, 7)
        host_base = 1 << 40
        out = np.full((3, 18), -1, dtype=np.int64)
        n = piece_table(spec, region_arrays(group), regions, host_base, 12345 * 8, out)
        assert n == 15
        expected = []
        for r in regions:  # every block of region r before region r + 1, as vLLM orders them
            reg = group.regions[r]
            for b, s in zip(spec.blocks, spec.slots, strict=True):
                eng = reg.base + int(b) * reg.block_stride
                host = host_base + int(s) * 12345 * 8 + group.offsets[r]
                src, dst = (eng, host) if direction == "store" else (host, eng)
                expected.append((src, dst, reg.page_bytes))
        assert [tuple(int(v) for v in col) for col in out[:, :n].T] == expected
        assert (out[:, n:] == -1).all()  # nothing past the table written
    finally:
        pair.close()


def test_piece_table_refuses_a_short_buffer():
    pair = Pair("llama3-8b", "page")
    try:
        spec = TransferSpec.of("store", [1, 2], [3, 4])
        out = np.zeros((3, 63), dtype=np.int64)
        with pytest.raises(
            ValueError, match=r"expected an int64 \(3, >= 64\) table, got int64 \(3, 63\)"
        ):
            piece_table(spec, region_arrays(pair.kv.groups[0]), range(32), 0, 8, out)
    finally:
        pair.close()


class PieceLauncher:
    """What ``vllm_triton_kernel.swap_pieces`` does, with memmove: each piece of the uploaded
    tables (``fake_cuda``'s "device" tensors are CPU tensors), whole 8-byte words."""

    def __init__(self) -> None:
        self.launches: list[tuple[int, int, int]] = []  # (pieces, programs, chunk)
        self.misaligned = 0

    def launch(
        self, stream: Any, src: Any, dst: Any, sizes: Any, n: int, programs: int, chunk: int
    ) -> None:
        for s, d, size in zip(
            src.numpy()[:n].tolist(),
            dst.numpy()[:n].tolist(),
            sizes.numpy()[:n].tolist(),
            strict=True,
        ):
            ctypes.memmove(d, s, size // 8 * 8)
        self.launches.append((n, programs, chunk))
        # every table starts 16-byte aligned (Triton compiles a variant per pointer alignment)
        self.misaligned += sum(t.data_ptr() % 16 != 0 for t in (src, dst, sizes))


@pytest.mark.parametrize("layout", ["kv_split", "page", "cross_layer"])
@pytest.mark.parametrize("model", ["llama3-8b", "llama3-70b-tp8-fp8", "deepseek-v2-lite-mla"])
def test_store_then_load_moves_the_oracles_bytes(fake_cuda: Calls, model, layout):
    pair = Pair(model, layout)
    launcher = PieceLauncher()
    backend = VllmTritonBackend(pair.kv, pair.arena, launcher=launcher)
    rng = np.random.default_rng(5)
    regions = len(pair.kv.groups[0].regions)
    try:
        for count in (13, 1, 7, 0):
            blocks = rng.choice(POOL, count, replace=False)
            slots = rng.choice(POOL, count, replace=False)
            store = [TransferSpec.of("store", blocks, slots)]
            pending = backend.submit(store)
            assert pending.wait(10) and pending.error() is None
            pair.oracle.copy(store)
            pair.check()
            load = [TransferSpec.of("load", rng.choice(POOL, count, replace=False), slots)]
            pending = backend.submit(load)
            assert pending.wait(10) and pending.error() is None
            pair.oracle.copy(load)
            pair.check()
        pages = [r.page_bytes for r in pair.kv.groups[0].regions]
        chunk = min(1 << (max(pages) - 1).bit_length(), 8192)
        # one launch per transfer with pieces (loads too: no layer slices), vLLM's settings
        assert launcher.launches == [(c * regions, 12, chunk) for c in (13, 13, 1, 1, 7, 7)]
        assert launcher.misaligned == 0
    finally:
        backend.close()
        pair.close()


def test_a_refused_submit_launches_nothing(fake_cuda: Calls):
    pair = Pair("llama3-8b", "page")
    launcher = PieceLauncher()
    backend = VllmTritonBackend(pair.kv, pair.arena, launcher=launcher)
    try:
        before = pair.arena.slots.copy()
        with pytest.raises(ValueError, match="host slot"):
            backend.submit([TransferSpec.of("store", [1, 2], [0, POOL])])
        assert launcher.launches == []
        assert np.array_equal(pair.arena.slots, before)
    finally:
        backend.close()
        pair.close()


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("model", "layout"),
    [
        ("llama3-8b", "page"),
        ("llama3-70b-tp8-fp8", "kv_split"),
        ("deepseek-v2-lite-mla", "kv_split"),
        ("qwen2.5-7b", "cross_layer"),
        ("llama3-70b-tp8", "kv_pair"),
    ],
)
def test_on_gpu_store_then_load_matches_host_oracle(model, layout):
    from tests.gpu.test_transfer_backends import POOL as GPU_POOL
    from tests.gpu.test_transfer_backends import Pair as GpuPair

    pair = GpuPair(model, layout)
    backend = VllmTritonBackend(pair.kv_gpu, pair.arena_gpu)
    rng = np.random.default_rng(9)
    try:
        for count in (13, 1, 27, 2):
            blocks = rng.choice(GPU_POOL, count, replace=False)
            slots = rng.choice(GPU_POOL, count, replace=False)
            store = [TransferSpec.of("store", blocks, slots)]
            pending = backend.submit(store)
            assert pending.wait(60) and pending.error() is None
            pair.oracle.copy(store)
            pair.check_equal()  # slots written, other slots and the engine unchanged
            load = [TransferSpec.of("load", rng.choice(GPU_POOL, count, replace=False), slots)]
            pending = backend.submit(load)
            assert pending.wait(60) and pending.error() is None
            pair.oracle.copy(load)
            pair.check_equal()  # blocks written, other blocks and the arena unchanged
    finally:
        backend.close()
        pair.close()
