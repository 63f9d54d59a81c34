"""The e2e runner's CUDA-graph modes on a GPU, at Llama-3-8B shapes: a replay gives the bits of the
same step run eagerly on the same padded shapes, and a prefix restored from kvoffload's host tier
layer by layer (piecewise: ``wait_on`` between the graphs; full: the layer gate's waits inside
the graph) gives the GPU-cached run's KV, first-token logits and 16 greedy tokens, bit for bit.

Smaller buckets than the benchmark's (chunks of 512 tokens, contexts up to 4096) keep the captures
short; the benchmark's own buckets are checked by every ``bench e2e --graph`` run
(``graph_replays`` in its JSON)."""

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


def _runner(rig, mode):
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
    return runner


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_graphs_replay_the_eager_step_and_restore_bit_exact(rig, mode):
    model, cache, host = rig
    runner = _runner(rig, mode)
    replays = runner.check_replays()
    print(mode, f"capture {runner.capture_s:.1f} s", replays)
    assert len(replays) == 3 and all(r["logits_bit_equal"] for r in replays), replays
    check = check_turn(model, cache, host, CHAT, 3, seed=11, chunk_tokens=CHUNK, graphs=runner)
    print(mode, check)
    assert check["graph"] == mode
    assert check["restored_host_hit_tokens"] == check["reference_gpu_hit_tokens"] > 1500
    assert check["restored_kv_bit_equal"], "the KV restored from host differs from the original"
    assert check["gpu_reference_repeats_bit_equal"], "a replay does not repeat its own result"
    assert check["suffix_kv_bit_equal"] and check["decode_kv_bit_equal"]
    assert check["logits_bit_equal"] and check["greedy_tokens_equal"] and check["ok"]
    assert check["max_abs_diff_vs_full_recompute"] <= 0.1 * check["logits_abs_max"]
