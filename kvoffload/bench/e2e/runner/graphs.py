"""CUDA-graph modes of the model runner, beside the eager one (``--graph``).

- ``eager``: every op launched from Python (``Model.forward``, ``attention.paged_attend``).
- ``piecewise``, as vLLM runs whenever a connector restores layer by layer: the dense parts
  between two attentions are CUDA graphs, one set per padded token count (a *bucket*): embed and
  layer 0's norm, q/k/v and RoPE; layer i's out-projection and MLP with layer i + 1's norm, q/k/v
  and RoPE; the last MLP with the LM head. Attention (``paged_attend``, as in eager) and
  kvoffload's per-layer wait (``TransferWorker.layer_waiter``) run eagerly between them.
- ``full``: the whole forward of a (token bucket, context bucket) is one graph, with kvoffload's
  per-layer restore waits inside it (``LayerGate.wait`` before each layer's attention, opened
  once per step by ``LayerGate.open`` before the replay). Attention reads static device tensors
  (token slots, block table, positions), padded: the table to the context bucket with a scratch
  block, padded tokens write their K/V to the scratch block, and a causal mask from the
  positions hides every key past a query's position (``static_attention``, SDPA with a boolean
  mask: the memory-efficient kernel, not eager's FlashAttention; a decode step, one query, takes
  eager's float32 ``decode_attention`` with that mask instead: SDPA's decode is not
  bit-repeatable on an H100).

Every graph is captured at start, before any transfer, on a side stream after a warm-up there,
into one memory pool, largest bucket first (as vLLM does); ``capture_error_mode="thread_local"``
because kvoffload's native threads make driver calls while we capture. ``CUDAGraph.capture_begin``
and ``capture_end`` directly, which is what ``torch.cuda.graph`` does less its synchronize and
cache emptying before each of the hundreds of captures (and, where enabled, a ``gc.collect``).
Inputs go to static buffers through one pinned host-to-device copy per step (one int64 buffer:
tokens, positions, slots, block table, the last token's row); the graph's logits are cloned out
before the next step. Padded rows compute on token 0 at position 0 and are never read.

Bit-exactness: a replay gives the same bits as the same step run eagerly on the same padded
shapes (``check_replays``, in every e2e result). Against the eager mode the bits differ (other
GEMM shapes; in ``full`` another attention kernel), so the correctness check compares a restored
turn with the GPU-cached one *within* a mode: both run the same bucket, hence the same graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kvoffload.bench.e2e.runner.attention import decode_attention, paged_attend
from kvoffload.bench.e2e.runner.kv_cache import PagedKVCache
from kvoffload.bench.e2e.runner.model import Model
from kvoffload.bench.e2e.runner.timing import SectionTimer

GRAPHS = ("eager", "piecewise", "full")
SMALL_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # then every BUCKET_STEP tokens
BUCKET_STEP = 128  # tokens: padding at most 127 tokens of dense compute above 256
CONTEXT_STEP = 1024  # tokens: full graphs per context length of at most this many more keys

# Before layer ``i`` reads the cache (eager and piecewise): kvoffload's per-layer wait.
BeforeRead = Callable[[int], None]
# Once per step before a full graph's replay: open the layer gate for these loads' jobs.
OpenLayers = Callable[[Any, Sequence[Any]], None]


def token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts with a graph each: 1, 2, 4, ..., 256, then multiples of 128, up to
    and including ``max_tokens`` (the prefill chunk)."""
    if max_tokens <= 0:
        raise ValueError(f"expected max_tokens > 0, got {max_tokens}")
    out = [b for b in SMALL_BUCKETS if b < max_tokens]
    out += range(SMALL_BUCKETS[-1] + BUCKET_STEP, max_tokens, BUCKET_STEP)
    return [*out, max_tokens]


