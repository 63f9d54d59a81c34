"""``PagedEngine``: one request at a time, chunked prefill of the uncached suffix, greedy decode.

Modes: ``recompute`` (no prefix cache: every prompt is computed from token 0), ``gpu`` (prefix
cache in the GPU block pool), ``gpu_all`` (the same with a pool that never evicts: the ideal a host
tier can approach) and ``kvoffload`` (GPU prefix cache, then kvoffload's host tier for the blocks
the pool has evicted).

A turn is ``run(prompt, answer)``: TTFT is the time from the call to the first token id on the
host (lookup, loads, prefill, sampling). ``answer`` tokens are then appended in one more prefill
pass (the KV a chat answer leaves in the cache, without decoding it token by token); ``decode``
instead samples greedily.

A host hit is restored layer by layer (``Offload.load == "layered"``): the load is submitted and
prefill starts at once; layer i's attention waits only for layer i's blocks (on a GPU the compute
stream waits, the host never does), so the copy of layer i + 1 runs under layer i's compute. The
load's result is checked before the first token is used; a failed load is recomputed.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvoffload import prefix_block_keys
from kvoffload.bench.e2e.runner.admission import Admission, Pairs
from kvoffload.bench.e2e.runner.attention import paged_attend
from kvoffload.bench.e2e.runner.beside import MODE as BESIDE
from kvoffload.bench.e2e.runner.beside import BesideCopy
from kvoffload.bench.e2e.runner.block_pool import BlockKey, BlockPool
from kvoffload.bench.e2e.runner.calls import total as total_calls
from kvoffload.bench.e2e.runner.graphs import GraphRunner
from kvoffload.bench.e2e.runner.host_tier import HostTier, Load, slot_runs
from kvoffload.bench.e2e.runner.kv_cache import PagedKVCache
from kvoffload.bench.e2e.runner.model import Model
from kvoffload.bench.e2e.runner.offload_mode import Offload
from kvoffload.bench.e2e.runner.timing import HostClock, SectionTimer

MODES = ("recompute", "gpu", "gpu_all", BESIDE, "kvoffload")
Staged = tuple[torch.Tensor, ...]  # a prefill chunk's inputs uploaded ahead (eager; graphs: ())


@dataclass
class TurnResult:
    first_token: int
    logits: torch.Tensor  # float32 [vocab], on the CPU: the first token's logits
    tokens: list[int]  # greedy tokens after the first (``decode`` steps)
    ttft: float  # seconds
    prompt_tokens: int
    gpu_hit_tokens: int
    host_hit_tokens: int
    computed_tokens: int  # prompt tokens prefilled
    load_seconds: float | None  # the host-tier load's device time; None: not timed (a CPU)
    layer_waits: list[float]  # per layer: how long its attention waited for its blocks (exposed)
    host: dict[str, float]  # host seconds inside TTFT per step (``HostClock``)
    sections: dict[str, float] = field(default_factory=dict)  # device time inside TTFT
    blocks: list[int] = field(default_factory=list)  # the request's block table, in order
    graph: str = "eager"  # how the forward ran: eager, piecewise or full (``graphs.py``)
    # host seconds and call count per kvoffload call during the request (``calls.py``)
    kvo_calls: dict[str, tuple[float, int]] = field(default_factory=dict)
    load_bytes: int = 0  # bytes restored from host
    kvo_ttft_s: float = 0.0  # host seconds inside kvoffload calls before the first token
    kvo_ttft_calls: dict[str, tuple[float, int]] = field(default_factory=dict)  # those, per call
    load_runs: int = 0  # runs of consecutive host slots the load read (``slot_runs``)
    beside_bytes: int = 0  # mode gpu_all_copy: bytes copied beside the forward (``beside.py``)
    # host ms from the prefill's start to each layer's attention (first chunk; none in full graphs)
    layer_launch_ms: list[float] = field(default_factory=list)
    # host ms in the prefill's layer waits, their timing sections included
    wait_host_ms: float = 0.0


class PagedEngine:
    """A paged-attention model runner over one pool of ``cache``'s blocks, in one ``mode``."""

    def __init__(
        self,
        model: Model,
        cache: PagedKVCache,
        mode: str,
        host: HostTier | None = None,
        chunk_tokens: int = 2048,
        offload: Offload | None = None,
        pool_blocks: int | None = None,
        first_block: int = 0,
        graphs: GraphRunner | None = None,
        beside: BesideCopy | None = None,
    ) -> None:
        """``pool_blocks`` (default: all) of the cache's blocks from ``first_block`` on are this
        engine's GPU pool. ``graphs``: run the forward as CUDA graphs (``graphs.py``; captured
        already, and shared by every engine of the run); None: eager. ``beside``: mode
        ``gpu_all_copy``'s side copy, of ``beside_bytes`` per request (``beside.py``)."""
        if mode not in MODES:
            raise ValueError(f"expected a mode in {MODES}, got {mode!r}")
        if (mode == "kvoffload") != (host is not None):
            raise ValueError(f"expected a host tier exactly in mode 'kvoffload', got mode {mode!r}")
        if (mode == BESIDE) != (beside is not None):
            raise ValueError(f"expected a side copy exactly in mode {BESIDE!r}, got mode {mode!r}")
        if chunk_tokens <= 0:
            raise ValueError(f"expected chunk_tokens > 0, got {chunk_tokens}")
        pool_blocks = cache.num_blocks - first_block if pool_blocks is None else pool_blocks
        if first_block < 0 or not 0 < pool_blocks <= cache.num_blocks - first_block:
            raise ValueError(
                f"expected pool_blocks in [1, {cache.num_blocks - first_block}] (the cache's "
                f"{cache.num_blocks} blocks from first_block {first_block} on), got {pool_blocks}"
            )
        self.model = model
        self.cache = cache
        self.mode = mode
        self.host = host
        self.chunk_tokens = chunk_tokens
        self.offload = offload or Offload()
        self.graphs = graphs
        self.graph = graphs.mode if graphs is not None else "eager"
        self.beside, self.beside_bytes = beside, 0
        self.wait_host_s = 0.0  # host seconds in the layer waits (call and timing), this request
        self.pool = BlockPool(pool_blocks, first_block)
        self.timer = SectionTimer(model.device)
        self.late_stores = 0  # blocks stored only when the pool was about to reuse them
        self.admission = Admission(self.offload.admission, pool_blocks)
        self._held: dict[str, list[int]] = {}  # finished requests' blocks, until their jobs end
        self._unstored: dict[int, BlockKey] = {}  # "evict": admitted blocks not stored yet
        self._storing: dict[str, list[int]] = {}  # "evict": store job -> the blocks it reads
        self._store_of: dict[int, str] = {}  # "evict": block -> the store job reading it
        self._largest = 0  # the most blocks one request has allocated
        self._allocated = 0  # blocks the current request has allocated
        self._ids = itertools.count()

    def run(
        self,
        prompt: Sequence[int] | np.ndarray,
        answer: Sequence[int] | np.ndarray = (),
        decode: int = 0,
        cache: bool = True,
    ) -> TurnResult:
        """One request. ``cache=False`` reads the prefix caches but adds nothing to them."""
        t0 = time.perf_counter()
        tokens = np.asarray(prompt, dtype=np.int64)
        if tokens.ndim != 1 or not len(tokens):
            raise ValueError(f"expected a non-empty 1-D prompt, got shape {tokens.shape}")
        if len(answer) and decode:
            raise ValueError("expected answer tokens or decode steps, got both")
        req = f"req{next(self._ids)}"
        host_time = HostClock(t0)
        if self.host is not None:
            self.host.calls.take()  # from here on, this request's kvoffload calls
        self._allocated = 0
        self._settle()
        bs = self.cache.block_size
        keys = prefix_block_keys(tokens, bs) if self.mode != "recompute" else []
        reusable = keys[: (len(tokens) - 1) // bs]  # the last token is always computed
        blocks = self.pool.match(reusable)
        gpu_hit = loaded = len(blocks)  # blocks [gpu_hit, loaded) come from host
        host_time.mark("match")
        load = None
        restore: tuple[Sequence[BlockKey], list[int]] | None = None
        if self.host is not None and len(reusable) > gpu_hit:
            held = self.host.lookup(reusable[gpu_hit:])
            host_time.mark("lookup")
            if held:
                new = self._allocate(held)
                host_time.mark("allocate")
                restore = (reusable[gpu_hit : gpu_hit + held], new)
                blocks += new
                loaded += held
        blocks += self._allocate(-(-len(tokens) // bs) - len(blocks))
        host_time.mark("allocate")
        staged = None
        if restore is not None and self.host is not None:
            # the inputs first, then the load (as vLLM: prepare inputs, start_load_kv, forward):
            # an input copy enqueued after the load's copies would wait behind them
            with self.timer.section("stage"):  # GPU time: a wait enqueued here shows
                staged = self._stage(tokens, loaded * bs, blocks)
            host_time.mark("launch")
            with self.timer.section("load_submit"):
                bg = self.offload.load == "layered" and self.offload.load_handover == "background"
                load = self.host.start_load(req, *restore, background=bg)
            host_time.mark("load_submit")
        elif self.beside is not None and self.beside_bytes:  # as kvoffload's load, minus ours
            with self.timer.section("stage"):
                staged = self._stage(tokens, loaded * bs, blocks)
            host_time.mark("launch")
            with self.timer.section("load_submit"):
                self.beside.start(self.beside_bytes)
            host_time.mark("load_submit")
        layered = load is not None and self.offload.load == "layered"
        if load is not None and not layered:
            ok = self._finish_load(load)
            host_time.mark("load_wait")
            if not ok:
                blocks, loaded = self._recompute_instead(req, blocks, gpu_hit, loaded)
                staged = None
        self.timer.take_stamps()
        self.wait_host_s, t_prefill = 0.0, time.perf_counter()
        logits = self._prefill(tokens, loaded * bs, blocks, load if layered else None, staged)
        host_time.mark("launch")  # prefill enqueued (on a CPU: computed)
        layers = self.model.config.layers  # the first chunk's layers, from the prefill's start
        stamps = [(t - t_prefill) * 1e3 for t in self.timer.take_stamps()[:layers]]
        if self.host is not None:  # host work while the device computes
            self.host.end_waits(load)
            self._store_ahead(background=self.offload.store_handover == "background")
        host_time.mark("store_ahead")
        # The first token, then the load's result (the forward waited for all of it: no polling)
        first = int(logits.argmax())
        host_time.mark("token")  # the device's rest of the forward and the token's read
        if layered and load is not None and not self._finish_load(load):
            blocks, loaded = self._recompute_instead(req, blocks, gpu_hit, loaded)
            logits = self._prefill(tokens, loaded * bs, blocks)
            first = int(logits.argmax())
        ttft = time.perf_counter() - t0
        host_time.mark("first_token")  # checking the load (recomputing a failed one)
        if cache and loaded > gpu_hit:  # the bench's prefix pool, after the token as _publish is
            self.pool.cache(blocks[gpu_hit:loaded], reusable[gpu_hit:loaded])
        ttft_calls = self.host.calls.peek() if self.host is not None else {}
        kvo_ttft = total_calls(ttft_calls)
        sections = self.timer.collect()
        seq, out = tokens, []
        if len(answer):  # launched before the stores, so their host-side work overlaps it
            seq = np.concatenate([tokens, np.asarray(answer, dtype=np.int64)])
            blocks += self._allocate(-(-len(seq) // bs) - len(blocks))
            self._prefill(seq, len(tokens), blocks)
        if cache and self.mode != "recompute":
            parent = keys[-1] if keys else None
            keys = [*keys, *prefix_block_keys(seq[len(keys) * bs :], bs, parent=parent)]
            self._publish(req, blocks, keys, gpu_hit, loaded, self._admit(keys, loaded))
        token = first
        for _ in range(decode):
            if len(seq) % bs == 0:
                blocks += self._allocate(1)
            step = self._forward(np.array([token]), len(seq), blocks)
            seq = np.append(seq, token)
            token = int(step.argmax())
            out.append(token)
        self.timer.collect()
        self._finish(req, blocks)
        calls = self.host.calls.take() if self.host is not None else {}
        return TurnResult(
            first,
            logits.cpu(),
            out,
            ttft,
            len(tokens),
            gpu_hit * bs,
            (loaded - gpu_hit) * bs,
            len(tokens) - loaded * bs,
            self._load_seconds(load) if loaded > gpu_hit else 0.0,
            self.host.layer_waits(load, sections, layers)
            if self.host is not None and load is not None and layered and self.offload.time_waits
            else [],
            host_time.seconds,
            sections,
            blocks,
            self.graph,
            calls,
            (loaded - gpu_hit) * self.cache.block_bytes,
            kvo_ttft,
            ttft_calls,
            slot_runs(load.specs) if load is not None else 0,
            self.beside_bytes if self.beside is not None else 0,
            stamps,
            self.wait_host_s * 1e3,
        )

    def drop_gpu_cache(self) -> int:
        """Evict every cached block of the GPU pool (storing first what the policy would store
        before an eviction, and waiting for every copy in flight)."""
        if self._unstored:
            self._store_now(list(self._unstored))
        self.idle()
        return self.pool.drop_cached()

    def idle(self) -> None:
        """Wait until no copy is in flight and every finished request's blocks are free."""
        if self.host is not None:
            for req in [*self._held, *self._storing]:
                self.host.wait_settled(req)
        if self.beside is not None:
            self.beside.sync()
        self._settle()

    # -- loads ---------------------------------------------------------------------------------

    def _finish_load(self, load: Load) -> bool:
        assert self.host is not None
        return self.host.finish_load(load)

    def _recompute_instead(
        self, req: str, blocks: list[int], gpu_hit: int, loaded: int
    ) -> tuple[list[int], int]:
        """A failed load: its blocks stay held until nothing copies into them (the request
        settles); fresh blocks take their place, to be recomputed from ``gpu_hit``."""
        self._held.setdefault(req, []).extend(blocks[gpu_hit:loaded])
        fresh = self._allocate(loaded - gpu_hit)
        return [*blocks[:gpu_hit], *fresh, *blocks[loaded:]], gpu_hit

    def _load_seconds(self, load: Load | None) -> float | None:
        """The load's duration on the device, from its submit to its last byte (CUDA events).
        None on a CPU: the copy runs on a thread the API gives no completion time for (the
        engine sees it done only when it looks), so only the waits are timed there."""
        if load is None or load.start is None or load.end is None:
            return None
        load.end.synchronize()
        return float(load.start.elapsed_time(load.end)) / 1e3

    # -- stores --------------------------------------------------------------------------------

    def _admit(self, keys: Sequence[BlockKey], reused: int) -> bool:
        """Whether this request's blocks go to host (``admission.py``); an earlier request not
        stored that it admits goes too."""
        if self.host is None:
            return False
        admitted, earlier = self.admission.admit(keys, reused)
        self._promote(earlier)
        return admitted

    def _publish(
        self,
        req: str,
        blocks: list[int],
        keys: Sequence[BlockKey],
        gpu_hit: int,
        loaded: int,
        store: bool,
    ) -> None:
        """Blocks from ``loaded`` on were computed: cache their full ones on the GPU, and if
        ``store``, send the request's blocks to host (now, or before the pool evicts them).

        The whole prefix goes, not only the new blocks: blocks this request reused from the GPU
        cache may never have reached the host (their first request was not admitted, e.g. a
        conversation's first turn), and a hole there would cut every later host hit short. Keys
        the host holds already are skipped by the Offloader; blocks just loaded from it are not
        offered again.
        """
        hi = len(keys)
        if hi <= loaded:
            return
        self.pool.cache(blocks[loaded:hi], keys[loaded:hi])
        if self.host is not None and not store:
            self.admission.remember(keys[0], list(zip(blocks[:hi], keys[:hi], strict=True)))
        if self.host is None or not store:
            return
        if self.offload.store == "behind":
            self.host.store(req, keys[:hi], blocks[:hi])
            return
        for i in itertools.chain(range(gpu_hit), range(loaded, hi)):
            if self.pool.key_of(blocks[i]) == keys[i]:  # the block that caches this key
                self._unstored[blocks[i]] = keys[i]

    def _promote(self, pairs: Pairs) -> None:
        """An earlier request not stored was admitted after all: its blocks the pool still caches
        go to host as an admitted request's would."""
        cached = [(b, k) for b, k in pairs if self.pool.key_of(b) == k]
        if not cached:
            return
        self._unstored.update(cached)
        if self.offload.store == "behind":  # now, tracked as the stores before an eviction are
            self._store_now([b for b, _ in cached])

    def _store_ahead(self, background: bool = False) -> None:
        """``store == "evict"``: store admitted blocks near the head of the free queue.
        ``background``: kvoffload's thread enqueues their copies (the caller is about to wait
        for the device, not launch)."""
        if not self._unstored:
            return
        lead = int(self.offload.store_lead * self._largest)
        due = [b for b in self.pool.head(lead) if b in self._unstored]
        if due:
            self._store_now(due)
            assert self.host is not None
            self.host.poll(background)  # one worker step: the stores start, finished jobs back

    def _store_now(self, blocks: list[int]) -> None:
        assert self.host is not None
        keys = [self._unstored.pop(b) for b in blocks]
        req = f"store{next(self._ids)}"
        if self.host.store(req, keys, blocks):
            self._storing[req] = blocks
            self._store_of.update(dict.fromkeys(blocks, req))

    # -- blocks --------------------------------------------------------------------------------

    def _allocate(self, n: int) -> list[int]:
        """``n`` blocks from the pool. With a host tier, no kvoffload call unless a block at the
        head is being stored (or must be: it waits for that store) or the pool is short of free
        blocks (it waits for held ones to settle): the request settled the rest at its start."""
        if n <= 0:
            return []
        self._allocated += n
        self._largest = max(self._largest, self._allocated)
        if self.host is None:
            self._settle()
            return self.pool.allocate(n)
        head = self.pool.head(n)
        late = [b for b in head if b in self._unstored]
        if late:  # the lead was too short: store them now, on this request's time
            self.late_stores += len(late)
            self._store_now(late)
        reading = {self._store_of[b] for b in head if b in self._store_of}
        for req in reading:
            self.host.wait_settled(req)
        if reading:
            self._settle()
        while self.pool.num_free < n and self._held:
            self.host.wait_settled(next(iter(self._held)))
            self._settle()
        return self.pool.allocate(n)

    def _finish(self, req: str, blocks: list[int]) -> None:
        self._held.setdefault(req, []).extend(blocks)
        self._settle()
        if self.host is not None:
            self._store_ahead()

    def _settle(self) -> None:
        if self.host is None:
            for req in list(self._held):
                self.pool.release(self._held.pop(req))
            return
        self.host.poll()
        for req in list(self._held):
            if self.host.is_settled(req):
                self.pool.release(self._held.pop(req))
        for req in list(self._storing):
            if self.host.is_settled(req):
                for block in self._storing.pop(req):
                    del self._store_of[block]

    # -- compute -------------------------------------------------------------------------------

    def _prefill(
        self,
        tokens: np.ndarray,
        start: int,
        blocks: list[int],
        load: Load | None = None,
        staged: Staged | None = None,
    ) -> torch.Tensor:
        """``staged``: the first chunk's inputs, uploaded already (``_stage``)."""
        logits = torch.empty(0)
        before_read = self._layer_wait(load) if load is not None else None
        for s in range(start, len(tokens), self.chunk_tokens):
            e = min(s + self.chunk_tokens, len(tokens))
            with self.timer.section("prefill"):
                first = staged if s == start else None
                logits = self._forward(tokens[s:e], s, blocks, before_read, load, first)
        return logits

    def _stage(self, tokens: np.ndarray, start: int, blocks: list[int]) -> Staged:
        """Upload the inputs of the prefill's first chunk (tokens from ``start``)."""
        e = min(start + self.chunk_tokens, len(tokens))
        if self.graphs is not None:
            self.graphs.stage(tokens[start:e], start, blocks)
            return ()
        device = self.model.device
        return (
            torch.as_tensor(tokens[start:e], device=device),
            torch.arange(start, e, device=device),
            torch.tensor(blocks, dtype=torch.int64, device=device),
        )

    def _layer_wait(self, load: Load) -> Callable[[int], None]:
        host = self.host
        assert host is not None
        if self.offload.time_waits:  # on the device, by the waits themselves (StallTimer)
            load.timer = host.stall_timer()

        def before_read(layer: int) -> None:
            t0 = time.perf_counter()
            host.wait_layer(load, layer)
            self.wait_host_s += time.perf_counter() - t0

        return before_read

    def _forward(
        self,
        tokens: np.ndarray,
        start: int,
        blocks: list[int],
        before_read: Callable[[int], None] | None = None,
        load: Load | None = None,
        staged: Staged | None = None,
    ) -> torch.Tensor:
        if self.graphs is not None:
            loads = [load] if load is not None else []
            return self.graphs.forward(
                tokens, start, blocks, self.timer, before_read, loads, staged is not None
            )
        device = self.model.device
        if staged:
            inputs, positions, table = staged
        else:
            table = torch.tensor(blocks, dtype=torch.int64, device=device)
            positions = torch.arange(start, start + len(tokens), device=device)
            inputs = torch.as_tensor(tokens, device=device)
        attend = paged_attend(self.cache, table, start, positions, self.timer, before_read)
        return self.model.forward(inputs, positions, attend)
