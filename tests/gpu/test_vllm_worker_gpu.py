"""The vLLM worker adapter's transfer path on CUDA tensors in vLLM 0.33's canonical layout.

No vLLM here (the GPU machine has none): the KV caches are built the way vLLM 0.33 builds them
(``allocate_kv_cache`` with layout ``LBHNC``: one backing buffer, each layer a contiguous run of
``num_blocks`` pages; ``OffloadingConnectorWorker.register_kv_caches``: one int8
``(num_blocks, page)`` view per layer, references carrying the unpadded page size, groups of a
hybrid model overlaying the same tensors), and moved through ``TransferEngine`` exactly as
``KVOffloadWorker`` does. The ``host`` backend on a CPU copy of the same caches is the oracle:
after the same jobs, both host arenas must hold the same bytes, and both caches the same blocks.

``round_trip`` also runs on CPU with the ``host`` backend (``tests/test_vllm_adapter_core.py``),
so the code path is exercised wherever the suite runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvoffload.config import OffloadConfig
from kvoffload.integrations.vllm.canonical import layout_from_canonical
from kvoffload.integrations.vllm.engine import TransferEngine
from kvoffload.store.arena import HostArena, PinFn
from kvoffload.transfer.registry import BACKENDS
from kvoffload.transfer.spec import Direction

pytestmark = pytest.mark.gpu

BLOCK = 16
NUM_BLOCKS = 64
NUM_CHUNKS = 24
# Llama-3-8B bf16 per GPU at TP=1 is 8 KV heads x 16 tokens x (128 + 128) x 2 B = 64 KiB a page;
# smaller here to keep the test quick, with a padded tail on the second shape.
SHAPES = {"plain": (4096, 4096), "padded": (3072, 3584)}  # (unpadded page, padded page)


@dataclass
class Tensor:  # vLLM's CanonicalKVCacheTensor
    tensor: torch.Tensor
    page_size_bytes: int


@dataclass
class Ref:  # vLLM's CanonicalKVCacheRef
    tensor_idx: int
    page_size_bytes: int


@dataclass
class Caches:
    backing: torch.Tensor
    tensors: list[Tensor]
    group_refs: list[list[Ref]]


def canonical_caches(
    device: str, num_layers: int, page: int, padded: int, groups: int, seed: int
) -> Caches:
    """Random KV in vLLM 0.33's layout; with ``groups`` > 1 the groups overlay the same tensors."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(-128, 128, (num_layers * NUM_BLOCKS * padded,), generator=gen)
    backing = data.to(torch.int8).to(device)
    tensors = []
    for layer in range(num_layers):
        offset = layer * NUM_BLOCKS * padded
        view = backing[offset : offset + NUM_BLOCKS * padded].view(NUM_BLOCKS, padded)
        tensors.append(Tensor(view, padded))
    refs = [[Ref(i, page) for i in range(num_layers)] for _ in range(groups)]
    return Caches(backing, tensors, refs)


def engine(caches: Caches, backend: str, blocks_per_chunk: int) -> TransferEngine:
    layout = layout_from_canonical(caches.tensors, caches.group_refs, BLOCK)
    return TransferEngine(layout, NUM_CHUNKS, blocks_per_chunk, OffloadConfig(backend=backend))


def block_bytes(caches: Caches, block: int, page: int) -> np.ndarray:
    """One block's slot as the module docstring of canonical.py defines it (oracle)."""
    pieces = [t.tensor[block, :page].cpu().view(torch.uint8).numpy() for t in caches.tensors]
    return np.concatenate(pieces)


Job = tuple[int, Direction, list[int], list[int], list[int], list[int]]


def run_jobs(eng: TransferEngine, jobs: list[Job]) -> None:
    """Submit (job id, direction, GPU blocks, group sizes, group starts, host chunks) jobs."""
    for job_id, direction, blocks, sizes, starts, chunks in jobs:
        eng.submit(job_id, direction, blocks, sizes, starts, chunks)
    eng.drain()
    results = eng.get_finished()
    assert [r.job_id for r in results] == [j[0] for j in jobs]
    assert all(r.ok for r in results), [r.error for r in results]


