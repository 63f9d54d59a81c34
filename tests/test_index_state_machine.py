"""10^5 random operations on the scheduler side (Offloader over BlockIndex) against a model.

After every step: every slot is exactly one of free / being written / readable; a block being read
is still readable (never evicted); a failed or cancelled store left nothing readable; the stats
equal the model's counts.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.config import OffloadConfig
from kvoffload.offload import JobResult, Offloader, TransferJob

SLOTS = 24
KEYS = [i.to_bytes(4, "big") for i in range(64)]
STEPS = [0]  # invariant checks run, i.e. operations executed (plus one per example)
CHAINS = [KEYS[i : i + 16] for i in range(0, 64, 16)]  # four 16-block "prompts" (overlapping use)


class OffloaderMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.off = Offloader(OffloadConfig(host_capacity_blocks=SLOTS), slot_bytes=64)
        self.jobs: dict[int, TransferJob] = {}
        self.readable: set[bytes] = set()  # model
        self.expect = {"stores": 0, "store_failures": 0, "loads": 0, "load_failures": 0}
        self.hits = self.misses = 0
        self.req = 0

    def _new_req(self) -> str:
        self.req += 1
        return f"r{self.req}"

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
    @rule(pick=st.integers(0, 10**6), ok=st.booleans())
    def finish(self, pick: int, ok: bool) -> None:
        job = self.jobs.pop(sorted(self.jobs)[pick % len(self.jobs)])
        self._complete(job, JobResult(job.job_id, ok, job.nbytes if ok else 0, 0.0))

    @precondition(lambda self: self.jobs)
    @rule(pick=st.integers(0, 10**6), started=st.booleans())
    def abort(self, pick: int, started: bool) -> None:
        """Abort a request: a job not started is cancelled; one in flight finishes normally."""
        job = self.jobs[sorted(self.jobs)[pick % len(self.jobs)]]
        assert self.off.abort(job.req_id) == [job.job_id]
        assert not self.off.is_settled(job.req_id)
        del self.jobs[job.job_id]
        result = JobResult(
            job.job_id, started, job.nbytes if started else 0, 0.0, cancelled=not started
        )
        self._complete(job, result)
        assert self.off.is_settled(job.req_id)

    @rule(n=st.integers(1, 8))
    def evict_under_pressure(self, n: int) -> None:
        pinned = self._pinned()
        evicted = self.off.index.evict(n)
        assert not set(evicted) & pinned
        assert set(evicted) <= self.readable
        self.readable -= set(evicted)

    def _complete(self, job: TransferJob, result: JobResult) -> None:
        self.off.complete([result])
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
