"""The e2e runner's graph modes on CPU: buckets, the static steps the CUDA graphs capture (run
eagerly here, ``capture=False``), the full mode's layer-gate calls, and restores through them
bit-exact. The captured graphs themselves are tested on a GPU (tests/gpu/test_e2e_graphs_gpu.py).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvoffload as kvo  # noqa: E402
from kvoffload.bench.e2e.runner.config import model_config  # noqa: E402
from kvoffload.bench.e2e.runner.engine import PagedEngine  # noqa: E402
from kvoffload.bench.e2e.runner.graphs import (  # noqa: E402
    GraphRunner,
    bucket,
    context_buckets,
    token_buckets,
)
from kvoffload.bench.e2e.runner.host_tier import HostTier  # noqa: E402
from kvoffload.bench.e2e.runner.kv_cache import PagedKVCache  # noqa: E402
from kvoffload.bench.e2e.runner.model import Model  # noqa: E402
from kvoffload.bench.e2e.runner.offload_mode import Offload  # noqa: E402
from kvoffload.bench.e2e.runner.verify import check_turn  # noqa: E402
from kvoffload.bench.e2e.runner.workload import ChatShape  # noqa: E402

MICRO = model_config("micro")


@pytest.fixture(scope="module")
def model():
    return Model(MICRO, "cpu", seed=0, dtype="float32")


class FakeGate:
    """The LayerGate contract over ``worker.wait_on`` (on a CPU the host waits): ``open`` names a
    step's loads, ``wait`` waits for that layer of each, then closes the layer again."""

    def __init__(self, worker, layers):
        self.worker, self.layers = worker, layers
        self.jobs: list[int] | None = None
        self.closed: set[int] = set()
        self.log: list[tuple[str, object]] = []

    def open(self, stream, job_ids):
        self.jobs, self.closed = list(job_ids), set()
        self.log.append(("open", tuple(job_ids)))

    def wait(self, stream, layer):
        assert self.jobs is not None and layer not in self.closed, "a wait without an open"
        for job in self.jobs:
            self.worker.wait_on(job, layer=layer)
        self.closed.add(layer)
        self.log.append(("wait", layer))


def test_buckets_pad_up_to_the_chunk():
    assert token_buckets(2048)[:9] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert token_buckets(2048)[9:12] == [384, 512, 640] and token_buckets(2048)[-1] == 2048
    assert token_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert token_buckets(300) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert context_buckets(8192, 16) == [1024 * i for i in range(1, 9)]
    assert context_buckets(100, 32, step=40) == [64, 128]  # whole blocks
    assert bucket(513, token_buckets(2048)) == 640 and bucket(1, [1, 2]) == 1
    with pytest.raises(ValueError, match="at most 64"):
        bucket(65, token_buckets(64))
    with pytest.raises(ValueError, match="max_tokens > 0"):
        token_buckets(0)


def test_graph_runner_refuses_capture_on_a_cpu_and_a_full_mode_without_gate(model):
    cache = PagedKVCache(MICRO, 8, 16, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="expected a CUDA device"):
        GraphRunner(model, cache, "piecewise", 64, 128, 7)
    with pytest.raises(ValueError, match="layer gate"):
        GraphRunner(model, cache, "full", 64, 128, 7, capture=False)
    with pytest.raises(ValueError, match="graph mode in"):
        GraphRunner(model, cache, "eager", 64, 128, 7, capture=False)
    with pytest.raises(ValueError, match="scratch block"):
        GraphRunner(model, cache, "piecewise", 64, 128, 8, capture=False)


