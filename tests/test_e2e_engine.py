"""The e2e model runner's parts on CPU at micro shapes: block pool, paged attention, chunking,
modes, and the rule that a block being stored is not reused."""

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvoffload as kvo  # noqa: E402
from kvoffload.bench.e2e.runner.attention import paged_attend, sdpa  # noqa: E402
from kvoffload.bench.e2e.runner.block_pool import BlockPool, PoolExhausted  # noqa: E402
from kvoffload.bench.e2e.runner.config import model_config  # noqa: E402
from kvoffload.bench.e2e.runner.engine import PagedEngine, TurnResult  # noqa: E402
from kvoffload.bench.e2e.runner.host_tier import HostTier  # noqa: E402
from kvoffload.bench.e2e.runner.kv_cache import PagedKVCache  # noqa: E402
from kvoffload.bench.e2e.runner.model import Model  # noqa: E402
from kvoffload.bench.e2e.runner.offload_mode import Offload  # noqa: E402
from kvoffload.bench.e2e.runner.timing import SectionTimer  # noqa: E402
from kvoffload.bench.e2e.runner.workload import ChatShape, chat_turns  # noqa: E402
from kvoffload.transfer import registry as backends  # noqa: E402
from kvoffload.transfer.host import HostBackend  # noqa: E402

MICRO = model_config("micro")


@pytest.fixture(scope="module")
def model():
    return Model(MICRO, "cpu", seed=0)


def test_pool_caches_matches_and_evicts_least_recently_freed_first():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.cache(a, [b"k0", b"k1"])
    pool.release(a)  # freed last block first: k1 is evicted before k0
    assert pool.match([b"k0", b"k1", b"k2"]) == a
    pool.release(a)
    pool.allocate(2)  # the two never-cached blocks
    assert pool.num_cached == 2 and pool.evictions == 0
    pool.allocate(1)
    assert pool.evictions == 1 and pool.match([b"k0"]) == [a[0]] and pool.match([b"k1"]) == []
    with pytest.raises(PoolExhausted):
        pool.allocate(1)


def test_pool_rejects_bad_use():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="block in use"):
        pool.release([0])
    with pytest.raises(ValueError, match="one key per block"):
        pool.cache([0], [])
    with pytest.raises(ValueError, match="num_blocks > 0"):
        BlockPool(0)


def test_paged_attention_equals_dense_causal_attention_on_scattered_blocks():
    cache = PagedKVCache(MICRO, 12, 4, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    length, start, heads, kvh, hd = 22, 13, MICRO.heads, MICRO.kv_heads, MICRO.head_size
    q = torch.randn(length, heads, hd, generator=gen).bfloat16()
    k = torch.randn(length, kvh, hd, generator=gen).bfloat16()
    v = torch.randn(length, kvh, hd, generator=gen).bfloat16()
    table = torch.tensor([7, 2, 11, 0, 5, 9])  # scattered blocks, 24 slots for 22 tokens
    timer = SectionTimer(torch.device("cpu"))
    first = torch.arange(0, start)
    paged_attend(cache, table, 0, first, timer)(1, q[:start], k[:start], v[:start])
    rest = torch.arange(start, length)
    out = paged_attend(cache, table, start, rest, timer)(1, q[start:], k[start:], v[start:])
    # the reference: every query against all keys up to its own position, in float32
    rep = heads // kvh
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(rep, 1))
    scores = scores / hd**0.5
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    want = torch.einsum("hqk,khd->qhd", probs, v.float().repeat_interleave(rep, 1))
    torch.testing.assert_close(out.float(), want[start:], atol=2e-2, rtol=2e-2)
    assert set(timer.collect()) == {"gather", "sdpa"}
    # the blocks outside the table were never written
    untouched = [b for b in range(12) if b not in table.tolist()]
    assert not cache.tensors[1][:, untouched].any()
    assert sdpa(q[:1], k[:1], v[:1], 0).shape == (1, heads, hd)


def test_rope_rotates_halves():
    from kvoffload.bench.e2e.runner.model import rope

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, 8, generator=gen)
    angles = torch.randn(5, 1, 4, generator=gen)
    c, s = angles.cos(), angles.sin()
    x1, x2 = x[..., :4], x[..., 4:]
    want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    got = rope(x, torch.cat([c, c], -1), torch.cat([-s, s], -1))
    torch.testing.assert_close(got, want)


