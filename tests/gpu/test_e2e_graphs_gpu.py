"""The e2e runner's CUDA-graph modes on a GPU, at Llama-3-8B shapes: a replay gives the bits of the
same step run eagerly on the same padded shapes, and a prefix restored from kvoffload's host tier
layer by layer (piecewise: ``wait_on`` between the graphs; full: the layer gate's waits inside
the graph) gives the GPU-cached run's KV, first-token logits and 16 greedy tokens, bit for bit.

Smaller buckets than the benchmark's (chunks of 512 tokens, contexts up to 4096) keep the captures
short; the benchmark's own buckets are checked by every ``bench e2e --graph`` run
(``graph_replays`` in its JSON). Each mode checks its own conversation (``SEEDS``): the host tier
is shared, and a conversation another mode stored would restore that mode's bits
(``check_turn`` refuses it). The tests after it pin the full mode's steps apart: padded rows
write only the scratch block, and a decode step repeats its bits whatever the masked keys hold.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvoffload as kvo  # noqa: E402
from kvoffload.bench.e2e.runner.config import model_config  # noqa: E402
from kvoffload.bench.e2e.runner.graphs import GraphRunner  # noqa: E402
from kvoffload.bench.e2e.runner.host_tier import HostTier  # noqa: E402
from kvoffload.bench.e2e.runner.kv_cache import PagedKVCache  # noqa: E402
from kvoffload.bench.e2e.runner.model import Model  # noqa: E402
from kvoffload.bench.e2e.runner.verify import check_turn  # noqa: E402
from kvoffload.bench.e2e.runner.workload import ChatShape  # noqa: E402

pytestmark = pytest.mark.gpu

CHUNK = 512
CONTEXT = 4096
CHAT = ChatShape(1, 3, 1024, 256, 128)  # turn 3: a 1792-token prefix restored, 4 chunks
SEEDS = {"piecewise": 11, "full": 12}  # a conversation per mode: one host tier holds both


@pytest.fixture(scope="module")
def rig():
    config = model_config("llama3-8b")
    blocks = 3 * -(-CHAT.history_tokens // 16) + 1  # the last: the graphs' scratch block
    model = Model(config, "cuda", seed=0)
    cache = PagedKVCache(config, blocks, 16, torch.device("cuda"))
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=blocks))
    try:
        yield model, cache, host
    finally:
        host.close()
        del model, cache
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def runners(rig):
    """The captured runners by mode, each captured once for the module (released before the
    rig's host tier closes)."""
    out: dict[str, GraphRunner] = {}
    yield out
    out.clear()


def _runner(rig, runners, mode):
    if mode in runners:
        return runners[mode]
    model, cache, host = rig
    full = mode == "full"
    runner = GraphRunner(
        model,
        cache,
        mode,
        CHUNK,
        CONTEXT,
        cache.num_blocks - 1,
        host.layer_gate() if full else None,
        host.open_layers if full else None,
    )
    runner.capture()
    runners[mode] = runner
    return runner


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_graphs_replay_the_eager_step_and_restore_bit_exact(rig, runners, mode):
    model, cache, host = rig
    runner = _runner(rig, runners, mode)
    replays = runner.check_replays()
    print(mode, f"capture {runner.capture_s:.1f} s", replays)
    assert len(replays) == 3 and all(r["logits_bit_equal"] for r in replays), replays
    check = check_turn(
        model, cache, host, CHAT, 3, seed=SEEDS[mode], chunk_tokens=CHUNK, graphs=runner
    )
    print(mode, check)
    assert check["graph"] == mode
    assert check["restored_host_hit_tokens"] == check["reference_gpu_hit_tokens"] > 1500
    assert check["restored_kv_bit_equal"], "the KV restored from host differs from the original"
    assert check["gpu_reference_repeats_bit_equal"], "a replay does not repeat its own result"
    assert check["suffix_kv_bit_equal"] and check["decode_kv_bit_equal"]
    assert check["logits_bit_equal"] and check["greedy_tokens_equal"] and check["ok"]
    assert check["max_abs_diff_vs_full_recompute"] <= 0.1 * check["logits_abs_max"]


def _changed_slots(before, cache):
    """(layer, block, offset) of every token slot whose K or V differs from ``before``."""
    out = set()
    for layer, (old, new) in enumerate(zip(before, cache.tensors, strict=True)):
        diff = (old != new).any(dim=0).flatten(2).any(-1)  # [blocks, block_size]
        out |= {(layer, int(b), int(o)) for b, o in diff.nonzero().tolist()}
    return out


def test_full_graph_padded_rows_write_only_the_scratch_block(rig, runners):
    """A replayed step of 31 tokens (bucket 32) over a cache full of other bytes: the K/V of its
    own positions land in its blocks' slots, its padded row only in the scratch block."""
    from kvoffload.bench.e2e.runner.timing import SectionTimer

    model, cache, _ = rig
    runner = _runner(rig, runners, "full")
    bs, scratch, layers = cache.block_size, runner.scratch, range(len(cache.tensors))
    for t in cache.tensors:
        t.normal_()
    before = [t.clone() for t in cache.tensors]
    start, n = bs + 3, 31
    blocks = [7, 2, 40, 11]
    tokens = np.random.default_rng(2).integers(0, model.config.vocab, n)
    timer = SectionTimer(model.device)
    runner.forward(tokens, start, blocks, timer)
    timer.collect()
    own = {(i, blocks[p // bs], p % bs) for i in layers for p in range(start, start + n)}
    changed = _changed_slots(before, cache)
    del before
    assert changed - {(i, scratch, 0) for i in layers} == own
    assert {(i, scratch, 0) for i in layers} <= changed  # the padded row


def test_full_graph_decode_step_repeats_whatever_the_masked_keys_hold(rig, runners):
    """A replayed decode step (bucket 1) gives the same logits and K/V, bit for bit, ten times,
    with other bytes (NaN) each time in every key it must not see: the rest of its last block,
    a block past it in the table, the scratch block. (The full check's reference repeats.)"""
    from kvoffload.bench.e2e.runner.timing import SectionTimer

    model, cache, _ = rig
    runner = _runner(rig, runners, "full")
    bs = cache.block_size
    start = 2000  # context bucket 2048: a table of 128 blocks, the last the scratch block
    blocks = [*range(-(-(start + 1) // bs)), 200]  # 126 blocks, and one past the step's
    last, off = blocks[start // bs], start % bs
    for t in cache.tensors:
        t[:, blocks].normal_()
    timer = SectionTimer(model.device)
    got = []
    try:
        for i in range(10):
            for t in cache.tensors:
                t[:, last, off + 1 :] = float("nan") if i % 2 else i
                t[:, [200, runner.scratch]] = float("nan") if i % 2 else -i
            logits = runner.forward(np.array([17]), start, blocks, timer)
            kv = torch.stack([t[:, last, off] for t in cache.tensors])
            got.append((logits, kv))
        timer.collect()
    finally:  # no NaN left for a later step's masked SDPA (prefill) to multiply by 0
        for t in cache.tensors:
            t[:, [last, 200, runner.scratch]] = 0
    assert all(torch.equal(g[0], got[0][0]) and torch.equal(g[1], got[0][1]) for g in got)
    assert torch.isfinite(got[0][0]).all()


@pytest.mark.parametrize("b", [1, 2, 256])
def test_full_attention_repeats_its_bits(rig, b):
    """``static_attention`` (what each full graph runs per layer) at Llama-3-8B's heads, ten
    times on the same real keys with other bytes in the masked ones each time: the same bits.
    One query is the float32 decode form; more queries are SDPA's (prefill, which the checks
    found repeatable)."""
    from kvoffload.bench.e2e.runner.graphs import static_attention

    model, _, _ = rig
    c, dev = model.config, model.device
    gen = torch.Generator(dev).manual_seed(b)
    ctx = 3072
    q = torch.randn(b, c.heads, c.head_size, generator=gen, device=dev).bfloat16()
    k, v = (
        torch.randn(ctx, c.kv_heads, c.head_size, generator=gen, device=dev).bfloat16()
        for _ in range(2)
    )
    positions = torch.arange(2000, 2000 + b, device=dev)
    mask = torch.arange(ctx, device=dev)[None, :] <= positions[:, None]
    outs = []
    for _ in range(10):
        k[2000 + b :].normal_(generator=gen)
        v[2000 + b :].normal_(generator=gen)
        outs.append(static_attention(q, k, v, mask))
    assert all(torch.equal(o, outs[0]) for o in outs)
