"""The e2e workloads (what each sends, the working set the pool defaults are sized from), the
targets' verdicts, the CPU dtype choice and the paired runs."""

import numpy as np
import pytest

import kvoffload as kvo
from kvoffload.bench.e2e.runner import dtype as dtypes
from kvoffload.bench.e2e.runner.targets import Target, restored_vs_gpu_all, targets
from kvoffload.bench.e2e.runner.workload import ChatShape, DocShape, Workload

BS = 16


def full_block_keys(workload: Workload, vocab: int = 4096) -> set[bytes]:
    """Every full block's key any request (prompt and answer) computes."""
    keys: set[bytes] = set()
    for t in workload.turns(vocab, seed=3):
        keys.update(kvo.prefix_block_keys(np.concatenate([t.prompt, t.answer]), BS))
    return keys


@pytest.mark.parametrize(
    "workload",
    [
        Workload("chat", chat=ChatShape(3, 4, 40, 24, 20)),
        Workload("fits", chat=ChatShape(5, 3, 64, 16, 16)),
        Workload("docs", docs=DocShape(4, 50, 12, 20, 16, 8)),
        Workload("docs", docs=DocShape(3, 64, 9, 0, 16, 16)),
        Workload("mixed", chat=ChatShape(3, 2, 32, 20, 12), unique_share=0.4),
    ],
    ids=str,
)
def test_distinct_blocks_counts_the_working_set(workload):
    """The pool defaults are sized from distinct_blocks: it must be the number of different full
    blocks the requests compute (a shared system prompt or document counted once)."""
    assert workload.distinct_blocks(BS) == len(full_block_keys(workload))


def test_chat_turns_extend_their_own_history():
    shape = ChatShape(2, 3, 32, 16, 8)
    w = Workload("chat", chat=shape)
    turns = w.turns(1000, seed=1)
    assert [(t.conversation, t.index) for t in turns[:3]] == [(0, 1), (1, 1), (0, 2)]
    first, second = turns[0], turns[2]
    history = np.concatenate([first.prompt, first.answer])
    assert np.array_equal(second.prompt[: len(history)], history)
    assert len(second.prompt) == shape.prompt_tokens(2)
    assert not first.returning and second.returning
    assert w.requests() == len(turns) == 6


def test_docs_requests_share_their_document_and_count_its_uses():
    shape = DocShape(documents=3, document_tokens=40, requests=20, system_tokens=8,
                     question_tokens=12, answer_tokens=4)  # fmt: skip
    turns = Workload("docs", docs=shape).turns(1000, seed=2)
    assert len(turns) == 20
    seen: dict[int, int] = {}
    for t in turns:
        seen[t.conversation] = seen.get(t.conversation, 0) + 1
        assert t.index == seen[t.conversation]  # the how-many-th use of that document
        assert len(t.prompt) == shape.request_tokens
    by_doc: dict[int, np.ndarray] = {}
    for t in turns:  # one document: the same system + document tokens every time
        by_doc.setdefault(t.conversation, t.prompt[:48])
        assert np.array_equal(by_doc[t.conversation], t.prompt[:48])
    assert len(set(seen)) > 1 and any(t.returning for t in turns)


def test_mixed_inserts_unique_prompts_among_the_chat():
    w = Workload("mixed", chat=ChatShape(4, 3, 32, 16, 8), unique_share=0.25)
    turns = w.turns(1000, seed=4)
    unique = [t for t in turns if t.conversation == -1]
    assert len(unique) == w.unique_requests() == 4 and len(turns) == w.requests() == 16
    chat = [t for t in turns if t.conversation >= 0]
    assert [(t.conversation, t.index) for t in chat] == [
        (c, i) for i in (1, 2, 3) for c in range(4)
    ]
    assert all(len(t.prompt) == w.mean_prompt_tokens() for t in unique)


def test_workloads_reject_bad_shapes():
    with pytest.raises(ValueError, match="expected a workload in"):
        Workload("rag", chat=ChatShape(1, 1, 0, 1, 0))
    with pytest.raises(ValueError, match="expected a DocShape"):
        Workload("docs", chat=ChatShape(1, 1, 0, 1, 0))
    with pytest.raises(ValueError, match="unique_share"):
        Workload("mixed", chat=ChatShape(1, 1, 0, 1, 0), unique_share=1.0)
    with pytest.raises(ValueError, match="requests > 0"):
        DocShape(1, 16, 0, 0, 4, 4)


