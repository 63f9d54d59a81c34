"""The native core's GPU-side readiness on the GPU: waits enqueued before the copy starts,
layer gates inside a captured CUDA graph, and no hang when a kernel is loaded lazily while waits
are pending (issue 25).

Each load is held back on the GPU (ordered after a sleeping stream) and its destination blocks are
poisoned first, so a flag written too early shows as poisoned bytes read on the waiting stream.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from kvoffload.store.arena import HostArena
from kvoffload.transfer.backend import CopyBackend
from kvoffload.transfer.cuda.staged import NativeGate, NativeStagedBackend
from kvoffload.transfer.cuda.staged_config import StagedConfig
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.pinning import cuda_pin
from kvoffload.transfer.planner import RoutedGate
from kvoffload.transfer.registry import make_backend
from kvoffload.transfer.shapes import LAYOUTS, MODELS, engine_tensors
from kvoffload.transfer.spec import TransferSpec

pytestmark = pytest.mark.gpu
POOL = 12
SLEEP_CYCLES = 200_000_000  # ~100 ms of GPU sleep: the load starts after every wait is enqueued


def fine(kv: KVLayout, coupled: bool = False) -> StagedConfig:
    """A slice per layer where possible, two DMA streams, tiny areas: many chunks per slice
    (``coupled``: each chunk's copy and scatter on its area's DMA stream)."""
    return StagedConfig(
        staging_bytes=2 * kv.slot_bytes,
        depth=2,
        first_chunk_bytes=1,
        dma_streams=2,
        layer_slice_bytes=8,
        max_layer_slices=1024,
        layer_slice_transfer_bytes=1,
        load_coupled=coupled,
    )


@pytest.fixture(scope="module", params=[(m, lay) for m in MODELS for lay in LAYOUTS], ids=str)
def engine(request):
    model, layout = request.param
    tensors, block_dim = engine_tensors(
        MODELS[model], layout, POOL, 16, lambda s: torch.zeros(s, dtype=torch.int16, device="cuda")
    )
    kv = KVLayout.from_tensors(tensors, block_size=16, block_dim=block_dim)
    arena = HostArena(POOL, kv.slot_bytes, pin=cuda_pin)
    arena.slots[:] = np.random.default_rng(5).integers(1, 256, arena.slots.shape, dtype=np.uint8)
    yield tensors, block_dim, kv, arena
    arena.close()


def layer_bytes(kv: KVLayout, arena: HostArena, slots: list[int], layer: int) -> np.ndarray:
    group = kv.groups[0]
    regions = group.layer_regions(layer)
    first, end = group.offsets[regions.start], group.offsets[regions.stop - 1]
    end += group.regions[regions.stop - 1].page_bytes  # a layer's regions are adjacent
    return arena.slots[slots][:, first:end]


def as_bytes(got: torch.Tensor, block_dim: int, n: int) -> np.ndarray:
    return got.movedim(block_dim, 0).contiguous().view(torch.uint8).cpu().numpy().reshape(n, -1)


def held_load(backend, tensors, block_dim, dest, slots, **submit):
    """Poison ``dest``, then submit its load behind ~100 ms of GPU sleep. The kernels the test
    launches later are launched once first: a kernel's first launch loads its module, which
    waits for the device to go idle (here: for the sleep). ``submit``: the submit's options."""
    index = torch.tensor(dest, device="cuda")
    for t in tensors:  # -1 never occurs in the arena's bytes (1..255 each)
        t.index_fill_(block_dim, index, -1)
        t.index_select(block_dim, index)
    torch.cuda.synchronize()
    late = torch.cuda.Stream()
    with torch.cuda.stream(late):
        torch.cuda._sleep(SLEEP_CYCLES)
    slept = torch.cuda.Event()
    slept.record(late)
    pending = backend.submit([TransferSpec.of("load", dest, slots)], order_after=late, **submit)
    return index, slept, pending


