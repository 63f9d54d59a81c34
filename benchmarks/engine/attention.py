"""Attention over the paged cache: gather the blocks of a request, then SDPA.

Why not a paged Triton kernel: a kernel that reads blocks in place can at best save the gather
(one extra read and write of the context's K and V per layer); ``kvoffload bench e2e`` measures the
gather and the SDPA call apart, per mode, and on the shapes we run the gather is a small share of
TTFT (see docs/e2e.md for the measured numbers), so SDPA's FlashAttention kernel stays.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from benchmarks.engine.kv_cache import PagedKVCache
from benchmarks.engine.model import Attend
from benchmarks.engine.timing import SectionTimer


def paged_attend(
    cache: PagedKVCache,
    table: torch.Tensor,
    start: int,
    positions: torch.Tensor,
    timer: SectionTimer,
) -> Attend:
    """An ``attend`` for tokens at ``positions`` (= start .. start + n - 1) of one request whose
    blocks are ``table`` (int64, on the cache's device)."""
    bs = cache.block_size
    slots = table[positions // bs] * bs + positions % bs
    n = positions.shape[0]
    length = start + n

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache.write(layer, slots, k, v)
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
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if n == 1:  # one query sees every key
        out = F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    elif start == 0:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    else:
        mask = causal_lower_right(n, length)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