def round_trip(device: str, backend: str, shape: str, blocks_per_chunk: int, groups: int) -> None:
    """Store blocks from a ``device`` cache, scribble, load them into other blocks; check bytes
    against the oracle and against the ``host`` backend running the same jobs on a CPU copy."""
    page, padded = SHAPES[shape]
    num_layers = 3
    caches = canonical_caches(device, num_layers, page, padded, groups, seed=1)
    mirror = Caches(caches.backing.cpu().clone(), [], caches.group_refs)
    for layer in range(num_layers):
        offset = layer * NUM_BLOCKS * padded
        view = mirror.backing[offset : offset + NUM_BLOCKS * padded].view(NUM_BLOCKS, padded)
        mirror.tensors.append(Tensor(view, padded))
    original = caches.backing.cpu().clone()

    bpc = blocks_per_chunk
    # Group 0: 5 blocks from block index 0 into chunks 2, 7, 3...; the last group starts inside
    # its first chunk when bpc > 1 (block index 1), like a hit that begins mid-chunk.
    sizes = [5] + [3] * (groups - 1)
    starts = [0] + [1] * (groups - 1)
    src = list(range(10, 10 + sum(sizes)))
    chunks: list[int] = []
    next_chunk = iter([2, 7, 3, 11, 5, 9, 13, 1, 17, 4, 8, 6])
    for size, start in zip(sizes, starts, strict=True):
        skip = start % bpc
        chunks += [next(next_chunk) for _ in range(-(-(size + skip) // bpc))]
    dst = list(range(40, 40 + sum(sizes)))

    gpu, cpu = engine(caches, backend, bpc), engine(mirror, "host", bpc)
    try:
        for eng in (gpu, cpu):
            run_jobs(eng, [(1, "store", src, sizes, starts, chunks)])
        assert np.array_equal(gpu.arena.slots, cpu.arena.slots), "host arenas differ"
        # the oracle: slot c * bpc + j holds block j of chunk c, each group's run in order
        offset, chunk_offset = 0, 0
        for size, start in zip(sizes, starts, strict=True):
            skip = start % bpc
            group_chunks = np.array(chunks[chunk_offset : chunk_offset + -(-(size + skip) // bpc)])
            slots = (group_chunks[:, None] * bpc + np.arange(bpc)).ravel()[skip : skip + size]
            for k, slot in enumerate(slots):
                want = block_bytes(mirror, src[offset + k], page)
                assert np.array_equal(cpu.arena.slots[slot, : len(want)], want)
            offset += size
            chunk_offset += len(group_chunks)

        caches.backing.fill_(0x5A)  # the engine reused its GPU memory
        mirror.backing.fill_(0x5A)
        for eng in (gpu, cpu):
            run_jobs(eng, [(2, "load", dst, sizes, starts, chunks)])
        got = caches.backing.cpu()
        assert torch.equal(got, mirror.backing), "loaded caches differ from the host oracle"
        for s, d in zip(src, dst, strict=True):
            for t in range(num_layers):
                base = t * NUM_BLOCKS * padded
                expected = original[base + s * padded : base + s * padded + page]
                assert torch.equal(got[base + d * padded : base + d * padded + page], expected)
                pad = got[base + d * padded + page : base + (d + 1) * padded]
                assert bool((pad == 0x5A).all()), "a load wrote past the unpadded page"
        untouched = torch.ones(NUM_BLOCKS, dtype=torch.bool)
        untouched[dst] = False
        for t in range(num_layers):
            base = t * NUM_BLOCKS * padded
            rows = got[base : base + NUM_BLOCKS * padded].view(NUM_BLOCKS, padded)
            assert bool((rows[untouched] == 0x5A).all()), "a load touched a block it should not"
    finally:
        gpu.close()
        cpu.close()


def gpu_backends() -> list[str]:
    return [name for name in ("staged", "dma", "sm") if name in BACKENDS]


@pytest.mark.parametrize("backend", gpu_backends())
@pytest.mark.parametrize(
    ("shape", "blocks_per_chunk", "groups"),
    [
        ("plain", 1, 1),
        ("padded", 1, 2),
        ("plain", 2, 2),
    ],
)
def test_round_trip_matches_the_host_oracle(
    backend: str, shape: str, blocks_per_chunk: int, groups: int
) -> None:
    round_trip("cuda", backend, shape, blocks_per_chunk, groups)


@pytest.mark.parametrize("backend", gpu_backends())
def test_store_is_ordered_after_the_compute_that_wrote_the_blocks(backend: str) -> None:
    page, padded = SHAPES["plain"]
    caches = canonical_caches("cuda", 2, page, padded, 1, seed=2)
    eng = engine(caches, backend, 1)
    try:
        blocks = list(range(8))
        stream = torch.cuda.current_stream()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the write
        for t in caches.tensors:
            t.tensor[:8].fill_(0x33)  # "the forward pass" writes the blocks, after the sleep
        eng.submit(1, "store", blocks, [8], [0], list(range(8)))
        stream.synchronize()
        eng.drain()
        (result,) = eng.get_finished()
        assert result.ok, result.error
        assert result.nbytes == 8 * 2 * page and result.seconds > 0
        assert bool((torch.from_numpy(eng.arena.slots[:8, : 2 * page]) == 0x33).all()), (
            "the store read the blocks before the compute stream wrote them"
        )
    finally:
        eng.close()


def rank_round_trip(device: str, backend: str) -> None:
    """Rank 1 of 2 in a shared host region (``KVOffloadSpec``'s layout: both ranks' bytes of a
    block side by side): a store writes only rank 1's half of each slot, a load brings it back."""
    import uuid

    from kvoffload.integrations.vllm.region import RankArena, SharedRegion

    page, padded = SHAPES["plain"]
    caches = canonical_caches(device, 2, page, padded, 1, seed=3)
    layout = layout_from_canonical(caches.tensors, caches.group_refs, BLOCK)
    slot = layout.slot_bytes
    region = SharedRegion(f"gpu-test-{uuid.uuid4().hex}", NUM_CHUNKS * 2 * slot)
    region.array[:] = 0x11  # rank 0's bytes, which rank 1 must never touch

    def arena(pin: PinFn | None) -> HostArena:
        return RankArena(region, NUM_CHUNKS, slot, 2 * slot, slot, pin)

    eng = TransferEngine(layout, NUM_CHUNKS, 1, OffloadConfig(backend=backend), arena=arena)
    try:
        original = caches.backing.cpu().clone()
        run_jobs(eng, [(1, "store", [3, 9, 20], [3], [0], [5, 0, 23])])
        rows = region.array.reshape(NUM_CHUNKS, 2, slot)
        assert bool((rows[:, 0] == 0x11).all()), "a store wrote into rank 0's bytes"

        def page_of(layer: int, block: int) -> torch.Tensor:
            start = layer * NUM_BLOCKS * padded + block * padded
            return original[start : start + page]

        for block, chunk in ((3, 5), (9, 0), (20, 23)):
            want = torch.cat([page_of(0, block), page_of(1, block)]).view(torch.uint8).numpy()
            assert np.array_equal(rows[chunk, 1], want), "rank 1's slot lacks the block"
        caches.backing.fill_(0x5A)
        eng.submit(2, "load", [40, 41, 42], [3], [0], [5, 0, 23], expedited=True)
        assert eng.wait_layer(2, 0)  # layer 0 ordered before the current stream's later work
        first = caches.tensors[0].tensor[40:43, :page].cpu()  # read on the current stream
        eng.drain()
        assert [r.ok for r in eng.get_finished()] == [True]
        for k, src in enumerate((3, 9, 20)):
            assert torch.equal(first[k], page_of(0, src)), "layer 0 was read before it arrived"
        assert bool((rows[:, 0] == 0x11).all()), "a load wrote into rank 0's bytes"
    finally:
        eng.close()


@pytest.mark.parametrize("backend", gpu_backends())
def test_rank_slots_in_a_shared_region_round_trip(backend: str) -> None:
    rank_round_trip("cuda", backend)
