"""The e2e correctness check at real shapes on a GPU: KV restored from kvoffload's host tier (the
default ``auto`` backend, pinned host memory) gives bit-equal first-token logits and the same 16
greedy tokens as the prefix computed on the GPU."""

import pytest

torch = pytest.importorskip("torch")

import kvoffload as kvo  # noqa: E402
from kvoffload.bench.e2e.runner.config import model_config  # noqa: E402
from kvoffload.bench.e2e.runner.host_tier import HostTier  # noqa: E402
from kvoffload.bench.e2e.runner.kv_cache import PagedKVCache  # noqa: E402
from kvoffload.bench.e2e.runner.model import Model  # noqa: E402
from kvoffload.bench.e2e.runner.verify import check_turn  # noqa: E402
from kvoffload.bench.e2e.runner.workload import ChatShape  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["llama3-8b", "qwen2.5-7b"])
def test_restore_from_host_is_bit_exact_at_real_shapes(name):
    config = model_config(name)
    chat = ChatShape(1, 3, 2048, 512, 256)  # turn 3: a 3328-token prefix restored from host
    blocks = 3 * -(-chat.history_tokens // 16)
    model = Model(config, "cuda", seed=0)
    cache = PagedKVCache(config, blocks, 16, torch.device("cuda"))
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=blocks))
    try:
        check = check_turn(model, cache, host, chat, 3, seed=11, chunk_tokens=2048)
    finally:
        host.close()
        del model, cache
        torch.cuda.empty_cache()
    print(name, check)
    assert check["restored_host_hit_tokens"] == check["reference_gpu_hit_tokens"] > 3000
    assert check["restored_gpu_hit_tokens"] == 0
    assert check["restored_kv_bit_equal"], "the KV restored from host differs from the original"
    assert check["gpu_reference_repeats_bit_equal"], "the device does not repeat its own result"
    assert check["suffix_kv_bit_equal"] and check["decode_kv_bit_equal"]
    assert check["logits_bit_equal"] and check["greedy_tokens_equal"] and check["ok"]
    assert check["max_abs_diff_vs_full_recompute"] <= 0.1 * check["logits_abs_max"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_section_timer_reuses_its_events_and_times_each_section():
    from kvoffload.bench.e2e.runner.timing import SectionTimer

    timer = SectionTimer(torch.device("cuda"))
    torch.cuda._sleep(1000)  # the sleep kernel's module loads here, not in the first section
    torch.cuda.synchronize()
    for rounds, cycles in ((1, 2_000_000), (2, 20_000_000)):
        for _ in range(3):
            with timer.section("spin"):
                torch.cuda._sleep(cycles)
        seconds = timer.collect()["spin"]
        assert len(timer._pool) == 6  # created once, back after collect, taken again
        if rounds == 1:
            short = seconds
    assert seconds > 5 * short > 0  # each round's own sections, not the pooled events' old times