def context_buckets(max_context: int, block_size: int, step: int = CONTEXT_STEP) -> list[int]:
    """Padded context lengths (keys) with a full graph each: multiples of ``step`` (rounded up
    to whole blocks) up to the first that holds ``max_context``."""
    step = -(-step // block_size) * block_size
    return list(range(step, -(-max_context // step) * step + 1, step))


def bucket(value: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if b >= value:
            return b
    raise ValueError(f"expected at most {buckets[-1]} (the largest bucket), got {value}")


@dataclass(frozen=True)
class Inputs:
    """Views of the runner's one static int64 device buffer."""

    tokens: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    slots: torch.Tensor  # [B] flat token slots in the cache (padded rows: the scratch block)
    table: torch.Tensor  # [T] block table (padded: the scratch block)
    last: torch.Tensor  # [1] the last real token's row


class GraphRunner:
    """The forward of ``model`` over ``cache`` in graph mode ``mode`` (``piecewise`` or
    ``full``): ``capture()`` once at start, then ``forward`` per step.

    ``scratch_block``: a cache block no pool uses (padded tokens' K/V land there).
    ``max_context``: the longest request (prompt + answer or decode steps), for ``full``.
    ``gate``: ``full`` only, kvoffload's ``LayerGate`` (``HostTier.layer_gate``) and ``open``
    its per-step opening (``HostTier.open_layers``). ``capture=False`` runs the same static steps
    eagerly (for CPU tests of the plumbing; the benchmark refuses graph modes without CUDA).
    """

    def __init__(
        self,
        model: Model,
        cache: PagedKVCache,
        mode: str,
        max_tokens: int,
        max_context: int,
        scratch_block: int,
        gate: Any = None,
        open_layers: OpenLayers | None = None,
        capture: bool = True,
        context_step: int = CONTEXT_STEP,
        time_waits: bool = True,
    ) -> None:
        if mode not in GRAPHS[1:]:
            raise ValueError(f"expected a graph mode in {GRAPHS[1:]}, got {mode!r}")
        if capture and model.device.type != "cuda":
            raise ValueError(
                f"--graph {mode} captures CUDA graphs: expected a CUDA device, got {model.device}"
            )
        if mode == "full" and (gate is None or open_layers is None):
            raise ValueError("expected a layer gate and open_layers for the full-graph mode")
        if not 0 <= scratch_block < cache.num_blocks:
            raise ValueError(
                f"expected a scratch block in [0, {cache.num_blocks}), got {scratch_block}"
            )
        self.model, self.cache, self.mode = model, cache, mode
        self.gate, self.open_layers, self.capturing = gate, open_layers, capture
        # full: timing events captured around each layer's wait (timestamp nodes, which cost a
        # replay ~15 us a layer more while the link is busy: gate_graph_probe, H200)
        self.time_waits = time_waits
        self.scratch = scratch_block
        self.buckets = token_buckets(max_tokens)
        self.contexts = context_buckets(
            max(max_context, max_tokens), cache.block_size, context_step
        )
        c, dev, b_max = model.config, model.device, self.buckets[-1]
        t_max = self.contexts[-1] // cache.block_size
        self._host = np.zeros(3 * b_max + t_max + 1, dtype=np.int64)
        self._ints = torch.zeros(self._host.shape[0], dtype=torch.int64, device=dev)
        ints = self._ints
        self.inputs = Inputs(
            ints[:b_max], ints[b_max : 2 * b_max], ints[2 * b_max : 3 * b_max],
            ints[3 * b_max : 3 * b_max + t_max], ints[-1:],
        )  # fmt: skip
        dt = model.dtype
        self.x = torch.zeros(b_max, c.hidden, dtype=dt, device=dev)
        self.qk = torch.zeros(b_max, c.heads + c.kv_heads, c.head_size, dtype=dt, device=dev)
        self.v = torch.zeros(b_max, c.kv_heads, c.head_size, dtype=dt, device=dev)
        self.o = torch.zeros(b_max, c.heads, c.head_size, dtype=dt, device=dev)
        self.cos = torch.zeros(b_max, 1, c.head_size, dtype=torch.float32, device=dev)
        self.sin = torch.zeros_like(self.cos)
        self.logits = torch.zeros(c.vocab, dtype=torch.float32, device=dev)
        self.keys = torch.arange(self.contexts[-1], device=dev)  # key index, for the mask
        self._pieces: dict[int, list[Any]] = {}  # piecewise: bucket -> a graph per piece
        self._full: dict[tuple[int, int], Any] = {}  # full: (bucket, context) -> graph
        self._wait_events: dict[tuple[int, int], list[tuple[Any, Any]]] = {}
        self.capture_s = 0.0

    # -- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        tokens: np.ndarray,
        start: int,
        blocks: Sequence[int],
        timer: SectionTimer,
        before_read: BeforeRead | None = None,
        loads: Sequence[Any] = (),
        staged: bool = False,
    ) -> torch.Tensor:
        """Logits (float32 [vocab], a copy) of the last of ``tokens`` at positions ``start..``
        of a request whose blocks are ``blocks``. piecewise: ``before_read(layer)`` runs before
        each layer's attention; full: ``open_layers(stream, loads)`` before the replay.
        ``staged``: ``stage`` already uploaded these inputs."""
        n = len(tokens)
        b = bucket(n, self.buckets)
        if not staged:
            self.stage(tokens, start, blocks)
        if self.mode == "piecewise":
            return self._run_pieces(b, n, start, timer, before_read)
        ctx = bucket(start + n, self.contexts)
        assert self.open_layers is not None
        with timer.section("gate_open"):  # the stream's wait at the open, if any (GPU time)
            self.open_layers(self._stream(), loads)
        if not self.capturing:
            self._full_step(b, ctx)
            return self.logits.clone()
        graph = self._full.get((b, ctx))
        if graph is None:
            raise ValueError(f"expected a full graph for {b} tokens over {ctx} keys, got none")
        graph.replay()
        for layer, (s, e) in enumerate(self._wait_events.get((b, ctx), ())):
            timer.add(f"wait{layer}", s, e)  # a second replay before collect: counted once
        return self.logits.clone()

    def stage(self, tokens: np.ndarray, start: int, blocks: Sequence[int]) -> None:
        """Upload a step's inputs (``forward`` does it unless told ``staged``). An engine does
        this before it starts the step's loads, as vLLM's runner prepares its inputs before
        ``start_load_kv``: a host-to-device copy enqueued after a load's copies waits behind them
        on the copy engine, and the forward's first kernel with it (``copy_queue_probe.py``)."""
        b = bucket(len(tokens), self.buckets)
        if self.mode == "piecewise":
            self._load(tokens, start, blocks, b, len(blocks))
        else:
            ctx = bucket(start + len(tokens), self.contexts)
            self._load(tokens, start, blocks, b, ctx // self.cache.block_size)

    def _stream(self) -> Any:
        return torch.cuda.current_stream() if self.model.device.type == "cuda" else None

    def _load(
        self, tokens: np.ndarray, start: int, blocks: Sequence[int], b: int, table: int
    ) -> None:
        """This step's inputs into the static buffer: one host-to-device copy."""
        n, bs = len(tokens), self.cache.block_size
        b_max, t_max = self.buckets[-1], self.inputs.table.shape[0]
        if len(blocks) > t_max:
            raise ValueError(
                f"expected a request of at most {t_max} blocks (the runner's max_context), "
                f"got {len(blocks)}"
            )
        h = self._host
        h[:b].fill(0)
        h[:n] = tokens
        pos = np.arange(start, start + n)
        h[b_max : b_max + b].fill(0)
        h[b_max : b_max + n] = pos
        ids = np.asarray(blocks, dtype=np.int64)
        h[2 * b_max : 2 * b_max + b].fill(self.scratch * bs)
        h[2 * b_max : 2 * b_max + n] = ids[pos // bs] * bs + pos % bs
        t0 = 3 * b_max
        h[t0 : t0 + t_max].fill(self.scratch)
        used = min(len(ids), table)
        h[t0 : t0 + used] = ids[:used]
        h[-1] = n - 1
        # A synchronous copy from pageable memory (tens of KiB, as the eager path's inputs).
        # Through ``pin_memory()`` (torch's caching host allocator) and a non-blocking copy, the
        # engine's next kernels were held on the device until a load submitted after the copy
        # had moved its last byte: 10.6 ms of a 10.5 ms load, piecewise docs, H200 (device time
        # of the events around ``start_load``, ``device_ms["load_submit"]``); with this copy
        # 0.45 ms, and the restored TTFT 22.1 -> 13.8 ms (benchmarks/results/
        # e2e_stage_bisect_*).
        self._ints.copy_(torch.from_numpy(h))

    # -- piecewise -------------------------------------------------------------------------------

    def _run_pieces(
        self, b: int, n: int, start: int, timer: SectionTimer, before_read: BeforeRead | None
    ) -> torch.Tensor:
        layers = len(self.model.layers)
        pieces = self._pieces.get(b) if self.capturing else None
        if self.capturing and pieces is None:
            raise ValueError(f"expected piecewise graphs for {b} tokens, got none (not captured)")
        table = self.inputs.table
        attend = paged_attend(
            self.cache, table, start, self.inputs.positions[:n], timer, before_read
        )
        for i in range(layers + 1):
            if pieces is None:
                self._piece(i, b)
            else:
                pieces[i].replay()
            if i < layers:
                c = self.model.config
                q, k = self.qk[:n, : c.heads], self.qk[:n, c.heads :]
                self.o[:n].copy_(attend(i, q, k, self.v[:n]))
        return self.logits.clone()

    def _piece(self, i: int, b: int) -> None:
        """Piece ``i`` at bucket ``b``: layer i - 1's post-attention part (none for i = 0: the
        embedding), then layer i's pre-attention part (none for the last: the LM head)."""
        m, x = self.model, self.x[:b]
        if i == 0:
            e, cos, sin = m.embed_rope(self.inputs.tokens[:b], self.inputs.positions[:b])
            x.copy_(e)
            self.cos[:b].copy_(cos)
            self.sin[:b].copy_(sin)
        else:
            x.copy_(m.post(i - 1, x, self.o[:b]))
        if i < len(m.layers):
            q, k, v = m.pre(i, x, self.cos[:b], self.sin[:b])
            c = m.config
            self.qk[:b, : c.heads].copy_(q)
            self.qk[:b, c.heads :].copy_(k)
            self.v[:b].copy_(v)
        else:
            self.logits.copy_(m.head(x.index_select(0, self.inputs.last)))

    # -- full ------------------------------------------------------------------------------------

    def _full_step(self, b: int, ctx: int, events: list[tuple[Any, Any]] | None = None) -> None:
        """The whole forward at bucket ``b`` over ``ctx`` keys, from the static buffers."""
        c, inp = self.model.config, self.inputs
        blocks = ctx // self.cache.block_size
        mask = self.keys[:ctx][None, :] <= inp.positions[:b, None]  # [b, ctx], causal
        layers = len(self.model.layers)
        stream = self._stream()
        for i in range(layers + 1):
            self._piece(i, b)
            if i == layers:
                break
            k, v = self.qk[:b, c.heads :], self.v[:b]
            self.cache.write(i, inp.slots[:b], k, v)
            if events is not None:
                events[i][0].record()
            self.gate.wait(stream, i)
            if events is not None:
                events[i][1].record()
            kv = self.cache.tensors[i][:, inp.table[:blocks]]  # [2, blocks, bs, kv, hd]
            kv = kv.view(2, ctx, c.kv_heads, c.head_size)
            self.o[:b].copy_(static_attention(self.qk[:b, : c.heads], kv[0], kv[1], mask))

    # -- capture ---------------------------------------------------------------------------------

    def capture(self) -> None:
        """Capture every graph (no-op with ``capture=False``). Call before any transfer."""
        if not self.capturing:
            return
        import time

        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.model.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        layers = len(self.model.layers)
        with torch.inference_mode():
            for b, ctx in self.shapes():  # largest first: the pool's blocks get reused
                self._dummy(b, ctx)
                with torch.cuda.stream(side):  # warm-up where the capture will run
                    if self.mode == "piecewise":
                        for i in range(layers + 1):
                            self._piece(i, b)
                    else:
                        assert self.open_layers is not None
                        self.open_layers(side, ())
                        self._full_step(b, ctx)
                side.synchronize()
                if self.mode == "piecewise":
                    self._pieces[b] = [
                        self._graph(side, pool, self._piece, i, b) for i in range(layers + 1)
                    ]
                    continue
                events = self._events(layers) if self.time_waits else None
                self._full[(b, ctx)] = self._graph(side, pool, self._full_step, b, ctx, events)
                self._wait_events[(b, ctx)] = events or []
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0

    def shapes(self) -> list[tuple[int, int]]:
        """What ``capture`` captures, largest first: piecewise, (bucket, bucket) per token bucket;
        full, (bucket, context) for every context a step of that bucket can have (at least one
        more token than the bucket below)."""
        out = []
        for j in reversed(range(len(self.buckets))):
            b = self.buckets[j]
            if self.mode == "piecewise":
                out.append((b, b))
                continue
            fewest = self.buckets[j - 1] + 1 if j else 1
            out += [(b, ctx) for ctx in reversed(self.contexts) if ctx >= fewest]
        return out

    def _graph(self, stream: Any, pool: Any, step: Callable[..., None], *args: Any) -> Any:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            g.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                step(*args)
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the capture is invalid anyway; the
                    g.capture_end()  # step's own error is the one to see
                raise
            g.capture_end()
        return g

    def _events(self, layers: int) -> list[tuple[Any, Any]]:
        """Timing events recorded inside a full graph around each layer's wait: event record
        nodes (``external=True``, torch >= 2.9). RuntimeError where torch has none."""
        try:
            make = [
                torch.cuda.Event(enable_timing=True, external=True)  # type: ignore[no-untyped-call]
                for _ in range(2 * layers)
            ]
        except TypeError as err:
            raise RuntimeError(
                f"--graph full times each layer's wait with events inside the graph "
                f"(torch.cuda.Event(external=True), torch >= 2.9); torch {torch.__version__} "
                f"has none: {err}"
            ) from err
        return list(zip(make[::2], make[1::2], strict=True))

    def _dummy(self, b: int, ctx: int) -> None:
        """Valid inputs for a warm-up and capture at bucket ``b`` over ``ctx`` keys: token 0 at
        positions 0..b - 1, every slot and table entry in the scratch block."""
        blocks = [self.scratch] * max(1, -(-ctx // self.cache.block_size))
        self._load(np.zeros(b, dtype=np.int64), 0, blocks, b, len(blocks))
        self._host[2 * self.buckets[-1] : 2 * self.buckets[-1] + b] = (
            self.scratch * self.cache.block_size
        )
        self._ints.copy_(torch.from_numpy(self._host))

    # -- replay against eager ------------------------------------------------------------------

    def check_replays(self, cases: int = 3) -> list[dict[str, Any]]:
        """Replay against the same step run eagerly, on the same padded shapes and inputs, for
        the smallest, a middle and the largest bucket: logits bit-equal? Beside it, how far the
        eager mode's forward (unpadded, ``Model.forward``) lands from the replay. Uses the cache's
        first blocks (call at start, before any request: they are free then)."""
        if not self.capturing:
            return []
        bs, out = self.cache.block_size, []
        picks = sorted({self.buckets[0], self.buckets[len(self.buckets) // 2], self.buckets[-1]})
        rng = np.random.default_rng(0)
        timer = SectionTimer(self.model.device)
        for b in picks[:cases]:
            n = max(1, b - 1)  # a padded row, where there is room
            start = bs + 3  # mid-block, after a cached first block
            blocks = list(range(-(-(start + n) // bs)))
            tokens = rng.integers(0, self.model.config.vocab, n)
            got = []
            for graph in (False, True):
                self.capturing = graph
                got.append(self.forward(tokens, start, blocks, timer))
            self.capturing = True
            eager = self._eager_forward(tokens, start, blocks, timer)
            timer.collect()
            out.append(
                {
                    "tokens": n,
                    "bucket": b,
                    "context": bucket(start + n, self.contexts) if self.mode == "full" else None,
                    "logits_bit_equal": bool(torch.equal(got[0], got[1])),
                    "max_abs_diff_vs_eager_mode": float((eager - got[1]).abs().max()),
                    "logits_abs_max": float(got[1].abs().max()),
                }
            )
        return out

    @torch.inference_mode()
    def _eager_forward(
        self, tokens: np.ndarray, start: int, blocks: Sequence[int], timer: SectionTimer
    ) -> torch.Tensor:
        dev = self.model.device
        table = torch.tensor(list(blocks), dtype=torch.int64, device=dev)
        positions = torch.arange(start, start + len(tokens), device=dev)
        attend = paged_attend(self.cache, table, start, positions, timer)
        return self.model.forward(torch.as_tensor(tokens, device=dev), positions, attend)


def static_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Attention of ``q`` [b, heads, hd] over ``k``/``v`` [ctx, kv_heads, hd] where ``mask``
    [b, ctx] allows it: static shapes, so it can sit inside a CUDA graph.

    One query (a decode step, bucket 1): ``decode_attention`` with the mask, as the eager mode
    decodes, because SDPA's decode steps do not repeat their bits on an H100 (docs/e2e.md) and the
    correctness check compares a decode with itself bit for bit. More: SDPA, with K and V repeated
    per query head, query head h reading KV head h // group (SDPA's grouped-query path is not on
    the memory-efficient kernel; an expand and a copy, where ``repeat_interleave`` may sync)."""
    if q.shape[0] == 1:
        return decode_attention(q, k, v, mask[0])
    ctx, kv_heads, hd = k.shape
    group = q.shape[1] // kv_heads
    k, v = (x[:, :, None].expand(ctx, kv_heads, group, hd).reshape(ctx, -1, hd) for x in (k, v))
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask[None, None])
    return out.squeeze(0).transpose(0, 1)