def _static_forward(model, mode, tokens, start, blocks, gate=None, cache=None):
    cache = cache or PagedKVCache(MICRO, 16, 16, torch.device("cpu"), torch.float32)
    opens = []

    def open_layers(stream, loads):
        opens.append(list(loads))
        gate.open(stream, [])

    runner = GraphRunner(
        model, cache, mode, 64, 128, 15, gate, open_layers if gate else None, capture=False,
        context_step=32,
    )  # fmt: skip
    from kvoffload.bench.e2e.runner.timing import SectionTimer

    timer = SectionTimer(model.device)
    return runner.forward(np.asarray(tokens), start, blocks, timer), opens, cache


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_static_steps_compute_the_eager_forward_on_padded_shapes(model, mode):
    """The captured steps, run eagerly: the logits of 37 tokens after 21 cached ones (padded
    to 64 tokens, and in full to 64 keys) match the eager forward; padded rows change nothing."""
    from kvoffload.bench.e2e.runner.attention import paged_attend
    from kvoffload.bench.e2e.runner.timing import SectionTimer

    rng = np.random.default_rng(1)
    prompt = rng.integers(0, MICRO.vocab, 58)
    blocks = [3, 9, 1, 12]
    cache = PagedKVCache(MICRO, 16, 16, torch.device("cpu"), torch.float32)
    timer = SectionTimer(model.device)
    table = torch.tensor(blocks)
    first = torch.arange(0, 21)
    model.forward(torch.as_tensor(prompt[:21]), first, paged_attend(cache, table, 0, first, timer))
    rest = torch.arange(21, 58)
    want = model.forward(
        torch.as_tensor(prompt[21:]), rest, paged_attend(cache, table, 21, rest, timer)
    )
    gate = FakeGate(None, MICRO.layers) if mode == "full" else None
    got, opens, _ = _static_forward(model, mode, prompt[21:], 21, blocks, gate, cache)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if gate is not None:  # full: opened once for the step, then each layer waited on in order
        waits = [e for e in gate.log if e[0] == "wait"]
        assert opens == [[]] and waits == [("wait", i) for i in range(MICRO.layers)]
    assert not cache.tensors[0][:, 15].any() or mode == "full"  # scratch: only full pads there
    # the same step again gives the same bits (the KV it wrote is rewritten with equal values)
    again, _, _ = _static_forward(model, mode, prompt[21:], 21, blocks, gate, cache)
    assert torch.equal(again, got)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_restore_through_the_static_steps_is_bit_exact(model, mode):
    """The correctness check with the graph runner's steps (run eagerly): the prefix restored
    from host layer by layer, waited on per layer through ``layer_waiter`` (piecewise) or
    opened through kvoffload's layer gate (full; on a CPU ``open`` waits for the load whole),
    gives the GPU-cached run's KV, logits and greedy tokens, bit for bit."""
    chat = ChatShape(1, 3, 40, 24, 20)
    blocks = 3 * -(-chat.history_tokens // 16) + 1
    cache = PagedKVCache(MICRO, blocks, 16, torch.device("cpu"), torch.float32)
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=blocks))
    opened: list[list[int]] = []

    def open_layers(stream, loads):
        opened.append([load.job_id for load in loads])
        host.open_layers(stream, loads)

    full = mode == "full"
    runner = GraphRunner(
        model, cache, mode, 32, 256, blocks - 1, host.layer_gate() if full else None,
        open_layers if full else None, capture=False, context_step=64,
    )  # fmt: skip
    try:
        check = check_turn(model, cache, host, chat, 3, 7, 32, graphs=runner)
    finally:
        host.close()
    assert check["graph"] == mode and check["restored_host_hit_tokens"] > 0
    assert check["restored_kv_bit_equal"] and check["suffix_kv_bit_equal"]
    assert check["logits_bit_equal"] and check["greedy_tokens_equal"] and check["ok"]
    if full:  # every step opened the gate; the restored one's steps for its load's job
        assert opened and any(opened) and all(len(jobs) <= 1 for jobs in opened)


def test_engine_in_piecewise_mode_restores_and_attributes_its_calls(model):
    cache = PagedKVCache(MICRO, 33, 16, torch.device("cpu"), torch.float32)
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=32))
    runner = GraphRunner(model, cache, "piecewise", 64, 256, 32, capture=False)
    try:
        engine = PagedEngine(
            model, cache, "kvoffload", host, 64, Offload(admission="all"), 32, 0, runner
        )
        prompt = np.random.default_rng(11).integers(0, MICRO.vocab, 100)
        engine.run(prompt[:90])
        engine.drop_gpu_cache()
        got = engine.run(prompt)
        assert got.graph == "piecewise" and got.host_hit_tokens == 80
        calls = got.kvo_calls
        assert calls["worker.layer_waiter(layer)"][1] == MICRO.layers  # one wait per layer
        assert calls["worker.layer_waiter"][1] == 1  # bound once for the load
        assert calls["offloader.lookup"][1] == 1 and calls["offloader.schedule_load"][1] == 1
        assert "worker.step" in calls and "worker.submit" not in calls  # one call per step
        assert 0 < got.kvo_ttft_s <= sum(s for s, _ in calls.values())
        assert len(got.layer_waits) == MICRO.layers
    finally:
        host.close()


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_capture_covers_every_step_a_request_can_take(model, mode):
    cache = PagedKVCache(MICRO, 40, 16, torch.device("cpu"), torch.float32)
    gate = FakeGate(None, MICRO.layers)
    runner = GraphRunner(
        model, cache, mode, 300, 600, 39, gate, gate.open, capture=False, context_step=128
    )
    shapes = set(runner.shapes())
    assert len(shapes) == len(runner.shapes())  # each once
    for n in range(1, 301):
        for length in range(n, 601, 7):  # context: the step's tokens after start cached ones
            ctx = bucket(length, runner.contexts) if mode == "full" else bucket(n, runner.buckets)
            assert (bucket(n, runner.buckets), ctx) in shapes


