"""The jobs of one Offloader, from schedule to final result: the one record that makes a job run
at most once and lets only real results count. Private to ``kvoffload.offload``.

An ``Offloader`` owns its ledger; the ``TransferWorker`` built with that Offloader (``build_local``
builds both) holds the same ledger. A job's life, each step taken under the Offloader's lock::

    scheduled --take (worker.submit)--------------> taken --report (worker.get_finished)--+
        |                                             ^                                   |
        +--take_unsubmitted (worker.cancel)-----------+      reported results             v
                                                                  --accept (complete)--> settled

- ``take`` admits only the very job object the Offloader handed out, in flight and not taken
  before: a finished job, a copy, another Offloader's job, a job submitted twice are refused
  (ValueError, nothing touched). ``untake`` undoes it when the backend refused the job.
- ``report`` records each result the worker hands out; ``accept`` (``Offloader.complete``) takes
  only a result recorded so, each once, and settles its job with a final one: a result for a job
  never submitted, a forged one (an ``ok=True`` the worker did not report), a second copy of one
  are refused, so no key becomes readable unless its copy really succeeded, and a store's real
  result can never be preempted.
- ``close`` settles every job (``Offloader.close`` then releases what they held) and refuses
  further takes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from kvoffload.offload.jobs import JobResult, TransferJob


class _Entry:
    """One job's record (a plain class with slots: one is made per job on the engine's thread,
    ~0.2 µs against ~0.5 µs for a dataclass with a default factory)."""

    __slots__ = ("job", "late", "reported", "taken")

    def __init__(self, job: TransferJob) -> None:
        self.job = job
        self.taken = False  # handed to the worker: submitted, or cancelled before it ever ran
        self.late = False  # a load reported timed out whose copy has not ended
        self.reported: list[JobResult] = []  # handed out, not yet accepted


class JobLedger:
    """Every job in flight of one Offloader. Callers hold ``lock`` (the Offloader's)."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self.closed = False
        self._entries: dict[int, _Entry] = {}
        self._by_req: dict[str, set[int]] = {}
        self.last_id = -1  # the highest job id handed out (ids count up from 0)

    # -- the Offloader's side ------------------------------------------------------------------

    def add(self, job: TransferJob) -> None:
        job_id = job.job_id
        if job_id > self.last_id:
            self.last_id = job_id
        self._entries[job_id] = _Entry(job)
        jobs = self._by_req.get(job.req_id)
        if jobs is None:
            self._by_req[job.req_id] = {job_id}
        else:
            jobs.add(job_id)

    def accept(self, result: JobResult) -> tuple[TransferJob | None, str, bool]:
        """The job ``result`` belongs to, if the worker reported exactly this result; else None
        and why (``unknown``, ``unsubmitted`` or ``unreported``). Each result is accepted once:
        a final one settles its job (as ``settle``), one that is not (a load past its deadline)
        marks the job late. Third: whether the job was late before this result."""
        job_id = result.job_id
        entry = self._entries.get(job_id) if isinstance(job_id, int) else None
        if entry is None:
            return None, "unknown", False
        if not entry.taken:
            return None, "unsubmitted", False
        reported = entry.reported
        if reported and reported[0] is result:  # the usual case: the one result reported
            del reported[0]
        elif result in reported:
            reported.remove(result)
        else:
            return None, "unreported", False
        late = entry.late
        if not result.final:
            entry.late = True
            return entry.job, "", late
        return self.settle(job_id), "", late

    def is_late(self, job_id: int) -> bool:
        return self._entries[job_id].late

    def settle(self, job_id: int) -> TransferJob:
        """Forget a job that reached its end; its request settles with its last job."""
        job = self._entries.pop(job_id).job
        jobs = self._by_req[job.req_id]
        jobs.discard(job_id)
        if not jobs:
            del self._by_req[job.req_id]
        return job

    def close(self) -> list[tuple[TransferJob, list[JobResult]]]:
        """Refuse further takes; returns every job in flight with the results reported for it
        and not accepted, for the Offloader to settle."""
        self.closed = True
        return [(e.job, list(e.reported)) for e in self._entries.values()]

    def jobs(self, req_id: str | None = None) -> set[int]:
        if req_id is None:
            return set(self._entries)
        return set(self._by_req.get(req_id, ()))

    def job(self, job_id: int) -> TransferJob | None:
        """The job of ``job_id`` while its Offloader has it in flight (None once completed)."""
        with self.lock:
            entry = self._entries.get(job_id)
            return None if entry is None else entry.job

    def handed_out(self, job_id: object) -> bool:
        """Whether the Offloader ever handed out ``job_id`` (in flight or long finished)."""
        if isinstance(job_id, bool) or not isinstance(job_id, int):
            return False
        return 0 <= job_id <= self.last_id

    def is_settled(self, req_id: str) -> bool:
        return req_id not in self._by_req

    def num_late(self) -> int:
        return sum(e.late for e in self._entries.values())

    def __iter__(self) -> Iterator[TransferJob]:
        return (e.job for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    # -- the worker's side (each takes the lock) -----------------------------------------------

    def take(self, job: TransferJob, where: str = "submit") -> None:
        """Admit ``job`` to run (see the module docstring); ValueError, changing nothing, else.
        ``where``: the worker call that asked (the messages start with it)."""
        with self.lock:
            if self.closed:
                raise ValueError(
                    f"{where}: expected a job of an open Offloader, got one of a closed one"
                )
            entry = self._entries.get(job.job_id)
            if entry is None or entry.job is not job:
                raise ValueError(
                    f"{where}: expected a job this worker's Offloader has in flight, got job "
                    f"{job.job_id} that it did not create or has already completed (a job runs "
                    "at most once)"
                )
            if entry.taken:
                raise ValueError(
                    f"{where}: expected a job not submitted before, got job {job.job_id} that was "
                    "already submitted or cancelled (a job runs at most once)"
                )
            entry.taken = True

    def untake(self, job: TransferJob) -> None:
        """Undo ``take`` for a job the backend refused before it touched memory."""
        with self.lock:
            entry = self._entries.get(job.job_id)
            if entry is not None and entry.job is job:
                entry.taken = False

    def take_unsubmitted(self, job_id: int) -> TransferJob | None:
        """Take a job in flight that was never submitted, so that the worker reports it cancelled
        (it can then never run); None if there is no such job."""
        with self.lock:
            entry = self._entries.get(job_id)
            if self.closed or entry is None or entry.taken:
                return None
            entry.taken = True
            return entry.job

    def report(self, results: list[JobResult]) -> None:
        """Record results the worker hands out; results of settled jobs are dropped."""
        with self.lock:
            for result in results:
                entry = self._entries.get(result.job_id)
                if entry is not None:
                    entry.reported.append(result)