@pytest.mark.parametrize("config", ["default", "fine", "fine-coupled", "background"])
def test_layer_waits_are_enqueued_before_the_copy_starts_and_order_each_layer(engine, config):
    """... also for a load the core's thread enqueues (``background``): each wait_on waits on
    the host for its layer's slice to be enqueued only, never for the copy."""
    tensors, block_dim, kv, arena = engine
    group = kv.groups[0]
    chosen = None if config in ("default", "background") else fine(kv, config == "fine-coupled")
    backend = NativeStagedBackend(kv, arena, config=chosen)
    try:
        dest, slots = [7, 2, 9, 4, 11], [3, 8, 0, 5, 10]
        bg = config == "background"
        index, slept, pending = held_load(backend, tensors, block_dim, dest, slots, background=bg)
        side = torch.cuda.Stream()
        seen, host = [], []
        for layer in range(group.num_layers):
            t0 = time.perf_counter()
            pending.wait_on(side, layer=layer)
            host.append(time.perf_counter() - t0)
            with torch.cuda.stream(side):
                seen.append(tensors[layer].index_select(block_dim, index))  # layer i = tensor i
        assert not slept.query(), "a wait_on blocked the host until the copy could start"
        side.synchronize()
        assert pending.wait(30) and pending.error() is None
        for layer, got in enumerate(seen):
            want = layer_bytes(kv, arena, slots, layer)
            assert np.array_equal(as_bytes(got, block_dim, len(dest)), want), f"layer {layer}"
        print(f"wait_on host time: median {1e6 * float(np.median(host)):.1f} us")
    finally:
        backend.close()


def test_a_stall_timer_reads_each_layers_wait_on_the_device(engine):
    """A load held behind ~100 ms of GPU sleep, waited for layer by layer through a timed
    waiter: the host never blocks; every layer's bytes are exact; the stream stood ~the sleep at
    the first layer's wait and ~nothing at the layers after it (not readable where every stream
    shares one hardware queue, ``CUDA_DEVICE_MAX_CONNECTIONS=1``)."""
    from kvoffload.transfer.stall import StallTimer

    tensors, block_dim, kv, arena = engine
    layers = kv.groups[0].num_layers
    backend = NativeStagedBackend(kv, arena)
    try:
        dest, slots = [7, 2, 9, 4, 11], [3, 8, 0, 5, 10]
        index, slept, pending = held_load(backend, tensors, block_dim, dest, slots)
        side = torch.cuda.Stream()
        timer = StallTimer(layers)
        waiter = pending.layer_waiter(side, layers, timer)
        seen, host = [], []
        for layer in range(layers):
            t0 = time.perf_counter()
            waiter(layer)
            host.append(time.perf_counter() - t0)
            with torch.cuda.stream(side):
                seen.append(tensors[layer].index_select(block_dim, index))
        assert not slept.query(), "a timed wait blocked the host until the copy could start"
        side.synchronize()
        assert pending.wait(30) and pending.error() is None
        for layer, got in enumerate(seen):
            want = layer_bytes(kv, arena, slots, layer)
            assert np.array_equal(as_bytes(got, block_dim, len(dest)), want), f"layer {layer}"
        stalls = timer.stalls()
        assert all(s is not None for s in stalls), stalls
        first = float(stalls[0] or 0.0)
        if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() != "1":
            # (one hardware queue for every stream: the timer's first event queues behind the
            # sleep, so the stall happens before it and it reads ~0; docs/transfer.md,
            # "twentieth round")
            assert first >= 0.03, stalls  # the sleep (~100 ms) less the enqueue before it ran
            assert sum(float(s or 0.0) for s in stalls[1:]) < first, stalls
        print(
            f"timed waiter host time: median {1e6 * float(np.median(host)):.1f} us, "
            f"first stall {1e3 * first:.1f} ms"
        )
    finally:
        backend.close()


