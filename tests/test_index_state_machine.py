"""Random operations on the engine-neutral API against a model, in three variants.

``OffloaderMachine``: 10^5 operations on the scheduler side (Offloader over the native
BlockIndex and its Python model side by side, ``tests/index_twin.py``: every index call is made on
both and must give the same result; the policy (LRU or ARC) and the eviction window drawn first;
keys of 4, 16, 17 (negative-int form) and 36 bytes; its jobs run by a host-backend worker whose
copies fail when the test says), bad calls and forged results mixed in. After every step the two
indexes hold the same state, key by key, and: every slot is exactly one of free / being written /
readable; a block being read is still readable (never evicted); a failed or cancelled store left
nothing readable; the stats equal the model's counts; a refused call changed nothing (capacity,
pins, settled-ness).

``ReplayMachine``: Offloader + TransferWorker + host backend moving real bytes, with finished
jobs re-submitted and other Offloaders' jobs submitted between the engine's own operations: each
is refused, and no byte of the arena or the engine's KV changes. Every load returns the bytes its
key was stored from, and every readable host slot holds exactly its key's bytes.

``test_threads_share_one_offload``: several threads on one LocalOffload, thread switches forced
every microsecond, each storing and loading real bytes: no wrong byte, no unexpected exception,
invariants and capacity intact at the end.
"""

from __future__ import annotations

import random
import sys
import threading
from concurrent.futures import Future

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvoffload import KVLayout, build_local
from kvoffload.config import OffloadConfig
from kvoffload.offload import JobResult, LocalOffload, TransferJob, TransferWorker
from kvoffload.transfer.host import FuturePending, HostBackend
from tests.index_twin import TwinIndex

SLOTS = 24
# Every form the native index keeps: short (4 bytes, padded), 16 bytes, b"-" + 16, long (digest).
KEY_FORMS = (
    lambda i: i.to_bytes(4, "big"),
    lambda i: i.to_bytes(16, "big"),
    lambda i: b"-" + i.to_bytes(16, "big"),
    lambda i: i.to_bytes(32, "big") + b"\x00\x00\x00\x01",
)
KEYS = [KEY_FORMS[i % 4](i) for i in range(64)]
STEPS = [0]  # invariant checks run, i.e. operations executed (plus one per example)
BAD_CALLS = [0]  # refused calls among them
FORGED = [0]  # refused made-up results among those
CHAINS = [KEYS[i : i + 16] for i in range(0, 64, 16)]  # four 16-block "prompts" (overlapping use)


class FlakyBackend(HostBackend):
    """The host backend copying in the caller's thread (10^5 operations stay fast); while
    ``fail`` is set, a copy fails before it moves a byte."""

    fail = False

    def submit_checked(self, specs, **kw):
        done: Future[None] = Future()
        try:
            if self.fail:
                raise OSError("the copy failed (on purpose)")
            self.copy(specs)
            done.set_result(None)
        except OSError as err:
            done.set_exception(err)
        return FuturePending(done)


class OffloaderMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = np.zeros((16, 64), np.uint8)  # kept alive: the layout holds its address
        layout = KVLayout.from_tensors([self.kv], block_size=16, block_dim=0)
        self.local = build_local(layout, OffloadConfig(host_capacity_blocks=SLOTS))
        self.off = self.local.offloader
        self.twin = TwinIndex(SLOTS, self.off.slot_bytes)
        self.off.index = self.twin  # type: ignore[assignment]
        self.local.worker.close()
        self.backend = FlakyBackend(layout, self.local.arena)
        self.worker = self.local.worker = TransferWorker(self.backend, self.off)
        self.jobs: dict[int, TransferJob] = {}
        self.readable: set[bytes] = set()  # model
        self.expect = {"stores": 0, "store_failures": 0, "loads": 0, "load_failures": 0}
        self.hits = self.misses = 0
        self.req = 0

    def teardown(self) -> None:
        self.local.close()

    @initialize(policy=st.sampled_from(["lru", "arc"]), window=st.sampled_from([1, 2, 4, 1024]))
    def choose_policy(self, policy: str, window: int) -> None:
        """The eviction policy and window, drawn like any other choice (nothing stored yet)."""
        self.twin = TwinIndex(SLOTS, self.off.slot_bytes, policy, window)
        self.off.index = self.twin  # type: ignore[assignment]

    def _new_req(self) -> str:
        self.req += 1
        return f"r{self.req}"

    def _run(self, job: TransferJob, ok: bool) -> JobResult:
        """The job's real result from the worker: its copy moves bytes, or fails when not ``ok``."""
        self.backend.fail = not ok
        self.worker.submit(job)
        assert self.worker.wait([job.job_id], 30) == set()
        (result,) = self.worker.get_finished()
        assert result.ok == ok
        return result

    def _pinned(self) -> set[bytes]:
        return {k for j in self.jobs.values() if j.direction == "load" for k in j.keys}

    @rule(chain=st.integers(0, 3), n=st.integers(0, 16))
    def lookup(self, chain: int, n: int) -> None:
        keys = CHAINS[chain][:n]
        expected = 0
        while expected < n and keys[expected] in self.readable:
            expected += 1
        assert self.off.lookup(keys) == expected
        self.hits += expected
        self.misses += n - expected

    @rule(chain=st.integers(0, 3), start=st.integers(0, 15), n=st.integers(1, 16))
    def schedule_store(self, chain: int, start: int, n: int) -> None:
        keys = CHAINS[chain][start : start + n]
        evictions_before = self.off.index.stats.evictions
        job = self.off.schedule_store(self._new_req(), keys, list(range(len(keys))))
        if job is None:
            return
        evicted = self.off.index.stats.evictions - evictions_before
        assert not set(job.keys) & self.readable, "a readable key was scheduled for store"
        assert not (self._pinned() - self._readable_now()), "eviction removed a block being read"
        self.readable = self._readable_now()  # evictions the model cannot predict exactly
        assert evicted >= 0
        self.jobs[job.job_id] = job

    @rule(chain=st.integers(0, 3), n=st.integers(1, 16))
    def schedule_load(self, chain: int, n: int) -> None:
        keys = CHAINS[chain][:n]
        held = self.off.lookup(keys)
        self.hits += held
        self.misses += n - held
        if held:
            job = self.off.schedule_load(self._new_req(), keys[:held], list(range(held)))
            self.jobs[job.job_id] = job

    @precondition(lambda self: self.jobs)
    @rule(pick=st.integers(0, 10**6), ok=st.booleans(), junk=st.booleans())
    def finish(self, pick: int, ok: bool, junk: bool) -> None:
        """Complete one job; with ``junk`` next to an unknown id (applied, then ValueError)."""
        job = self.jobs.pop(sorted(self.jobs)[pick % len(self.jobs)])
        result = self._run(job, ok)
        self._complete(job, result, junk=JobResult(10**9, True, 0, 0.0) if junk else None)

    @precondition(lambda self: self.jobs)
    @rule(pick=st.integers(0, 10**6), submitted=st.booleans())
    def forged_result(self, pick: int, submitted: bool) -> None:
        """A result the worker did not report (for a job never submitted, or one submitted and
        finished whose real result is held back) changes nothing; the real one then counts."""
        job = self.jobs[sorted(self.jobs)[pick % len(self.jobs)]]
        real = self._run(job, ok=True) if submitted else None
        before = self._frozen()
        with pytest.raises(ValueError, match="did not report" if submitted else "never submitted"):
            self.off.complete([JobResult(job.job_id, True, job.nbytes, 0.0)])
        assert self._frozen() == before and not self.off.is_settled(job.req_id)
        BAD_CALLS[0] += 1
        FORGED[0] += 1
        if real is not None:
            del self.jobs[job.job_id]
            self._complete(job, real)

    @rule(
        chain=st.integers(0, 3),
        n=st.integers(2, 16),
        kind=st.sampled_from(
            ["load_dup_dst", "load_neg", "load_group", "store_short", "store_dup_key", "str_key"]
        ),
    )
    def bad_call(self, chain: int, n: int, kind: str) -> None:
        """A refused call changes nothing: no slot, pin, job or counter, and its request stays
        settled (the old failure: schedule_load(req, keys, [5, 5]) pinned and never settled)."""
        keys = CHAINS[chain][:n]
        held = [k for k in keys if k in self.readable][:n] or keys  # readable ones when any
        req = self._new_req()
        before = self._frozen()
        with pytest.raises(ValueError):
            if kind == "load_dup_dst":
                self.off.schedule_load(req, [*held, *held], [5] * (2 * len(held)))
            elif kind == "load_neg":
                self.off.schedule_load(req, held, [-1] * len(held))
            elif kind == "load_group":
                self.off.schedule_load(req, held, range(len(held)), group=-1)
            elif kind == "store_short":
                self.off.schedule_store(req, keys, [0])
            elif kind == "store_dup_key":
                self.off.schedule_store(req, [keys[0], *keys], range(n + 1))
            else:
                self.off.schedule_store(req, [*keys, "not bytes"], range(n + 1))  # type: ignore[list-item]
        assert self._frozen() == before and self.off.is_settled(req)
        BAD_CALLS[0] += 1

    @precondition(lambda self: self.jobs)
    @rule(pick=st.integers(0, 10**6), started=st.booleans())
    def abort(self, pick: int, started: bool) -> None:
        """Abort a request: a job not started is cancelled; one in flight finishes normally."""
        job = self.jobs[sorted(self.jobs)[pick % len(self.jobs)]]
        assert self.off.abort(job.req_id) == [job.job_id]
        assert not self.off.is_settled(job.req_id)
        del self.jobs[job.job_id]
        if started:
            result = self._run(job, ok=True)
        else:
            assert self.worker.cancel([job.job_id]) == [job.job_id]
            (result,) = self.worker.get_finished()
            assert result.cancelled
        self._complete(job, result)
        assert self.off.is_settled(job.req_id)

    @rule(n=st.integers(1, 8))
    def evict_under_pressure(self, n: int) -> None:
        pinned = self._pinned()
        evicted = self.off.index.evict(n)
        assert not set(evicted) & pinned
        assert set(evicted) <= self.readable
        self.readable -= set(evicted)

    def _frozen(self) -> tuple[object, ...]:
        ix = self.off.index
        counts = (ix.num_free, ix.num_writing, ix.num_readable, ix.num_pinned)
        return (counts, self.off.in_flight(), ix.stats.snapshot(), self._readable_now())

    def _complete(self, job: TransferJob, result: JobResult, junk: JobResult | None = None) -> None:
        if junk is None:
            self.off.complete([result])
        else:
            with pytest.raises(ValueError, match="unknown id"):
                self.off.complete([junk, result])
        assert self.off.is_settled(job.req_id)
        if job.direction == "store":
            if result.ok:
                self.readable |= set(job.keys)
                self.expect["stores"] += len(job.keys)
            else:
                assert not set(job.keys) & self._readable_now(), "failed store left keys readable"
                self.expect["store_failures"] += len(job.keys)
        else:
            self.expect["loads" if result.ok else "load_failures"] += len(job.keys)

    def _readable_now(self) -> set[bytes]:
        return {k for k in KEYS if self.off.index.state(k) == 2}

    @invariant()
    def consistent(self) -> None:
        ix = self.off.index
        ix.check_invariants()
        self.twin.assert_same(KEYS)
        assert self._readable_now() == self.readable
        assert self._pinned() <= self.readable, "a block being read is not readable"
        writing = {k for j in self.jobs.values() if j.direction == "store" for k in j.keys}
        assert ix.num_writing == len(writing)
        assert ix.num_free + ix.num_writing + ix.num_readable == SLOTS
        stats = ix.stats
        for name, value in self.expect.items():
            assert getattr(stats, name) == value, name
        assert (stats.hits, stats.misses) == (self.hits, self.misses)
        assert stats.evictions + len(self.readable) == stats.stores  # nothing else removes
        assert self.off.in_flight() == set(self.jobs)
        STEPS[0] += 1