def test_chunked_prefill_matches_one_pass(model):
    cache = PagedKVCache(MICRO, 32, 16, torch.device("cpu"))
    prompt = np.random.default_rng(3).integers(0, MICRO.vocab, 150)
    whole = PagedEngine(model, cache, "recompute", chunk_tokens=1000).run(prompt)
    chunked = PagedEngine(model, cache, "recompute", chunk_tokens=16).run(prompt)
    torch.testing.assert_close(whole.logits, chunked.logits, atol=0.1, rtol=0.05)
    assert whole.computed_tokens == chunked.computed_tokens == 150


def test_offload_refuses_an_unknown_setting_naming_what_it_expected():
    for field, bad in (
        ("store", "soon"),
        ("load", "lazy"),
        ("store_handover", "later"),
        ("load_handover", "never"),
    ):
        with pytest.raises(ValueError, match=rf"expected {field} in \(.*\), got '{bad}'"):
            Offload(**{field: bad})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("store", "handover"), [("evict", "background"), ("evict", "inline"), ("behind", "inline")]
)
def test_modes_reuse_what_they_should(model, store, handover):
    shape = ChatShape(conversations=3, turns=3, system_tokens=32, user_tokens=32, answer_tokens=16)
    turns = chat_turns(shape, MICRO.vocab, seed=0)
    pool = 2 * -(-shape.history_tokens // 16)
    cache = PagedKVCache(MICRO, 4 * pool, 16, torch.device("cpu"))
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=64))
    try:
        hits, evicted = {}, {}
        for mode in ("recompute", "gpu", "gpu_all", "kvoffload"):
            tier = host if mode == "kvoffload" else None
            blocks = 4 * pool if mode == "gpu_all" else pool
            offload = Offload(store=store, store_handover=handover)
            engine = PagedEngine(model, cache, mode, tier, 64, offload, blocks)
            runs = [engine.run(t.prompt, t.answer) for t in turns]
            engine.idle()
            for r in runs:  # a restore reads one run of host slots or more, one per block at most
                restored = r.host_hit_tokens // 16
                assert (r.load_runs == 0) if restored == 0 else (1 <= r.load_runs <= restored)
            hits[mode] = (
                sum(r.gpu_hit_tokens for r in runs),
                sum(r.host_hit_tokens for r in runs),
                sum(r.computed_tokens for r in runs),
            )
            evicted[mode] = engine.pool.evictions
            assert engine.pool.num_free == engine.pool.num_blocks  # every block given back
        total = sum(len(t.prompt) for t in turns)
        assert hits["recompute"] == (0, 0, total)
        assert hits["gpu"][0] > 0 and hits["gpu"][1] == 0
        # the pool holds two histories: the third conversation pushes the first out of the pool,
        # and kvoffload loads it back instead of recomputing it
        assert hits["kvoffload"][1] > 0
        assert hits["kvoffload"][2] < hits["gpu"][2]
        # gpu_all never evicts: every full block computed before is a GPU hit, the ideal that
        # kvoffload's GPU and host hits together reach here
        assert evicted["gpu_all"] == 0 and evicted["gpu"] > 0
        assert hits["gpu_all"][0] == hits["kvoffload"][0] + hits["kvoffload"][1]
        assert sum(hits["kvoffload"]) == sum(hits["gpu"]) == sum(hits["gpu_all"]) == total
        assert host.stats.stores > 0 and host.stats.failures == 0
        assert host.stats.store_bytes == host.stats.stores * cache.block_bytes
    finally:
        host.close()


class GatedBackend(HostBackend):
    """The host backend, copying only once ``gate`` opens (stores then stay in flight)."""

    gate = threading.Event()

    def copy(self, specs):
        self.gate.wait(10)
        super().copy(specs)


def test_blocks_being_stored_are_not_reused_until_the_store_settles(model, monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "host", GatedBackend)
    GatedBackend.gate.clear()
    cache = PagedKVCache(MICRO, 8, 16, torch.device("cpu"))
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=16))
    try:
        behind = Offload(admission="all", store="behind")
        engine = PagedEngine(model, cache, "kvoffload", host, 64, behind)
        prompt = np.arange(80) % MICRO.vocab
        engine.run(prompt)  # 5 blocks, 5 full ones being stored
        assert engine.pool.num_free == 3  # held while their store is in flight
        GatedBackend.gate.set()
        engine.idle()
        assert engine.pool.num_free == 8 and host.stats.stores == 5
        # with the copy done, the same prompt now comes back from host after the pool forgets it
        engine.drop_gpu_cache()
        again = engine.run(prompt)
        assert again.host_hit_tokens == 64 and again.gpu_hit_tokens == 0
    finally:
        GatedBackend.gate.set()
        host.close()


