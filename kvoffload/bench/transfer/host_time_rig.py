"""The host-time benchmark's engine (``host_time``): its settings (``HostTimeConfig``), what the
measuring loops need of an engine (``Rig``), and that engine on a GPU (``gpu_rig``: Llama-3-8B
page-layout KV tensors, a pinned arena for them, an eager step of tiny kernels)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvoffload.store.arena import HostArena
from kvoffload.transfer.layout import KVLayout

MODEL, LAYOUT, BLOCK_SIZE = "llama3-8b", "page", 16


@dataclass(frozen=True)
class HostTimeConfig:
    gil_blocks: tuple[int, ...] = (1, 4, 16, 64, 256, 1000, 2048)  # blocks per transfer, part a
    sleep_s: float = 200e-6  # the probe thread's sleep
    window_s: float = 0.2  # one baseline or loaded window of part a
    gil_rounds: int = 3  # (baseline, loaded) pairs per block count
    kernels_per_step: int = 200  # ~2.5 ms of launches per step on an H100
    steps_per_window: int = 40
    step_rounds: int = 5  # loaded windows per arm
    inline_blocks: tuple[int, ...] = (1, 4, 16)  # stored per step by the step's own thread
    periodic_s: float = 2e-3  # the other thread stores and loads 1..periodic_max_blocks this often
    periodic_max_blocks: int = 16
    back_to_back_blocks: tuple[int, ...] = (1, 16)  # the other thread's transfers, back to back
    wait_s: float = 60.0  # a transfer not done by then is a failure

    def __post_init__(self) -> None:
        counts = (*self.gil_blocks, *self.inline_blocks, *self.back_to_back_blocks)
        if not counts or any(n <= 0 for n in counts) or self.periodic_max_blocks <= 0:
            raise ValueError(f"HostTimeConfig: expected block counts > 0, got {counts}")
        for name in ("sleep_s", "window_s", "periodic_s", "wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HostTimeConfig: expected {name} > 0, got {getattr(self, name)}")
        for name in ("gil_rounds", "kernels_per_step", "steps_per_window", "step_rounds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"HostTimeConfig: expected {name} > 0, got {getattr(self, name)}")

    @property
    def most_blocks(self) -> int:
        return max(
            *self.gil_blocks,
            *self.inline_blocks,
            *self.back_to_back_blocks,
            self.periodic_max_blocks,
        )

    @property
    def checked_blocks(self) -> list[int]:
        """Every block count a method moves: each is byte-checked before timing."""
        every = {*self.gil_blocks, *self.inline_blocks, *self.back_to_back_blocks}
        return sorted(every | set(range(1, self.periodic_max_blocks + 1)))


@dataclass
class Rig:
    """What the loops need of an engine: its layout and arena, and callables."""

    layout: KVLayout
    arena: HostArena
    pool: int  # engine blocks (>= 2 * most_blocks)
    kernel: Callable[[], None]  # launch one small kernel of the engine step
    end_step: Callable[[], None]  # the step's host sync (the engine reading its samples)
    scramble: Callable[[np.ndarray], None]  # new random bytes in these engine blocks
    same_blocks: Callable[[np.ndarray, np.ndarray], bool]  # blocks a hold what blocks b hold
    stored_ok: Callable[[np.ndarray, np.ndarray], bool] | None = None  # slots hold the blocks


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