def _records(mode_ttft: dict[tuple[int, int], tuple[float, int]]) -> list[dict[str, object]]:
    return [
        {"round": 0, "conversation": c, "turn": t, "ttft_ms": ms, "host_hit_tokens": host}
        for (c, t), (ms, host) in mode_ttft.items()
    ]


def test_restored_requests_are_compared_with_the_same_requests_in_gpu_all():
    kvo_records = _records({(0, 2): (12.0, 32), (1, 2): (30.0, 32), (0, 1): (99.0, 0)})
    ideal = _records({(0, 2): (10.0, 0), (1, 2): (20.0, 0), (0, 1): (5.0, 0)})
    modes = {"kvoffload": {"records": kvo_records}, "gpu_all": {"records": ideal}}
    # p50 of restored (12, 30) = 21 over the same requests in gpu_all (10, 20) = 15
    value, limit, bound = restored_vs_gpu_all(modes, "p50", 1.1)
    assert value == pytest.approx(21 / 15) and (limit, bound) == (1.1, "gpu_all")
    assert restored_vs_gpu_all({"kvoffload": modes["kvoffload"]}, "p50", 1.1)[0] is None


def test_targets_say_met_not_met_or_not_measured():
    result = {
        "workloads": {
            "fits": {
                "modes": {
                    "gpu": {"turns_per_s": 20.0, "ttft_ms": {"p99": 40.0}},
                    "kvoffload": {"turns_per_s": 19.9, "ttft_ms": {"p99": 43.0}},
                }
            }
        },
        "zero_reuse": {"overhead_turns_per_s": {"kvoffload": 0.02}},
        "verify": [{"ok": True}, {"ok": False}],
    }
    got = {t["name"]: t for t in targets(result)}
    assert got["fits: turns/s cost"]["met"] is True  # 0.5% <= 1%
    assert got["fits: p99 cost"]["met"] is False  # 7.5% > 5%
    assert got["zero reuse: turns/s cost"]["met"] is False
    assert got["bit-exact sampled turns"]["met"] is False  # 1 of 2
    line = Target(**{k: v for k, v in got["fits: p99 cost"].items() if k != "met"}).line()
    assert line == "fits: p99 cost: +7.5% (target <= 5%): NOT met"
    missing = Target("chat: restored p50 / gpu_all", None, 1.10, True, "x")
    assert missing.met is None
    assert missing.line().endswith(
        "not measured (chat in --workloads, kvoffload and gpu_all in --modes)"
    )


X86_AVX2 = """processor : 0
vendor_id : AuthenticAMD
flags : fpu vme sse sse2 avx avx2 fma bmi2
"""
X86_BF16 = "flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 amx_tile\n"
ARM_BF16 = "Features\t: fp asimd evtstrm aes sha2 crc32 atomics bf16 i8mm sve\n"
ARM_PLAIN = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid\n"


@pytest.mark.parametrize(
    ("cpuinfo", "machine", "native"),
    [
        (X86_AVX2, "x86_64", False),
        (X86_BF16, "x86_64", True),
        ("flags : avx512f amx_bf16\n", "AMD64", True),
        (ARM_BF16, "aarch64", True),
        (ARM_PLAIN, "aarch64", False),
        (ARM_BF16, "x86_64", False),  # an ARM word on an x86 machine is not an x86 flag
    ],
)
def test_native_bf16_is_read_from_the_cpu_flags(cpuinfo, machine, native):
    flags = dtypes.cpu_flags(cpuinfo.splitlines())
    assert dtypes.native_bf16_from_flags(flags, machine) is native


def test_dtype_resolution(monkeypatch):
    assert dtypes.resolve("auto", "cuda") == "bfloat16"
    assert dtypes.resolve("float32", "cuda") == "float32"
    monkeypatch.setattr(dtypes, "native_bf16", lambda: False)
    assert dtypes.resolve("auto", "cpu") == "float32"
    monkeypatch.setattr(dtypes, "native_bf16", lambda: True)
    assert dtypes.resolve("auto", "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="expected a dtype in"):
        dtypes.resolve("fp8", "cpu")