def test_evict_policy_stores_nothing_while_the_pool_has_room(model):
    cache = PagedKVCache(MICRO, 64, 16, torch.device("cpu"))
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=64))
    try:
        engine = PagedEngine(model, cache, "kvoffload", host, 64, Offload(admission="all"))
        rng = np.random.default_rng(8)
        system = rng.integers(0, MICRO.vocab, 64)
        for _ in range(4):  # 4 requests of 6 blocks each after a shared 4-block prefix: 24 blocks
            engine.run(np.concatenate([system, rng.integers(0, MICRO.vocab, 24)]))
        engine.idle()
        assert host.stats.stores == 0 and engine.late_stores == 0
        assert engine.pool.num_free == 64
        # when the pool is emptied, admitted blocks go to host first, so nothing is lost
        engine.drop_gpu_cache()
        assert host.stats.stores == 4 + 4 * 1  # the shared prefix, then each request's own block
        again = engine.run(np.concatenate([system, rng.integers(0, MICRO.vocab, 24)]))
        assert again.host_hit_tokens == 64 and again.gpu_hit_tokens == 0
    finally:
        host.close()


def test_evict_policy_stores_ahead_and_never_reuses_a_block_being_stored(model, monkeypatch):
    """A pool of 12 blocks cycled by 3-block requests: blocks are stored once they near the head
    of the free queue; while their store is held back, allocation waits for it instead of
    overwriting them, and every block comes back from host later, bit-exact."""
    monkeypatch.setitem(backends.BACKENDS, "host", GatedBackend)
    GatedBackend.gate.set()
    cache = PagedKVCache(MICRO, 12, 16, torch.device("cpu"))
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=64))
    try:
        engine = PagedEngine(model, cache, "kvoffload", host, 64, Offload(admission="all"))
        rng = np.random.default_rng(9)
        prompts = [rng.integers(0, MICRO.vocab, 40) for _ in range(8)]  # 2 full blocks + 1
        first = engine.run(prompts[0])
        second = engine.run(prompts[1])
        assert host.stats.stores == 0  # the pool still has fresh blocks ahead of them
        GatedBackend.gate.clear()  # stores now stay in flight until the gate opens
        done = threading.Event()

        def rest():
            for p in prompts[2:]:
                engine.run(p)
            done.set()

        worker = threading.Thread(target=rest)
        worker.start()
        assert not done.wait(1.0)  # blocked: the next blocks to reuse are being stored
        stored = {b for blocks in engine._storing.values() for b in blocks}
        assert stored and stored <= {*first.blocks, *second.blocks}  # the oldest requests'
        assert engine.pool.num_free > 0  # free blocks exist, but they are being read
        GatedBackend.gate.set()
        worker.join(30)
        assert done.is_set()
        engine.idle()
        assert host.stats.stores >= 2 and host.stats.failures == 0
        back = engine.run(prompts[0])  # evicted from the GPU long ago: from host
        assert back.host_hit_tokens == 32 and back.gpu_hit_tokens == 0
        torch.testing.assert_close(back.logits, first.logits, rtol=0, atol=0)
    finally:
        GatedBackend.gate.set()
        host.close()


@pytest.mark.parametrize("store", ["evict", "behind"])
def test_reuse_admission_stores_only_what_recurs(model, store):
    cache = PagedKVCache(MICRO, 16, 16, torch.device("cpu"))
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=16))
    try:
        engine = PagedEngine(model, cache, "kvoffload", host, 64, Offload(store=store))
        rng = np.random.default_rng(5)
        first, answer = rng.integers(0, MICRO.vocab, 40), rng.integers(0, MICRO.vocab, 8)
        engine.run(first, answer)  # shares nothing: not stored
        engine.run(rng.integers(0, MICRO.vocab, 40))
        engine.drop_gpu_cache()
        assert host.stats.stores == 0
        # a continuation of the first request is admitted, even with its prefix gone from the GPU
        follow = engine.run(np.concatenate([first, answer, rng.integers(0, MICRO.vocab, 30)]))
        engine.drop_gpu_cache()
        assert follow.gpu_hit_tokens == 0 and host.stats.stores == 4  # 78 tokens: 4 full blocks
    finally:
        host.close()


