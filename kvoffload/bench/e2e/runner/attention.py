"""Attention over the paged cache: gather the blocks of a request, then SDPA.

Why not a paged Triton kernel: a kernel that reads blocks in place can at best save the gather
(one extra read and write of the context's K and V per layer); ``kvoffload bench e2e`` measures the
gather and the SDPA call apart, per mode, and on the shapes we run the gather is a small share of
TTFT (see docs/e2e.md for the measured numbers), so SDPA's FlashAttention kernel stays.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvoffload.bench.e2e.runner.kv_cache import PagedKVCache
from kvoffload.bench.e2e.runner.model import Attend
from kvoffload.bench.e2e.runner.timing import SectionTimer


def paged_attend(
    cache: PagedKVCache,
    table: torch.Tensor,
    start: int,
    positions: torch.Tensor,
    timer: SectionTimer,
    before_read: Callable[[int], None] | None = None,
) -> Attend:
    """An ``attend`` for tokens at ``positions`` (= start .. start + n - 1) of one request whose
    blocks are ``table`` (int64, on the cache's device). ``before_read(layer)`` runs right before
    a layer's attention reads the cache: a layer-by-layer restore waits there for that layer."""
    bs = cache.block_size
    slots = table[positions // bs] * bs + positions % bs
    n = positions.shape[0]
    length = start + n

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        timer.stamp()
        cache.write(layer, slots, k, v)
        if before_read is not None:
            before_read(layer)
        with timer.section("gather"):
            kc, vc = cache.gather(layer, table, length)
        with timer.section("sdpa"):
            o = sdpa(q, kc, vc, start)
        return o

    return attend


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of queries at positions start.. over keys at 0..start+n-1 (the queries sit
    at the bottom right of the score matrix). q: [n, heads, hd], k/v: [start + n, kv_heads, hd]."""
    n, length = q.shape[0], k.shape[0]
    if n == 1:
        return decode_attention(q, k, v)
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if start == 0:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    else:
        mask = causal_lower_right(n, length)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """One query over every key (or, with ``keep``, over the keys it marks), in float32 with two
    batched matmuls: the same bits on every run.

    Decode steps only serve the correctness check, which compares greedy tokens bit for bit: on an
    H100, decode steps through SDPA did not repeat themselves bit for bit (prefill did; see
    docs/e2e.md), so a step's attention is this plain float32 form instead, in every graph mode.
    q: [1, heads, hd], k/v: [length, kv_heads, hd]; ``keep``: bool [length] (the full graphs' padded
    context): a key it leaves out weighs exactly 0 and its value is zeroed first, so whatever
    bytes sit there (a stale block, the scratch block) cannot reach the result, not even a NaN.
    """
    heads, kv_heads, hd = q.shape[1], k.shape[1], q.shape[2]
    qg = q[0].float().reshape(kv_heads, heads // kv_heads, hd)  # query heads grouped by kv head
    scores = torch.bmm(qg, k.float().permute(1, 2, 0)) * hd**-0.5  # [kv_heads, group, length]
    v32 = v.float()
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
        v32 = v32.masked_fill(~keep[:, None, None], 0.0)
    out = torch.bmm(scores.softmax(-1), v32.transpose(0, 1))  # [kv_heads, group, hd]
    return out.reshape(1, heads, hd).to(q.dtype)