class FakeGraph:
    """A captured graph's stand-in: replay runs the step eagerly."""

    def __init__(self, step, *args):
        self.step, self.args, self.replays = step, args, 0

    def replay(self):
        self.replays += 1
        self.step(*self.args)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_check_replays_compares_a_replay_with_the_eager_step_and_mode(model, mode):
    """The replay check's plumbing, with graphs that replay by running the step eagerly: equal
    bits, and the eager mode's unpadded forward close by."""
    cache = PagedKVCache(MICRO, 40, 16, torch.device("cpu"), torch.float32)
    gate = FakeGate(None, MICRO.layers)
    runner = GraphRunner(
        model, cache, mode, 64, 256, 39, gate, lambda s, loads: gate.open(s, []), capture=False,
        context_step=64,
    )  # fmt: skip
    layers = MICRO.layers
    for b, ctx in runner.shapes():
        if mode == "piecewise":
            runner._pieces[b] = [FakeGraph(runner._piece, i, b) for i in range(layers + 1)]
        else:
            runner._full[(b, ctx)] = FakeGraph(runner._full_step, b, ctx)
    runner.capturing = True  # replay through the fakes
    checks = runner.check_replays()
    assert [c["bucket"] for c in checks] == [1, 8, 64]
    assert [c["tokens"] for c in checks] == [1, 7, 63]
    assert all(c["logits_bit_equal"] for c in checks)
    assert all(c["max_abs_diff_vs_eager_mode"] <= 1e-3 * c["logits_abs_max"] for c in checks)
    replayed = (
        runner._pieces.values() if mode == "piecewise" else [[g] for g in runner._full.values()]
    )
    assert sum(g.replays for graphs in replayed for g in graphs) > 0


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_captured_steps_have_no_data_dependent_op(model, mode):
    """What a CUDA graph captures must not read a tensor's value on the host (an ``.item()``, a
    boolean mask's shape): capture refuses such ops. Run under FakeTensorMode, which has no values
    and raises on exactly those (checked on a boolean index first)."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

    cache = PagedKVCache(MICRO, 40, 16, torch.device("cpu"), torch.float32)
    gate = FakeGate(None, MICRO.layers)
    runner = GraphRunner(
        model, cache, mode, 64, 256, 39, gate, gate.open, capture=False, context_step=64
    )
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake, pytest.raises(DynamicOutputShapeException):
        ones = torch.ones(3)
        ones[ones > 0].sum()
    for b, ctx in [*runner.shapes()[:3], runner.shapes()[-1]]:  # the last: a decode step's
        runner._dummy(b, ctx)
        gate.open(None, [])
        with fake:
            if mode == "full":
                runner._full_step(b, ctx)
            else:
                for i in range(MICRO.layers + 1):
                    runner._piece(i, b)


def test_engine_in_full_mode_times_the_gate_open_and_records_it(model):
    from kvoffload.bench.e2e.runner.results import record
    from kvoffload.bench.e2e.runner.workload import Turn

    cache = PagedKVCache(MICRO, 33, 16, torch.device("cpu"), torch.float32)
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=32))
    gate = host.layer_gate()
    runner = GraphRunner(model, cache, "full", 64, 256, 32, gate, host.open_layers, capture=False)
    try:
        engine = PagedEngine(
            model, cache, "kvoffload", host, 64, Offload(admission="all"), 32, 0, runner
        )
        prompt = np.random.default_rng(12).integers(0, MICRO.vocab, 100)
        engine.run(prompt[:90])
        engine.drop_gpu_cache()
        got = engine.run(prompt)
        assert got.graph == "full" and got.host_hit_tokens == 80
        assert got.kvo_calls["gate.open"][1] == 1  # one step: the prefill of the suffix
        assert "worker.layer_waiter(layer)" not in got.kvo_calls  # no per-layer call at replay
        row = record(Turn(0, 2, prompt, prompt[:0]), got, 0)
        assert row["gate_open_ms"] > 0 and row["load_exposed_ms"] >= row["gate_open_ms"]
    finally:
        host.close()


def _changed_slots(before, cache):
    """(layer, block, offset) of every token slot whose K or V differs from ``before``."""
    out = set()
    for layer, (old, new) in enumerate(zip(before, cache.tensors, strict=True)):
        diff = (old != new).any(dim=0).flatten(2).any(-1)  # [blocks, block_size]
        out |= {(layer, int(b), int(o)) for b, o in diff.nonzero().tolist()}
    return out


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_step_writes_its_own_slots_and_padded_rows_only_the_scratch_block(model, mode):
    """Over a cache full of other requests' bytes, a step of 37 tokens (bucket 64) after 21
    cached ones writes the K/V of positions 21..57 into its blocks' slots, and its 27 padded rows
    write nothing but the scratch block (full; piecewise writes real rows only)."""
    cache = PagedKVCache(MICRO, 16, 16, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(5)
    for t in cache.tensors:
        t.copy_(torch.randn(t.shape, generator=gen))
    before = [t.clone() for t in cache.tensors]
    gate = FakeGate(None, MICRO.layers) if mode == "full" else None
    blocks = [3, 9, 1, 12]
    prompt = np.random.default_rng(1).integers(0, MICRO.vocab, 37)
    _static_forward(model, mode, prompt, 21, blocks, gate, cache)
    layers = range(MICRO.layers)
    own = {(i, blocks[p // 16], p % 16) for i in layers for p in range(21, 58)}
    scratch = {(i, 15, 0) for i in layers}  # every padded row: the scratch block's first slot
    changed = _changed_slots(before, cache)
    assert changed - scratch == own
    assert changed & scratch == (scratch if mode == "full" else set())


def test_a_step_rewrites_every_static_input_it_reads():
    """After a large step, a small one leaves no stale row in its bucket: tokens and positions 0,
    slots the scratch block's first, the whole block table rewritten (its blocks, then scratch),
    the last row its own."""
    model = Model(MICRO, "cpu", seed=0, dtype="float32")
    cache = PagedKVCache(MICRO, 40, 16, torch.device("cpu"), torch.float32)
    gate = FakeGate(None, MICRO.layers)
    runner = GraphRunner(
        model, cache, "full", 64, 256, 39, gate, gate.open, capture=False, context_step=64
    )
    rng = np.random.default_rng(3)
    runner._load(rng.integers(1, MICRO.vocab, 60), 100, list(range(20, 31)), 64, 16)
    runner._load(np.array([7, 8, 9]), 17, [5, 6], 4, 4)
    inp = runner.inputs
    assert inp.tokens[:4].tolist() == [7, 8, 9, 0]
    assert inp.positions[:4].tolist() == [17, 18, 19, 0]
    assert inp.slots[:4].tolist() == [6 * 16 + 1, 6 * 16 + 2, 6 * 16 + 3, 39 * 16]
    assert inp.table.tolist() == [5, 6] + [39] * (inp.table.shape[0] - 2)
    assert inp.last.tolist() == [2]


def test_full_decode_attention_ignores_the_bytes_of_masked_keys():
    """A full graph's decode step (one query over the padded context): what sits past the query
    (a stale block, the scratch block; here NaN and huge values) changes no bit, and it is the
    eager decode attention over the real keys."""
    from kvoffload.bench.e2e.runner.attention import decode_attention
    from kvoffload.bench.e2e.runner.graphs import static_attention

    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, 8, 16, generator=gen)
    k = torch.randn(64, 2, 16, generator=gen)
    v = torch.randn(64, 2, 16, generator=gen)
    mask = (torch.arange(64) <= 40)[None, :]
    got = static_attention(q, k, v, mask)
    k[41:], v[41:45], v[45:] = 1e30, float("nan"), float("inf")
    assert torch.equal(static_attention(q, k, v, mask), got)
    torch.testing.assert_close(got, decode_attention(q, k[:41], v[:41]), atol=1e-5, rtol=1e-5)


def test_check_turn_refuses_a_conversation_another_graph_mode_stored():
    """The GPU test's old trap, on a CPU: the same conversation checked in piecewise, then in
    full on one host tier, restores piecewise's KV under full's reference (restored KV and logits
    then differ with every copy right); check_turn refuses it, and another seed passes."""
    chat = ChatShape(1, 3, 40, 24, 20)
    model = Model(MICRO, "cpu", seed=0, dtype="float32")
    blocks = 3 * -(-chat.history_tokens // 16) + 1
    cache = PagedKVCache(MICRO, blocks, 16, torch.device("cpu"), torch.float32)
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=blocks))
    try:
        piecewise = GraphRunner(
            model, cache, "piecewise", 32, 256, blocks - 1, capture=False, context_step=64
        )
        assert check_turn(model, cache, host, chat, 3, 7, 32, graphs=piecewise)["ok"]
        full = GraphRunner(
            model, cache, "full", 32, 256, blocks - 1, host.layer_gate(), host.open_layers,
            capture=False, context_step=64,
        )  # fmt: skip
        with pytest.raises(ValueError, match="holds none of, got seed 7"):
            check_turn(model, cache, host, chat, 3, 7, 32, graphs=full)
        check = check_turn(model, cache, host, chat, 3, 8, 32, graphs=full)
        assert check["ok"] and check["decode_kv_bit_equal"]
        assert check["gpu_reference_repeats_bit_equal"]
    finally:
        host.close()