@pytest.mark.parametrize("store", ["evict", "behind"])
def test_an_admitted_request_stores_the_prefix_it_reused_from_the_gpu(model, store):
    """A conversation's first turn is not admitted; its second reuses that turn's blocks from the
    GPU cache and is admitted: the host must then get the reused prefix too, or later host hits
    stop at its hole."""
    cache = PagedKVCache(MICRO, 16, 32, torch.device("cpu"))  # 16 blocks of 32 tokens
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=32))
    try:
        engine = PagedEngine(model, cache, "kvoffload", host, 64, Offload(store=store))
        rng = np.random.default_rng(6)
        first, answer = rng.integers(0, MICRO.vocab, 48), rng.integers(0, MICRO.vocab, 16)
        engine.run(first, answer)  # 2 full blocks on the GPU, none on host
        engine.idle()
        assert host.stats.stores == 0
        second = np.concatenate([first, answer, rng.integers(0, MICRO.vocab, 32)])
        turn = engine.run(second)
        engine.drop_gpu_cache()
        assert turn.gpu_hit_tokens == 64 and host.stats.stores == 3  # 2 reused + 1 new
        again = engine.run(np.concatenate([second, rng.integers(0, MICRO.vocab, 8)]))
        assert again.gpu_hit_tokens == 0 and again.host_hit_tokens == 96
    finally:
        host.close()


def test_none_admission_stores_nothing(model):
    cache = PagedKVCache(MICRO, 16, 16, torch.device("cpu"))
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=16))
    try:
        engine = PagedEngine(model, cache, "kvoffload", host, 64, Offload(admission="none"))
        prompt = np.arange(70) % MICRO.vocab
        engine.run(prompt)
        engine.run(prompt)
        engine.drop_gpu_cache()
        again = engine.run(prompt)
        assert host.stats.stores == 0 and again.host_hit_tokens == 0
    finally:
        host.close()


class HeldLayer(HostBackend):
    """Loads really move bytes, layer by layer, but stop before layer ``hold`` until released."""

    hold = 1
    reached = threading.Event()
    release = threading.Event()

    def _copy_region(self, spec, r):
        if spec.direction == "load" and r == self.layout.groups[spec.group].layer_starts[self.hold]:
            self.reached.set()
            assert self.release.wait(30)
        super()._copy_region(spec, r)


def test_layered_restore_starts_prefill_before_the_load_has_arrived(model, monkeypatch):
    """Layer 0's attention runs while layer 1's blocks are still held back; the result equals a
    restore that waits for the whole load first, bit for bit."""
    monkeypatch.setitem(backends.BACKENDS, "host", HeldLayer)
    HeldLayer.release.set()
    cache = PagedKVCache(MICRO, 32, 16, torch.device("cpu"))
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=32))
    try:
        prompt = np.random.default_rng(10).integers(0, MICRO.vocab, 100)  # 6 full blocks
        store = PagedEngine(model, cache, "kvoffload", host, 64, Offload(admission="all"))
        store.run(prompt[:90])
        store.drop_gpu_cache()
        blocking = PagedEngine(model, cache, "kvoffload", host, 64, Offload(load="blocking"))
        want = blocking.run(prompt, cache=False)
        assert want.host_hit_tokens == 80 and want.layer_waits == []
        HeldLayer.reached.clear()
        HeldLayer.release.clear()
        waited = []
        real = host.wait_layer

        def wait_layer(load, layer):
            real(load, layer)
            waited.append(layer)

        monkeypatch.setattr(host, "wait_layer", wait_layer)
        layered = PagedEngine(model, cache, "kvoffload", host, 64, Offload(load="layered"))
        out: dict[str, TurnResult] = {}
        runner = threading.Thread(target=lambda: out.update(r=layered.run(prompt, cache=False)))
        runner.start()
        assert HeldLayer.reached.wait(30)
        deadline = time.monotonic() + 30
        while not waited and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert waited == [0]  # layer 0 read its blocks; layer 1 waits for the held copy
        HeldLayer.release.set()
        runner.join(30)
        got = out["r"]
        assert waited[:2] == [0, 1] and len(got.layer_waits) == MICRO.layers
        assert got.host_hit_tokens == 80
        assert torch.equal(got.logits, want.logits) and got.first_token == want.first_token
    finally:
        HeldLayer.release.set()
        host.close()


class FailingLoads(HostBackend):
    def _copy_region(self, spec, r):
        if spec.direction == "load" and r == self.layout.groups[spec.group].layer_starts[1]:
            raise OSError("injected load failure")
        super()._copy_region(spec, r)


