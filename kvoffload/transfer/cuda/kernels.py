"""The Triton copy kernel both GPU-side paths use, and a launcher with little host overhead.

``copy_blocks`` moves whole blocks between an engine layout and slot images: for block i of the
launch and region r (one "job"), the engine piece at ``base[r] + blocks[first + i] * stride[r]``
and the slot piece at ``host_base + s * slot_stride + offset[r]`` (``s = slots[first + i]``, or
``i`` itself when ``IDENTITY``), ``page[r]`` bytes each, in 8-byte words (tails masked).
``host_base`` may be device memory (the staged path's staging ring) or page-locked host memory
seen through UVA (the ``sm`` path). Addresses are computed on the GPU from the block ids, so a
transfer uploads one int64 per block (two for ``sm``) instead of three per piece.

Programs stride over the jobs ``JOBS`` at a time; each loop step moves ``WORDS`` 8-byte words of
each of those jobs (a ``JOBS x WORDS`` tile: several small pieces in flight per program, which is
what keeps a few programs fast on 4 KiB pieces). ``JOBS=1, WORDS=1024`` is vLLM's kernel shape.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import triton
import triton.language as tl

from kvoffload.transfer.cuda.extension import wide as _wide

if TYPE_CHECKING:
    from kvoffload.transfer.cuda.extension import NativeKernel

_INT_ARGS = ["first", "n_blocks", "n_regions", "host_base", "slot_stride"]


@triton.jit(do_not_specialize=_INT_ARGS)  # type: ignore[untyped-decorator]
def copy_blocks(  # type: ignore[no-untyped-def]
    blocks,  # int64 engine block ids
    slots,  # int64 slot ids (unused when IDENTITY)
    regions,  # int64 [4, n_regions]: base, block stride, page bytes, offset in slot
    first,
    n_blocks,
    n_regions,
    host_base,
    slot_stride,
    TO_HOST: tl.constexpr,
    IDENTITY: tl.constexpr,
    JOBS: tl.constexpr,
    WORDS: tl.constexpr,
    VEC: tl.constexpr = 1,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    jo = tl.arange(0, JOBS)
    wo = tl.arange(0, WORDS).to(tl.int64)
    n_jobs = n_blocks * n_regions
    for job0 in range(pid * JOBS, n_jobs, nprog * JOBS):
        job = job0 + jo
        live = job < n_jobs
        i = job // n_regions
        r = job - i * n_regions
        b = tl.load(blocks + first + i, mask=live, other=0)
        if IDENTITY:  # noqa: SIM108 (a constexpr branch, resolved at compile time)
            s = i.to(tl.int64)
        else:
            s = tl.load(slots + first + i, mask=live, other=0)
        base = tl.load(regions + r, mask=live, other=0)
        stride = tl.load(regions + n_regions + r, mask=live, other=0)
        words = tl.load(regions + 2 * n_regions + r, mask=live, other=0) // 8
        off = tl.load(regions + 3 * n_regions + r, mask=live, other=0)
        eng = base + b * stride
        slot = host_base.to(tl.int64) + s * slot_stride.to(tl.int64) + off
        longest = tl.max(words, axis=0)
        if VEC > 1:  # every piece and slot address a multiple of 8 * VEC bytes (vector_words)
            words = tl.multiple_of(words, VEC)
            eng_p = eng.to(tl.pointer_type(tl.int64))
            slot_p = slot.to(tl.pointer_type(tl.int64))
        for start in range(0, longest, WORDS):
            idx = start + wo
            m = idx[None, :] < words[:, None]
            if VEC > 1:  # pointers the compiler knows aligned: one 8 * VEC-byte access per lane
                eng_ptr = eng_p[:, None] + idx[None, :]
                slot_ptr = slot_p[:, None] + idx[None, :]
                eng_ptr = tl.max_contiguous(tl.multiple_of(eng_ptr, [8 * VEC, 8 * VEC]), [1, WORDS])
                slot_ptr = tl.max_contiguous(
                    tl.multiple_of(slot_ptr, [8 * VEC, 8 * VEC]), [1, WORDS]
                )
            else:
                eng_ptr = (eng[:, None] + idx[None, :] * 8).to(tl.pointer_type(tl.int64))
                slot_ptr = (slot[:, None] + idx[None, :] * 8).to(tl.pointer_type(tl.int64))
            if TO_HOST:
                tl.store(slot_ptr, tl.load(eng_ptr, mask=m), mask=m)
            else:
                tl.store(eng_ptr, tl.load(slot_ptr, mask=m), mask=m)


class CopyLauncher:
    """Launches ``copy_blocks``: the first launch of each variant through Triton's JIT (which
    compiles it), later ones straight through the compiled kernel's launcher, skipping the JIT's
    argument binding (a few microseconds of host time per launch)."""

    def __init__(self) -> None:
        self._compiled: dict[tuple[Any, ...], Any] = {}
        self._lock = threading.Lock()  # threads submitting at once share a launcher

    def launch(
        self,
        stream: Any,  # torch.cuda.Stream
        programs: int,
        blocks: Any,
        slots: Any,
        regions: Any,
        first: int,
        n_blocks: int,
        n_regions: int,
        host_base: int,
        slot_stride: int,
        to_host: bool,
        identity: bool,
        jobs: int,
        words: int,
        num_warps: int = 4,
        vec: int = 1,
    ) -> None:
        ints = (first, n_blocks, n_regions, host_base, slot_stride)
        key = variant(to_host, identity, jobs, words, num_warps, ints, vec)
        args = (blocks, slots, regions, *ints, to_host, identity, jobs, words, vec)
        kernel = self._compiled.get(key)
        if kernel is None:
            import torch

            with self._lock, torch.cuda.stream(stream):
                self._compiled[key] = copy_blocks[(programs,)](*args, num_warps=num_warps)
            return
        kernel[(programs, 1, 1)](*args, stream=stream.cuda_stream)

    def native_kernel(
        self,
        to_host: bool,
        identity: bool,
        jobs: int,
        words: int,
        num_warps: int,
        ints: tuple[int, ...],
        vec: int = 1,
    ) -> NativeKernel | None:
        """How C launches the variant that ``launch`` would use for these arguments, once Triton
        has compiled it (None before that: the first launch of a variant goes through ``launch``).

        Raises ValueError where the compiled kernel does not have the parameters
        ``native.kvo_staged`` passes (a Triton whose ABI differs from the one this was written
        for): the caller then keeps launching through Triton."""
        kernel = self._compiled.get(variant(to_host, identity, jobs, words, num_warps, ints, vec))
        if kernel is None:
            return None
        return native_info(kernel)


def variant(
    to_host: bool,
    identity: bool,
    jobs: int,
    words: int,
    warps: int,
    ints: Sequence[int],
    vec: int = 1,
) -> tuple[Any, ...]:
    """The key of one compiled variant: Triton types an int argument i32 or i64 by its value, so
    a compiled variant fits only values of the same widths."""
    return (to_host, identity, jobs, words, warps, vec, *(_wide(v) for v in ints))


def native_info(kernel: Any) -> NativeKernel:
    """``NativeKernel`` of a Triton ``CompiledKernel`` of ``copy_blocks``; ValueError when its
    parameters or launch options are not those ``native.c`` passes."""
    from kvoffload.transfer.cuda.extension import NativeKernel

    md = kernel.metadata
    for name, expected in (
        ("num_ctas", 1),
        ("global_scratch_size", 0),
        ("profile_scratch_size", 0),
        ("launch_cooperative_grid", False),
        ("launch_pdl", False),
    ):
        value = getattr(md, name, expected)
        if value != expected:
            raise ValueError(f"expected {name}={expected!r} in the copy kernel, got {value!r}")
    signature = dict(kernel.src.signature)
    params = [n for n, t in signature.items() if t != "constexpr"]
    expected_params = ["blocks", "slots", "regions", *_INT_ARGS]
    if params != expected_params:
        raise ValueError(f"expected copy kernel parameters {expected_params}, got {params}")
    if any(not str(signature[n]).startswith("*") for n in expected_params[:3]):
        raise ValueError(f"expected pointer parameters, got {signature}")
    wide = 0
    for j, name in enumerate(_INT_ARGS):
        ty = signature[name]
        if ty not in ("i32", "i64"):
            raise ValueError(f"expected {name} typed i32 or i64, got {ty!r}")
        wide |= (ty == "i64") << j
    function, block, shared, hidden = launch_shape(kernel)
    return NativeKernel(function, block, shared, wide, hidden)


def launch_shape(kernel: Any) -> tuple[int, int, int, int]:
    """How ``cuLaunchKernel`` takes a Triton ``CompiledKernel`` (its module loaded here): its
    ``CUfunction``, threads per program, dynamic shared memory bytes and the count of trailing
    pointer parameters the compiler added."""
    md = kernel.metadata
    if hasattr(kernel, "_init_handles"):
        kernel._init_handles()
    hidden = int(hasattr(md, "global_scratch_size")) + int(hasattr(md, "profile_scratch_size"))
    shared = int(getattr(kernel, "shared", None) or md.shared)
    return int(kernel.function), 32 * int(md.num_warps), shared, hidden


@functools.cache
def triton_version() -> str:
    return str(triton.__version__)
