"""The Triton kernel of vLLM's small-copy fast path, rewritten here, and its launcher.

Kept apart from ``vllm_triton`` so that module imports on machines without Triton (CPU torch
wheels): this one imports Triton at the top and is imported only when a backend is built.
What the kernel does, and where vLLM's is, is in ``vllm_triton``'s docstring.
"""

from __future__ import annotations

import threading
from typing import Any

import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def swap_pieces(  # type: ignore[no-untyped-def]
    src_ptrs,  # int64 source address of each piece
    dst_ptrs,  # int64 destination address of each piece
    sizes,  # int64 bytes of each piece (a multiple of 8)
    n_pieces,
    WORDS: tl.constexpr,  # 8-byte words per loop step: vLLM's BYTES_PER_CHUNK // 8
):
    # Program p copies pieces p, p + programs, p + 2 * programs, ...: each in steps of WORDS
    # words, the last step masked. The same loop structure as vLLM's (a while over pieces).
    piece = tl.program_id(0)
    programs = tl.num_programs(0)
    lanes = tl.arange(0, WORDS)
    while piece < n_pieces:
        src = tl.load(src_ptrs + piece).to(tl.pointer_type(tl.int64))
        dst = tl.load(dst_ptrs + piece).to(tl.pointer_type(tl.int64))
        words = tl.load(sizes + piece) // 8
        for start in range(0, words, WORDS):
            idx = start + lanes
            live = idx < words
            tl.store(dst + idx, tl.load(src + idx, mask=live, other=0), mask=live)
        piece += programs


class SwapLauncher:
    """Launches ``swap_pieces`` through Triton's JIT on every call, as vLLM does (its host cost
    is part of what the benchmark measures). One launch at a time: the store and load submitter
    threads share the JIT's compile cache."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def launch(
        self, stream: Any, src: Any, dst: Any, sizes: Any, n: int, programs: int, chunk: int
    ) -> None:
        """Copy ``n`` pieces on ``stream`` (a ``torch.cuda.Stream``) with ``min(programs, n)``
        programs and ``chunk`` bytes per loop step; ``src``, ``dst``, ``sizes``: int64 device
        tensors of at least ``n`` entries."""
        import torch

        with self._lock, torch.cuda.stream(stream):
            swap_pieces[(min(programs, n),)](src, dst, sizes, n, WORDS=chunk // 8)
