"""The host-time benchmark's engine on a GPU (``host_time.run``): Llama-3-8B page-layout KV
tensors, a pinned arena for them, and an eager step of tiny kernels on the current stream."""

from __future__ import annotations

import math

import numpy as np

from kvoffload.bench.transfer.host_time import BLOCK_SIZE, LAYOUT, MODEL, HostTimeConfig, Rig
from kvoffload.store.arena import HostArena


def gpu_rig(device: int, cfg: HostTimeConfig) -> Rig:
    """Llama-3-8B page-layout KV tensors on ``device`` and a pinned arena for them."""
    import torch

    from kvoffload.bench.transfer.kv import SyntheticKV
    from kvoffload.transfer.pinning import cuda_pin

    torch.cuda.set_device(device)
    most = cfg.most_blocks
    engine = SyntheticKV(MODEL, LAYOUT, BLOCK_SIZE, 2 * most + 16)
    arena = HostArena(most + 16, engine.kv.slot_bytes, pin=cuda_pin)
    x = torch.zeros(1024, device="cuda")
    stream = torch.cuda.current_stream()

    def kernel() -> None:
        x.add_(1.0)

    def scramble(blocks: np.ndarray) -> None:
        index = torch.from_numpy(blocks).cuda()
        for t in engine.tensors:
            shape = list(t.shape)
            shape[engine.block_dim] = len(blocks)
            nbytes = math.prod(shape) * t.element_size()
            noise = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=t.device)
            t.index_copy_(engine.block_dim, index, noise.view(t.dtype).reshape(shape))

    def stored_ok(blocks: np.ndarray, slots: np.ndarray) -> bool:
        got = torch.from_numpy(arena.slots[slots, : engine.kv.slot_bytes]).cuda()
        return bool(torch.equal(got, engine.slot_images(blocks)))

    return Rig(
        layout=engine.kv,
        arena=arena,
        pool=engine.pool,
        kernel=kernel,
        end_step=stream.synchronize,
        scramble=scramble,
        same_blocks=engine.same_blocks,
        stored_ok=stored_ok,
    )