@pytest.mark.parametrize("kind", ["native", "auto", "background"])
def test_a_gate_inside_a_captured_graph_orders_each_layer_every_step(engine, kind):
    """The per-layer waits are captured once in a CUDA graph (fixed addresses); each step opens
    the gate for that step's load (or none) and replays: bytes exact, no hang, three times.
    ``auto`` (the planner): its gate is the native engine's, so the native engine's loads open
    layer by layer (until 2026-11-26 it was the plain gate: every replay waited for the whole
    load); a load the planner gave another backend is waited for whole. ``background``: each load
    enqueued by the core's thread (the gate's open waits on the host for that enqueue)."""
    tensors, block_dim, kv, arena = engine
    group = kv.groups[0]
    layers = group.num_layers
    backend: CopyBackend
    if kind in ("native", "background"):
        backend = NativeStagedBackend(kv, arena, config=fine(kv))
    else:
        backend = make_backend("auto", kv, arena)
    try:
        gate = backend.layer_gate(layers)
        if kind == "auto":
            assert isinstance(gate, RoutedGate) and isinstance(gate.inner, NativeGate)
        dest = [7, 2, 9]
        index = torch.tensor(dest, device="cuda")
        outs = [tensors[i].index_select(block_dim, index) for i in range(layers)]
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            for i in range(layers):
                gate.wait(torch.cuda.current_stream(), i)
                outs[i].copy_(tensors[i].index_select(block_dim, index))
        for step, slots in enumerate(([3, 8, 0], None, [10, 5, 1])):
            pendings = []
            if slots is not None:
                bg = {"background": True} if kind == "background" else {}
                _, _slept, pending = held_load(backend, tensors, block_dim, dest, slots, **bg)
                pendings.append(pending)
            gate.open(stream, pendings)
            with torch.cuda.stream(stream):
                graph.replay()
            stream.synchronize()
            if slots is None:
                continue
            assert pendings[0].wait(30) and pendings[0].error() is None
            for i in range(layers):
                want = layer_bytes(kv, arena, slots, i)
                got = as_bytes(outs[i], block_dim, len(dest))
                assert np.array_equal(got, want), f"step {step} layer {i}"
    finally:
        backend.close()


LAZY = textwrap.dedent(
    """
    import sys
    import numpy as np, torch
    from kvoffload.store.arena import HostArena
    from kvoffload.transfer.cuda.staged import NativeGate, NativeStagedBackend
    from kvoffload.transfer.layout import KVLayout
    from kvoffload.transfer.pinning import cuda_pin
    from kvoffload.transfer.shapes import MODELS, engine_tensors
    from kvoffload.transfer.spec import TransferSpec

    n = 256
    tensors, dim = engine_tensors(MODELS["llama3-8b"], "page", n, 16,
                                  lambda s: torch.zeros(s, dtype=torch.int16, device="cuda"))
    kv = KVLayout.from_tensors(tensors, block_size=16, block_dim=dim)
    arena = HostArena(n, kv.slot_bytes, pin=cuda_pin)
    arena.slots[:] = 7
    backend = NativeStagedBackend(kv, arena)
    background = sys.argv[1] == "background"
    late = torch.cuda.Stream()
    with torch.cuda.stream(late):
        torch.cuda._sleep(400_000_000)
    pending = backend.submit([TransferSpec.of("load", list(range(n)), list(range(n)))],
                             order_after=late, background=background)
    side = torch.cuda.Stream()
    pending.wait_on(side, layer=31)
    with torch.cuda.stream(side):  # kernels never launched before: loaded now, lazily
        x = torch.arange(1000, device="cuda", dtype=torch.float64)
        y = torch.special.i1e(x) + torch.special.bessel_j1(x) + torch.special.erfcx(x)
        z = tensors[31][:4].clone()
    side.synchronize()
    assert pending.wait(60) and pending.error() is None
    assert bool((z.view(torch.uint8) == 7).all()), "layer 31 not loaded"
    backend.close()
    print("ok", float(y.sum()))
    """
)


@pytest.mark.parametrize("connections", ["default", "1"])
@pytest.mark.parametrize("handover", ["inline", "background"])
def test_a_kernel_loaded_lazily_while_waits_are_pending_does_not_hang(handover, connections):
    """... also for a load the core's thread enqueues (``background``): the layer's wait first
    waits on the host for its slice's enqueue, so no GPU wait stands ahead of its copies. And
    with one hardware queue for every stream (``CUDA_DEVICE_MAX_CONNECTIONS=1``, as some
    training and serving stacks set): there a stream's unmet wait holds the kernels other streams
    enqueue after it (``benchmarks/queue_probe.py``, H100, 2026-11-28), so a wait enqueued ahead
    of the load's scatter would never pass."""
    env = dict(os.environ, CUDA_MODULE_LOADING="LAZY")
    if connections != "default":
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = connections
    done = subprocess.run(
        [sys.executable, "-c", LAZY, handover],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("ok")