OffloaderMachine.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=1000,  # Hypothesis runs ~560 of the 1000 on average: ~1.4 x 10^5
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.large_base_example,
        HealthCheck.data_too_large,
    ],
)
TestOffloaderMachine = OffloaderMachine.TestCase


def test_ran_at_least_1e5_operations():
    """Runs after the machine (file order) and checks the run was as long as promised."""
    if STEPS[0] == 0:
        TestOffloaderMachine("runTest").runTest()
    assert STEPS[0] >= 100_000, STEPS[0]


# -- replayed and foreign jobs, real bytes -------------------------------------------------------

ENGINE_BLOCKS, PAGE = 32, 64
HOST_SLOTS = 8
RKEYS = [i.to_bytes(4, "big") for i in range(24)]
RCHAINS = [RKEYS[i : i + 8] for i in range(0, 24, 8)]
REPLAY = {"steps": 0, "replays": 0, "foreign": 0, "loads_checked": 0}


def content(key: bytes) -> np.ndarray:
    """The bytes an engine block holds for ``key`` (any store of it stores exactly these)."""
    return np.random.default_rng(int.from_bytes(key, "big")).integers(0, 256, PAGE, np.uint8)


CONTENT = {k: content(k) for k in RKEYS}


def bytes_layout() -> tuple[np.ndarray, KVLayout]:
    kv = np.zeros((ENGINE_BLOCKS, PAGE), np.uint8)
    return kv, KVLayout.from_tensors([kv], block_size=16, block_dim=0)


