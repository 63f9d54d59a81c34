"""Byte-oracle tests of the CUDA copy backends against the host backend.

Every model shape and engine layout, odd counts, random data (never zeros), a host arena whose slots
are larger than a block (slot stride != block bytes), the native engine's staging ring wrapping many
times and both its submission modes (the caller's thread, the engine's), the cuMemcpyAsync
fallback of ``dma`` (the backend ``staged`` falls back to where the engine cannot run). After each
transfer: destinations equal the oracle's, everything else (other slots, other blocks, the sources)
is unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvoffload.store.arena import HostArena
from kvoffload.transfer.cuda.dma import DmaBackend
from kvoffload.transfer.cuda.driver import CudaDriver
from kvoffload.transfer.cuda.sm import SmBackend, SmConfig
from kvoffload.transfer.cuda.staged_config import StagedConfig
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
    "dma-one-per-piece": lambda kv, a: DmaBackend(kv, a, merge=False),
    "dma-fallback": lambda kv, a: DmaBackend(kv, a, driver=CudaDriver.load(use_batch=False)),
    "sm": lambda kv, a: SmBackend(kv, a),
    "sm-odd": lambda kv, a: SmBackend(kv, a, config=SmConfig(programs=5, chunk_bytes=1024)),
    # the native engine (the compiled extension)
    "staged": lambda kv, a: native_staged(kv, a),
    # Two blocks per area, two areas: a 13-block transfer wraps the ring several times.
    "staged-native-wrap": lambda kv, a: native_staged(
        kv,
        a,
        StagedConfig(staging_bytes=4 * kv.slot_bytes, depth=2, first_chunk_bytes=1, programs=3),
    ),
    "staged-native-2dma": lambda kv, a: native_staged(kv, a, StagedConfig(dma_streams=2)),
    # every copy enqueued by the engine's threads (by default small ones by the caller's)
    "staged-native-thread": lambda kv, a: native_staged(kv, a, StagedConfig(native_inline_bytes=0)),
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


def native_staged(kv, arena, config=None):
    from kvoffload.transfer.cuda.engine import NativeStagedBackend

    return NativeStagedBackend(kv, arena, config=config)


def test_the_native_engine_runs_mixed_submits_and_threads_with_the_oracles_bytes(pair):
    """Stores and loads in one submit (one engine job each), and 4 threads submitting at once."""
    import threading

    rng = np.random.default_rng(11)
    backend = native_staged(pair.kv_gpu, pair.arena_gpu)
    try:
        assert backend.path == "native"
        half = POOL // 2
        slots = rng.choice(half, 8, replace=False)
        store = TransferSpec.of("store", rng.choice(POOL, 8, replace=False), slots)
        assert backend.submit([store]).wait(60)
        pair.oracle.copy([store])
        load = TransferSpec.of("load", rng.choice(POOL, 8, replace=False), slots)
        store2 = TransferSpec.of("store", rng.choice(POOL, 8, replace=False), slots + half)
        pending = backend.submit([store2, load])
        assert len(pending.jobs) == 2 and pending.wait(60) and pending.error() is None
        pair.oracle.copy([store2])
        pair.oracle.copy([load])
        pair.check_equal()
        errors = []
        parts = [rng.choice(POOL, 5, replace=False) for _ in range(4)]

        def run(k):
            try:
                for _ in range(3):
                    spec = TransferSpec.of("store", parts[k], np.arange(5) + 5 * k)
                    p = backend.submit([spec])
                    assert p.wait(60) and p.error() is None
            except BaseException as err:  # noqa: BLE001 (re-raised below)
                errors.append(err)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        for k in range(4):
            pair.oracle.copy([TransferSpec.of("store", parts[k], np.arange(5) + 5 * k)])
        pair.check_equal()
        assert backend.stats()["parts"] > 0
    finally:
        backend.close()
