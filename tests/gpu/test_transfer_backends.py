"""Byte-oracle tests of the CUDA copy backends against the host backend.

Every model shape and engine layout, odd counts, random data (never zeros), a host arena whose slots
are larger than a block (slot stride != block bytes), the staging ring wrapping many times, the
cuMemcpyAsync fallback, both submission modes. After each transfer: destinations equal the
oracle's, everything else (other slots, other blocks, the sources) is unchanged.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from kvoffload.store.arena import HostArena
from kvoffload.transfer.cuda.dma import DmaBackend
from kvoffload.transfer.cuda.driver import CudaDriver
from kvoffload.transfer.cuda.sm import SmBackend, SmConfig
from kvoffload.transfer.cuda.staged import StagedBackend, StagedConfig
from kvoffload.transfer.host import HostBackend
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.pinning import cuda_pin
from kvoffload.transfer.registry import make_backend
from kvoffload.transfer.shapes import MODELS, engine_tensors
from kvoffload.transfer.spec import TransferSpec

BLOCK_SIZE = 16
POOL = 40
SLOT_PAD = 4096  # host slots larger than a block: stride and size must not be confused
LAYOUTS = ("kv_split", "kv_pair", "page", "cross_layer")


def random_bits(shape, gen):
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen).view(
        torch.bfloat16
    )


class Pair:
    """The same engine + arena twice: on the GPU (backend under test) and on the CPU (oracle)."""

    def __init__(self, model: str, layout: str) -> None:
        gen = torch.Generator().manual_seed(len(model) * 31 + len(layout))
        cpu, block_dim = engine_tensors(
            MODELS[model], layout, POOL, BLOCK_SIZE, lambda s: random_bits(s, gen)
        )
        self.cpu = cpu
        self.gpu = [t.cuda() for t in cpu]
        self.kv_cpu = KVLayout.from_tensors(self.cpu, block_size=BLOCK_SIZE, block_dim=block_dim)
        self.kv_gpu = KVLayout.from_tensors(self.gpu, block_size=BLOCK_SIZE, block_dim=block_dim)
        slot = self.kv_cpu.slot_bytes + SLOT_PAD
        self.arena_cpu = HostArena(POOL, slot)
        self.arena_gpu = HostArena(POOL, slot, pin=cuda_pin)
        noise = np.random.default_rng(7).integers(0, 256, (POOL, slot), dtype=np.uint8)
        self.arena_cpu.slots[:] = noise
        self.arena_gpu.slots[:] = noise
        self.oracle = HostBackend(self.kv_cpu, self.arena_cpu)

    def check_equal(self) -> None:
        torch.cuda.synchronize()
        assert np.array_equal(self.arena_gpu.slots, self.arena_cpu.slots), "host slots differ"
        for i, (g, c) in enumerate(zip(self.gpu, self.cpu, strict=True)):
            assert torch.equal(g.cpu().view(torch.int16), c.view(torch.int16)), f"tensor {i}"

    def close(self) -> None:
        self.oracle.close()
        self.arena_cpu.close()
        self.arena_gpu.close()


@pytest.fixture(scope="module", params=[(m, lay) for m in MODELS for lay in LAYOUTS], ids=str)
def pair(request):
    p = Pair(*request.param)
    yield p
    p.close()


BACKENDS = {
    "dma": lambda kv, a: DmaBackend(kv, a),
    "dma-one-per-piece": lambda kv, a: DmaBackend(kv, a, merge=False, submit_thread=False),
    "dma-fallback": lambda kv, a: DmaBackend(kv, a, driver=CudaDriver.load(use_batch=False)),
    "sm": lambda kv, a: SmBackend(kv, a),
    "sm-odd": lambda kv, a: SmBackend(kv, a, config=SmConfig(programs=5, chunk_bytes=1024)),
    "staged": lambda kv, a: StagedBackend(kv, a),
    "staged-sync": lambda kv, a: StagedBackend(kv, a, submit_thread=False),
    # the chunk loop in Python (the fallback where no C compiler exists)
    "staged-python": lambda kv, a: StagedBackend(kv, a, config=StagedConfig(native=False)),
    # enqueued in the caller's thread whenever the lane is idle (the default hands every job over)
    "staged-inline": lambda kv, a: StagedBackend(kv, a, inline_bytes=1 << 40),
    "dma-inline": lambda kv, a: DmaBackend(kv, a, inline_bytes=1 << 40),
    # Two blocks per area, two areas: a 13-block transfer wraps the ring several times.
    "staged-wrap": lambda kv, a: StagedBackend(
        kv,
        a,
        config=StagedConfig(
            staging_bytes=4 * kv.slot_bytes, depth=2, first_chunk_bytes=1, programs=3
        ),
    ),
    "staged-fallback": lambda kv, a: StagedBackend(kv, a, driver=CudaDriver.load(use_batch=False)),
    "auto": lambda kv, a: make_backend("auto", kv, a),
}


@pytest.mark.parametrize("name", list(BACKENDS))
def test_store_then_load_matches_host_oracle(pair, name):
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    backend = BACKENDS[name](pair.kv_gpu, pair.arena_gpu)
    try:
        for count in (13, 1, 27):
            blocks = rng.choice(POOL, count, replace=False)
            slots = rng.choice(POOL, count, replace=False)
            store = [TransferSpec.of("store", blocks, slots)]
            assert backend.submit(store).wait(60)
            pair.oracle.copy(store)
            pair.check_equal()  # slots written, other slots and the engine (source) unchanged
            dest = rng.choice(POOL, count, replace=False)
            load = [TransferSpec.of("load", dest, rng.permutation(slots))]
            pending = backend.submit(load)
            assert pending.wait(60)
            assert pending.error() is None
            pair.oracle.copy(load)
            pair.check_equal()  # blocks written, other blocks and the arena (source) unchanged
    finally:
        backend.close()


@pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler")
def test_staged_runs_the_compiled_loop_on_this_gpu_with_the_oracles_bytes(pair):
    """Triton's compiled copy kernel launched from C (native.c): its parameters as this Triton
    lays them out, every transfer after the first of each kernel variant."""
    rng = np.random.default_rng(11)
    backend = StagedBackend(pair.kv_gpu, pair.arena_gpu)
    try:
        for count in (5, 13, 1, 27, 2):
            blocks = rng.choice(POOL, count, replace=False)
            slots = rng.choice(POOL, count, replace=False)
            for specs in (
                [TransferSpec.of("store", blocks, slots)],
                [TransferSpec.of("load", rng.choice(POOL, count, replace=False), slots)],
            ):
                pending = backend.submit(specs)
                assert pending.wait(60) and pending.error() is None
                pair.oracle.copy(specs)
                pair.check_equal()
        assert backend.native_reason is None
        assert backend.native_parts > backend.python_parts > 0
    finally:
        backend.close()