def run_job(local: LocalOffload, job: TransferJob) -> JobResult:
    local.worker.submit(job)
    assert local.worker.wait([job.job_id], 30) == set()
    (result,) = local.worker.get_finished()
    local.offloader.complete([result])
    return result


class ReplayMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv, layout = bytes_layout()
        self.local = build_local(layout, OffloadConfig(host_capacity_blocks=HOST_SLOTS))
        self.off = self.local.offloader
        # Another offload (its own index and arena, the same layout) whose jobs are foreign here.
        self.other_kv, other_layout = bytes_layout()
        self.other_local = build_local(other_layout, OffloadConfig(host_capacity_blocks=HOST_SLOTS))
        self.other = self.other_local.offloader
        self.finished: list[TransferJob] = []
        self.req = 0

    def teardown(self) -> None:
        self.local.close()
        self.other_local.close()

    def _new_req(self) -> str:
        self.req += 1
        return f"r{self.req}"

    @rule(chain=st.integers(0, 2), n=st.integers(1, 8), first=st.integers(0, ENGINE_BLOCKS - 8))
    def store(self, chain: int, n: int, first: int) -> None:
        keys = RCHAINS[chain][:n]
        blocks = list(range(first, first + n))
        for key, b in zip(keys, blocks, strict=True):
            self.kv[b] = CONTENT[key]  # the engine computed these blocks' KV
        job = self.off.schedule_store(self._new_req(), keys, blocks)
        if job is not None:
            assert run_job(self.local, job).ok
            self.finished.append(job)

    @rule(chain=st.integers(0, 2), n=st.integers(1, 8), first=st.integers(0, ENGINE_BLOCKS - 8))
    def load(self, chain: int, n: int, first: int) -> None:
        keys = RCHAINS[chain][:n]
        held = self.off.lookup(keys)
        if not held:
            return
        blocks = list(range(first, first + held))
        job = self.off.schedule_load(self._new_req(), keys[:held], blocks)
        assert run_job(self.local, job).ok
        for key, b in zip(keys[:held], blocks, strict=True):
            assert np.array_equal(self.kv[b], CONTENT[key]), "a load returned wrong bytes"
        REPLAY["loads_checked"] += held
        self.finished.append(job)

    @rule(block=st.integers(0, ENGINE_BLOCKS - 1), seed=st.integers(0, 2**32 - 1))
    def engine_reuses_block(self, block: int, seed: int) -> None:
        self.kv[block] = np.random.default_rng(seed).integers(0, 256, PAGE, np.uint8)

    @rule(n=st.integers(1, 4))
    def evict(self, n: int) -> None:
        self.off.index.evict(n)

    @precondition(lambda self: self.finished)
    @rule(pick=st.integers(0, 10**6))
    def replay_finished_job(self, pick: int) -> None:
        job = self.finished[pick % len(self.finished)]
        self._refused(job, "runs at most once")
        REPLAY["replays"] += 1

    @rule(chain=st.integers(0, 2), n=st.integers(1, 8), load=st.booleans())
    def submit_foreign_job(self, chain: int, n: int, load: bool) -> None:
        keys = RCHAINS[chain][:n]
        job = self.other.schedule_store(self._new_req(), keys, range(n))
        if job is not None and load:  # make them readable over there, then load them
            assert run_job(self.other_local, job).ok
        if load:
            held = self.other.lookup(keys)
            job = self.other.schedule_load(self._new_req(), keys[:held], range(held))
        if job is None:
            return
        self._refused(job, "did not create")
        REPLAY["foreign"] += 1
        other = self.other_local.worker  # settle it over there
        assert other.cancel(self.other.abort(job.req_id)) == [job.job_id]
        self.other.complete(other.get_finished())

    def _refused(self, job: TransferJob, message: str) -> None:
        slots, kv = self.local.arena.slots.copy(), self.kv.copy()
        with pytest.raises(ValueError, match=message):
            self.local.worker.submit(job)
        assert self.local.worker.get_finished() == []
        assert np.array_equal(self.local.arena.slots, slots), "a refused job wrote host slots"
        assert np.array_equal(self.kv, kv), "a refused job wrote engine blocks"

    @invariant()
    def consistent(self) -> None:
        ix = self.off.index
        ix.check_invariants()
        assert self.off.in_flight() == set() and ix.num_pinned == 0 and ix.num_writing == 0
        assert ix.num_free + ix.num_readable == HOST_SLOTS
        for key in RKEYS:  # the host never holds wrong bytes for a readable key
            slot = ix.slot_of(key)
            if slot is not None:
                assert np.array_equal(self.local.arena.slots[slot][:PAGE], CONTENT[key])
        REPLAY["steps"] += 1


ReplayMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=300,  # ~2 x 10^4 operations, ~10 s on a 2-core CI machine
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestReplayMachine = ReplayMachine.TestCase


# -- several threads on one offload ------------------------------------------------------------

THREADS, OPS_PER_THREAD, TSLOTS = 8, 1500, 12
CONCURRENT = {"ops": 0, "loads_checked": 0, "stores": 0, "bad_calls": 0, "races": 0}


def _engine_thread(local: LocalOffload, kv: np.ndarray, me: int, errors: list[BaseException]):
    """One engine thread: its own engine blocks and request ids, the shared key space."""
    off, worker = local.offloader, local.worker
    rng = random.Random(me)
    mine = list(range(me * 4, me * 4 + 4))  # 4 engine blocks of its own
    counts = dict.fromkeys(CONCURRENT, 0)

    def settle(req: str) -> None:
        for _ in range(100_000):
            off.complete(worker.get_finished())
            if off.is_settled(req):
                return
            worker.wait(off.in_flight(req), 0.01)
        raise AssertionError(f"{req} never settled")

    try:
        for op in range(OPS_PER_THREAD):
            chain = RCHAINS[rng.randrange(3)]
            n = rng.randint(1, 4)
            keys = chain[rng.randrange(0, 8 - n + 1) :][:n]
            req = f"t{me}-{op}"
            kind = rng.random()
            if kind < 0.4:
                for key, b in zip(keys, mine, strict=False):
                    kv[b] = CONTENT[key]
                job = off.schedule_store(req, keys, mine[:n])
                if job is not None:
                    worker.submit(job)
                    if rng.random() < 0.3:
                        worker.cancel(off.abort(req))
                    counts["stores"] += 1
                settle(req)  # before these engine blocks are reused
            elif kind < 0.8:
                held = off.lookup(keys)
                try:
                    job = off.schedule_load(req, keys[:held], mine[:held])
                except ValueError as err:  # another thread evicted one since the lookup
                    assert "expected keys held on host" in str(err)
                    counts["races"] += 1
                    continue
                worker.submit(job)
                settle(req)
                for key, b in zip(keys[:held], mine, strict=False):
                    assert np.array_equal(kv[b], CONTENT[key]), "a load returned wrong bytes"
                counts["loads_checked"] += held
            elif kind < 0.9:
                with pytest.raises(ValueError):
                    off.schedule_load(req, [keys[0], keys[0]], [mine[0], mine[0]])
                assert off.is_settled(req)
                counts["bad_calls"] += 1
            else:
                off.touch(keys)
                off.lookup_tiers(keys)
            counts["ops"] += 1
    except BaseException as err:  # noqa: BLE001 (the thread's end: the test raises it)
        errors.append(err)
    for name, value in counts.items():
        CONCURRENT[name] += value


def test_threads_share_one_offload():
    kv, layout = bytes_layout()
    local = build_local(layout, OffloadConfig(host_capacity_blocks=TSLOTS))
    errors: list[BaseException] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython allows
    try:
        threads = [
            threading.Thread(target=_engine_thread, args=(local, kv, me, errors))
            for me in range(THREADS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    finally:
        sys.setswitchinterval(interval)
    try:
        assert not errors, errors[0]
        off = local.offloader
        off.complete(local.worker.get_finished())
        ix = off.index
        ix.check_invariants()
        assert off.in_flight() == set() and ix.num_pinned == 0 and ix.num_writing == 0
        assert ix.num_free + ix.num_readable == TSLOTS  # no slot lost
        for key in RKEYS:
            slot = ix.slot_of(key)
            if slot is not None:
                assert np.array_equal(local.arena.slots[slot][:PAGE], CONTENT[key])
        assert CONCURRENT["ops"] == THREADS * OPS_PER_THREAD - CONCURRENT["races"]
        assert CONCURRENT["loads_checked"] > 0 and CONCURRENT["stores"] > 0
    finally:
        local.close()
