"""The e2e correctness check on CPU: first-token logits with the prefix restored from kvoffload's
host tier equal, bit for bit, those with the same prefix computed on the device, and 16 greedy
tokens after them are identical (``kvoffload/bench/e2e/runner/verify.py``)."""

import pytest

torch = pytest.importorskip("torch")

import kvoffload as kvo  # noqa: E402
from kvoffload.bench.e2e.runner.config import model_config  # noqa: E402
from kvoffload.bench.e2e.runner.host_tier import HostTier  # noqa: E402
from kvoffload.bench.e2e.runner.kv_cache import PagedKVCache  # noqa: E402
from kvoffload.bench.e2e.runner.model import Model  # noqa: E402
from kvoffload.bench.e2e.runner.verify import check_turn  # noqa: E402
from kvoffload.bench.e2e.runner.workload import ChatShape  # noqa: E402


@pytest.mark.parametrize(
    ("name", "chat", "turn", "chunk"),
    [
        ("micro", ChatShape(1, 3, 40, 24, 20), 3, 32),  # prefix ends mid-block, several chunks
        ("tiny", ChatShape(1, 2, 256, 128, 64), 2, 512),
    ],
)
def test_restored_prefix_gives_bit_equal_logits_and_tokens(name, chat, turn, chunk):
    config = model_config(name)
    model = Model(config, "cpu", seed=1)
    blocks = 3 * -(-chat.history_tokens // 16)
    cache = PagedKVCache(config, blocks, 16, torch.device("cpu"))
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=blocks))
    try:
        check = check_turn(model, cache, host, chat, turn, seed=7, chunk_tokens=chunk)
    finally:
        host.close()
    history = chat.prompt_tokens(turn - 1) + chat.answer_tokens
    assert check["reference_gpu_hit_tokens"] == history // 16 * 16
    assert check["restored_host_hit_tokens"] == check["reference_gpu_hit_tokens"]
    assert check["restored_gpu_hit_tokens"] == 0
    assert check["restored_kv_bit_equal"] and check["suffix_kv_bit_equal"]
    assert check["decode_kv_bit_equal"] and check["gpu_reference_repeats_bit_equal"]
    assert check["logits_bit_equal"] and check["greedy_tokens_equal"] and check["ok"]
    assert check["first_token_mismatch"] is None
    # the logits are those of this prompt: a full recompute lands close (chunking aside)
    assert check["max_abs_diff_vs_full_recompute"] <= 0.05 * check["logits_abs_max"]


def test_a_wrong_restore_is_caught(monkeypatch):
    """The same check, with host slots overwritten between store and load: not equal."""
    config = model_config("micro")
    model = Model(config, "cpu", seed=1)
    chat = ChatShape(1, 2, 48, 24, 24)
    cache = PagedKVCache(config, 24, 16, torch.device("cpu"))
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=24))
    real_load = host.start_load

    def corrupting_load(req_id, keys, blocks, **how):
        host.local.arena.slots[:] ^= 0x40  # flip one bit of every byte held on host
        return real_load(req_id, keys, blocks, **how)

    monkeypatch.setattr(host, "start_load", corrupting_load)
    try:
        check = check_turn(model, cache, host, chat, 2, seed=3, chunk_tokens=64)
    finally:
        host.close()
    assert check["restored_host_hit_tokens"] > 0
    assert not check["restored_kv_bit_equal"] and not check["logits_bit_equal"]
    assert not check["ok"]


def test_check_turn_rejects_turn_one():
    config = model_config("micro")
    model = Model(config, "cpu")
    cache = PagedKVCache(config, 8, 16, torch.device("cpu"))
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=8))
    try:
        with pytest.raises(ValueError, match="turn in"):
            check_turn(model, cache, host, ChatShape(1, 2, 16, 16, 16), 1, 0, 64)
    finally:
        host.close()
