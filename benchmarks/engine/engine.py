"""The engine: one request at a time, chunked prefill of the uncached suffix, greedy decode.

Modes: ``recompute`` (no prefix cache: every prompt is computed from token 0), ``gpu`` (prefix
cache in the GPU block pool) and ``kvoffload`` (GPU prefix cache, then kvoffload's host tier for
the blocks the pool has evicted: they are loaded before prefill of the rest).

A turn is ``run(prompt, answer)``: TTFT is the time from the call to the first token id on the
host (lookup, loads, prefill, sampling). ``answer`` tokens are then appended in one more prefill
pass (the KV a chat answer leaves in the cache, without decoding it token by token); ``decode``
instead samples greedily.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from benchmarks.engine.attention import paged_attend
from benchmarks.engine.block_pool import BlockKey, BlockPool
from benchmarks.engine.host_tier import HostTier
from benchmarks.engine.kv_cache import PagedKVCache
from benchmarks.engine.model import Model
from benchmarks.engine.timing import SectionTimer
from kvoffload import prefix_block_keys

MODES = ("recompute", "gpu", "kvoffload")
# Which requests' new blocks go to the host tier: "all", or "reuse": only a request that reused
# something (a GPU or host hit, or a first block it shares with an earlier request that was not
# stored), so a stream of unrelated prompts copies nothing.
ADMISSIONS = ("all", "reuse")
GHOSTS = 1 << 16  # first-block keys remembered of requests not stored


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
    load_seconds: float  # wall time waiting for the host-tier load (inside TTFT)
    sections: dict[str, float] = field(default_factory=dict)  # device time inside TTFT
    blocks: list[int] = field(default_factory=list)  # the request's block table, in order


class Engine:
    def __init__(
        self,
        model: Model,
        cache: PagedKVCache,
        mode: str,
        host: HostTier | None = None,
        chunk_tokens: int = 2048,
        admission: str = "reuse",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"expected a mode in {MODES}, got {mode!r}")
        if admission not in ADMISSIONS:
            raise ValueError(f"expected admission in {ADMISSIONS}, got {admission!r}")
        if (mode == "kvoffload") != (host is not None):
            raise ValueError(f"expected a host tier exactly in mode 'kvoffload', got mode {mode!r}")
        if chunk_tokens <= 0:
            raise ValueError(f"expected chunk_tokens > 0, got {chunk_tokens}")
        self.model = model
        self.cache = cache
        self.mode = mode
        self.host = host
        self.chunk_tokens = chunk_tokens
        self.admission = admission
        self.pool = BlockPool(cache.num_blocks)
        self._ghosts: OrderedDict[BlockKey, None] = OrderedDict()
        self.timer = SectionTimer(model.device)
        self._held: dict[str, list[int]] = {}  # finished requests' blocks, until their stores end
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
        self._settle()
        bs = self.cache.block_size
        keys = prefix_block_keys(tokens, bs) if self.mode != "recompute" else []
        reusable = keys[: (len(tokens) - 1) // bs]  # the last token is always computed
        blocks = self.pool.match(reusable)
        gpu_hit, host_hit, load_seconds = len(blocks), 0, 0.0
        if self.host is not None and len(reusable) > gpu_hit:
            held = self.host.lookup(reusable[gpu_hit:])
            if held:
                new = self._allocate(held)
                t_load = time.perf_counter()
                ok = self.host.load(req, reusable[gpu_hit : gpu_hit + held], new)
                load_seconds = time.perf_counter() - t_load
                if ok:
                    blocks += new
                    host_hit = held
                    if cache:
                        self.pool.cache(new, reusable[gpu_hit : gpu_hit + held])
                else:  # recompute them; the blocks stay held until nothing copies into them
                    self._held.setdefault(req, []).extend(new)
        done = len(blocks)
        blocks += self._allocate(-(-len(tokens) // bs) - len(blocks))
        logits = self._prefill(tokens, done * bs, blocks)
        first = int(logits.argmax())
        ttft = time.perf_counter() - t0
        sections = self.timer.collect()
        seq, out = tokens, []
        if len(answer):  # launched before the stores, so their host-side work overlaps it
            seq = np.concatenate([tokens, np.asarray(answer, dtype=np.int64)])
            blocks += self._allocate(-(-len(seq) // bs) - len(blocks))
            self._prefill(seq, len(tokens), blocks)
        if cache and self.mode != "recompute":
            parent = keys[-1] if keys else None
            keys = [*keys, *prefix_block_keys(seq[len(keys) * bs :], bs, parent=parent)]
            self._publish(req, blocks, keys, done, len(keys), self._admit(keys, done))
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
        return TurnResult(
            first,
            logits.cpu(),
            out,
            ttft,
            len(tokens),
            gpu_hit * bs,
            host_hit * bs,
            len(tokens) - done * bs,
            load_seconds,
            sections,
            blocks,
        )

    def drop_gpu_cache(self) -> int:
        """Evict every cached block of the GPU pool (after the stores in flight finish)."""
        self.idle()
        return self.pool.drop_cached()

    def idle(self) -> None:
        """Wait until no store is in flight and every finished request's blocks are free."""
        for req in list(self._held):
            if self.host is not None:
                self.host.wait_settled(req)
        self._settle()

    def _admit(self, keys: Sequence[BlockKey], reused: int) -> bool:
        """Whether this request's new blocks go to host (see ``ADMISSIONS``). Keys chain from the
        first block, so a request sharing any prefix with an earlier one shares its first key."""
        if self.host is None or self.admission == "all" or reused or not keys:
            return True
        if keys[0] in self._ghosts:
            return True
        self._ghosts[keys[0]] = None
        if len(self._ghosts) > GHOSTS:
            self._ghosts.popitem(last=False)
        return False

    def _publish(
        self, req: str, blocks: list[int], keys: Sequence[BlockKey], lo: int, hi: int, store: bool
    ) -> None:
        """New full blocks ``lo:hi`` were computed: cache them on the GPU, store them to host."""
        if self.mode == "recompute" or hi <= lo:
            return
        self.pool.cache(blocks[lo:hi], keys[lo:hi])
        if self.host is not None and store:
            # The whole prefix, not only the new blocks: blocks this request reused from the GPU
            # cache may never have reached the host (their first request was not admitted, e.g. a
            # conversation's first turn), and a hole there would cut every later host hit short.
            # Keys the host holds already are skipped by the Offloader.
            self.host.store(req, keys[:hi], blocks[:hi])

    def _prefill(self, tokens: np.ndarray, start: int, blocks: list[int]) -> torch.Tensor:
        logits = torch.empty(0)
        for s in range(start, len(tokens), self.chunk_tokens):
            e = min(s + self.chunk_tokens, len(tokens))
            with self.timer.section("prefill"):
                logits = self._forward(tokens[s:e], s, blocks)
        return logits

    def _forward(self, tokens: np.ndarray, start: int, blocks: list[int]) -> torch.Tensor:
        device = self.model.device
        table = torch.tensor(blocks, dtype=torch.int64, device=device)
        positions = torch.arange(start, start + len(tokens), device=device)
        attend = paged_attend(self.cache, table, start, positions, self.timer)
        return self.model.forward(torch.as_tensor(tokens, device=device), positions, attend)

    def _allocate(self, n: int) -> list[int]:
        if n <= 0:
            return []
        self._settle()
        while self.pool.num_free < n and self._held and self.host is not None:
            self.host.wait_settled(next(iter(self._held)))
            self._settle()
        return self.pool.allocate(n)

    def _finish(self, req: str, blocks: list[int]) -> None:
        self._held.setdefault(req, []).extend(blocks)
        self._settle()

    def _settle(self) -> None:
        for req in list(self._held):
            if self.host is None or self.host.settled(req):
                self.pool.release(self._held.pop(req))