@pytest.mark.parametrize("load", ["layered", "blocking"])
def test_a_failed_load_is_recomputed(model, monkeypatch, load):
    monkeypatch.setitem(backends.BACKENDS, "host", FailingLoads)
    cache = PagedKVCache(MICRO, 32, 16, torch.device("cpu"))
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=32))
    try:
        prompt = np.random.default_rng(11).integers(0, MICRO.vocab, 100)
        engine = PagedEngine(
            model, cache, "kvoffload", host, 64, Offload(admission="all", load=load)
        )
        engine.run(prompt[:90])
        engine.drop_gpu_cache()
        got = engine.run(prompt)
        assert got.host_hit_tokens == 0 and got.computed_tokens == 100
        assert host.stats.failures == 5  # the 5 full blocks of the failed load
        want = PagedEngine(model, cache, "recompute", None, 64).run(prompt)
        assert torch.equal(got.logits, want.logits)
        engine.idle()
        assert engine.pool.num_free == 32  # the failed load's blocks came back too
    finally:
        host.close()


def test_decode_attention_equals_sdpa():
    from kvoffload.bench.e2e.runner.attention import decode_attention

    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 8, 16, generator=gen).bfloat16()
    k = torch.randn(37, 2, 16, generator=gen).bfloat16()
    v = torch.randn(37, 2, 16, generator=gen).bfloat16()
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0).float() for x in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    got = decode_attention(q, k, v)
    torch.testing.assert_close(got.float(), want.squeeze(0).transpose(0, 1), atol=1e-2, rtol=1e-2)
    assert torch.equal(got, decode_attention(q, k, v))


def test_engine_rejects_bad_input(model):
    cache = PagedKVCache(MICRO, 4, 16, torch.device("cpu"))
    with pytest.raises(ValueError, match="mode"):
        PagedEngine(model, cache, "disk")
    with pytest.raises(ValueError, match="host tier exactly"):
        PagedEngine(model, cache, "kvoffload")
    with pytest.raises(ValueError, match="admission"):
        Offload(admission="some")
    with pytest.raises(ValueError, match="store in"):
        Offload(store="later")
    with pytest.raises(ValueError, match="load in"):
        Offload(load="lazy")
    with pytest.raises(ValueError, match="store_lead > 0"):
        Offload(store_lead=0)
    with pytest.raises(ValueError, match="pool_blocks in"):
        PagedEngine(model, cache, "gpu", pool_blocks=5)
    engine = PagedEngine(model, cache, "gpu")
    with pytest.raises(ValueError, match="non-empty 1-D prompt"):
        engine.run([])
    with pytest.raises(ValueError, match="answer tokens or decode"):
        engine.run([1, 2], answer=[3], decode=1)
    with pytest.raises(PoolExhausted):
        engine.run(np.zeros(100, dtype=np.int64))


def test_slot_runs_counts_runs_of_consecutive_slots_in_slot_order():
    from kvoffload.bench.e2e.runner.host_tier import slot_runs
    from kvoffload.transfer.spec import TransferSpec

    def load(slots):
        return TransferSpec.of("load", list(range(len(slots))), slots)

    assert slot_runs([]) == 0
    assert slot_runs([load([5])]) == 1
    assert slot_runs([load([7, 6, 5, 4])]) == 1  # descending: one run in slot order
    assert slot_runs([load([0, 1, 2, 9, 10, 4])]) == 3
    assert slot_runs([load([0, 2, 4]), load([1, 2])]) == 4


@pytest.mark.parametrize("store", ["evict", "behind"])
def test_the_first_reader_of_a_shared_prefix_is_stored_once_a_second_one_comes(model, store):
    """Documents behind one system prompt: the first request shares nothing yet and is not
    admitted; the second shares the system prompt and is. The first document, still on the GPU
    then, goes to host too, so its next reader hits it there after the GPU has dropped it."""
    cache = PagedKVCache(MICRO, 32, 16, torch.device("cpu"))
    host = HostTier(cache, kvo.OffloadConfig(host_capacity_blocks=32))
    try:
        engine = PagedEngine(model, cache, "kvoffload", host, 64, Offload(store=store))
        rng = np.random.default_rng(7)
        system = rng.integers(0, MICRO.vocab, 16)
        doc1, doc2 = (np.concatenate([system, rng.integers(0, MICRO.vocab, 48)]) for _ in "12")
        engine.run(doc1)  # shares nothing: not admitted
        engine.idle()
        assert host.stats.stores == 0
        second = engine.run(doc2)  # shares the system prompt: admitted, and doc1 with it
        assert second.gpu_hit_tokens == 16
        engine.drop_gpu_cache()
        again = engine.run(np.concatenate([doc1, rng.integers(0, MICRO.vocab, 8)]))
        assert again.gpu_hit_tokens == 0 and again.host_hit_tokens == 64
    finally:
        host.close()
