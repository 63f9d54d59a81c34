"""The worker side: runs transfer jobs asynchronously and reports them finished by id.

A job runs at most once, whatever the caller does. A worker paired with its ``Offloader``
(``build_local`` pairs them) asks it before running a job (``Offloader.claim``): only the job
object the Offloader handed out, still in flight and not submitted before, runs. An unpaired
worker (built with ``offloader=None``) serves the first Offloader whose job it sees (by
``TransferJob.owner``) and remembers the ids it ran: ids are increasing per Offloader, so it keeps
the last ``RUN_RECORD`` of them and refuses any id older than that window. Either way a refused
job raises ValueError before any memory is touched. A paired worker whose Offloader range-checks
block ids against this backend's layout and owns no more slots than its arena (``build_local``'s
pairing) hands jobs to ``backend.submit_checked``: they were validated in ``schedule_*``, so the
backend skips the costlier checks (see ``CopyBackend.submit_checked``).

Load deadline: a load still running ``load_timeout_s`` after ``submit`` is reported failed
(``JobResult(ok=False, timed_out=True, final=False)``: the engine recomputes those blocks) while
its copy may still write into the engine blocks; it stays in flight, its host slots pinned and its
request unsettled, until the copy really ends and its final result comes. The first time a
backend leaves a load past its deadline it is logged at ERROR, once per worker.

Every call takes this worker's lock (never while blocking on a copy), so several threads may share
one worker. After ``close``, ``submit`` raises RuntimeError; ``cancel`` and ``get_finished`` still
work, so that every request can settle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffload.config import DEFAULT_LOAD_TIMEOUT_S
from kvoffload.offload.jobs import JobResult, TransferJob
from kvoffload.transfer.backend import CopyBackend, Pending

if TYPE_CHECKING:
    from kvoffload.offload.offloader import Offloader

log = logging.getLogger(__name__)

# Job ids an unpaired worker remembers having run; an older id is refused. 2^16 jobs is far more
# than any engine keeps scheduled but unsubmitted, and costs about 4 MiB at most.
RUN_RECORD = 1 << 16


@dataclass
class _Running:
    job: TransferJob
    pending: Pending
    started: float
    deadline: float | None  # loads only: perf_counter() time it is reported failed at
    late: bool = False  # reported timed out; the copy has not ended


@dataclass
class DirectionStats:
    ok: int = 0  # jobs finished successfully
    failed: int = 0  # jobs whose copy failed (timed-out loads included, at their end)
    cancelled: int = 0  # jobs cancelled before they touched memory
    timed_out: int = 0  # loads reported failed at their deadline
    bytes: int = 0  # bytes moved by successful jobs
    seconds: float = 0.0  # submit to completion, summed over successful jobs


@dataclass
class WorkerStats:
    store: DirectionStats = field(default_factory=DirectionStats)
    load: DirectionStats = field(default_factory=DirectionStats)


class _RunRecord:
    """For an unpaired worker: whose jobs it runs, and which ids it ran (bounded)."""

    def __init__(self) -> None:
        self.owner: str | None = None
        self.floor = 0  # every id below it is refused
        self.ids: set[int] = set()

    def check(self, job: TransferJob) -> None:
        if self.owner is not None and job.owner != self.owner:
            raise ValueError(
                f"submit: expected a job of the Offloader this worker serves ({self.owner}), got "
                f"job {job.job_id} of another ({job.owner or 'none'})"
            )
        if job.job_id < self.floor or job.job_id in self.ids:
            raise ValueError(
                f"submit: expected a job not run before, got job {job.job_id} that this worker "
                "already ran (a job runs at most once)"
            )

    def add(self, job: TransferJob) -> None:
        self.owner = job.owner
        self.ids.add(job.job_id)
        if len(self.ids) > 2 * RUN_RECORD:
            self.floor = max(self.ids) - RUN_RECORD
            self.ids = {i for i in self.ids if i >= self.floor}


class TransferWorker:
    """Submits jobs to a ``CopyBackend`` and collects their results; never raises a copy error.

    A copy that fails (bad memory, a driver error) comes back as ``JobResult(ok=False, error=...)``
    for the engine to handle by recomputing; bad *input* (a malformed job, a job that ran before
    or is not its Offloader's) raises ValueError at ``submit``.
    """

    def __init__(
        self,
        backend: CopyBackend,
        offloader: Offloader | None = None,
        load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
    ) -> None:
        if isinstance(load_timeout_s, bool) or not 0 < load_timeout_s < float("inf"):
            raise ValueError(f"expected load_timeout_s > 0 seconds, got {load_timeout_s!r}")
        self.backend = backend
        self.offloader = offloader
        self.load_timeout_s = float(load_timeout_s)
        self.stats = WorkerStats()
        self._lock = threading.Lock()
        self._running: dict[int, _Running] = {}
        self._finished: list[JobResult] = []
        self._record = _RunRecord()
        self._stuck_logged = False
        self._closed = False
        self._checked = offloader is not None and _checks_cover(offloader, backend)

    def pair(self, offloader: Offloader) -> None:
        """Run only jobs ``offloader`` has in flight (see the module docstring); before the first
        ``submit``. ``build_local`` and ``LocalOffload`` pair their worker."""
        with self._lock:
            if self.offloader is offloader:
                return
            if self.offloader is not None or self._record.owner is not None:
                raise ValueError(
                    "pair: expected a worker that has run no job and has no Offloader yet"
                )
            self.offloader = offloader
            self._checked = _checks_cover(offloader, self.backend)

    def submit(self, job: TransferJob) -> None:
        """Start ``job``'s copy; ValueError, touching no memory, if it ran before, is running, is
        not its Offloader's, or is malformed; RuntimeError after ``close``."""
        with self._lock:
            if self._closed:
                raise RuntimeError("submit: this TransferWorker is closed; build a new one")
            if not isinstance(job, TransferJob):
                raise ValueError(f"submit: expected a TransferJob, got {type(job).__name__}")
            if job.job_id in self._running:
                raise ValueError(f"submit: expected a new job id, got {job.job_id} already running")
            if self.offloader is not None:
                self.offloader.claim(job)
            else:
                self._record.check(job)
            try:
                if self._checked:
                    pending = self.backend.submit_checked(job.specs)
                else:
                    pending = self.backend.submit(job.specs)
            except BaseException:
                if self.offloader is not None:
                    self.offloader.unclaim(job)
                raise
            if self.offloader is None:
                self._record.add(job)
            now = time.perf_counter()
            deadline = now + self.load_timeout_s if job.direction == "load" else None
            self._running[job.job_id] = _Running(job, pending, now, deadline)

    def cancel(self, job_ids: Iterable[int]) -> list[int]:
        """Cancel jobs that have not started; they finish as ``cancelled``. Returns those ids.

        With a paired Offloader, a job of it that was never submitted is cancelled too (it can
        then never run), so ``worker.cancel(offloader.abort(req))`` always lets ``req`` settle,
        also after ``close`` (cancelling touches no memory).
        """
        ids = _job_ids(job_ids, "cancel")
        with self._lock:
            cancelled = []
            for job_id in ids:
                job = self._cancel_one(job_id)
                if job is None:
                    continue
                getattr(self.stats, job.direction).cancelled += 1
                self._finished.append(JobResult(job_id, False, 0, 0.0, "cancelled", cancelled=True))
                cancelled.append(job_id)
            return cancelled

    def get_finished(self) -> list[JobResult]:
        """Results of jobs finished (or past their deadline) since the last call; never blocks."""
        with self._lock:
            now = time.perf_counter()
            for job_id, run in list(self._running.items()):
                if run.pending.done():
                    self._finish(job_id)
                elif not run.late and run.deadline is not None and now >= run.deadline:
                    self._expire(run, now)
            out, self._finished = self._finished, []
            return out

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> set[int]:
        """Block until ``job_ids`` finish or ``timeout`` s pass; returns those still running.

        A load past its deadline counts as finished here: ``get_finished`` reports it failed.
        """
        ids = _job_ids(job_ids, "wait")
        deadline = None if timeout is None else time.perf_counter() + timeout
        with self._lock:
            runs = [(j, self._running.get(j)) for j in ids]
        left = set()
        for job_id, run in runs:
            if run is None or run.late:
                continue
            ends = [t for t in (deadline, run.deadline) if t is not None]
            remaining = None if not ends else max(0.0, min(ends) - time.perf_counter())
            if run.pending.wait(remaining):
                continue
            if run.deadline is None or time.perf_counter() < run.deadline:
                left.add(job_id)
        return left

    def wait_on(self, job_id: int, stream: object = None, layer: int | None = None) -> None:
        """Make ``stream`` (None: the current one) wait for ``job_id``'s copy before its later work,
        e.g. attention reading blocks a load wrote. On a GPU the host does not block; see
        ``Pending.wait_on``. A job already reported finished needs no wait and returns at once.

        ``layer``: wait only for that layer of the job's layer group (an index into
        ``LayerGroup.layer_starts``: by default one per tensor given to ``KVLayout.from_tensors``),
        so layer i's attention can start while later layers are still loading. ValueError for a
        layer the group does not have.
        """
        with self._lock:
            run = self._running.get(job_id)
        if run is None:
            return
        if layer is not None:
            for spec in run.job.specs:
                self.backend.layout.groups[spec.group].layer_regions(layer)  # ValueError if absent
        run.pending.wait_on(stream, layer)

    def pending_count(self) -> int:
        with self._lock:
            return len(self._running)

    def snapshot(self) -> dict[str, Any]:
        """Counters per direction and the queue depth, in one consistent read."""
        with self._lock:
            return {"queue_depth": len(self._running), **asdict(self.stats)}

    def close(self, timeout: float = 60.0) -> None:
        """Refuse new jobs, wait up to ``timeout`` s for running ones, then release the backend."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            running = list(self._running)
        stuck = self.wait(running, timeout)
        with self._lock:
            late = [j for j, run in self._running.items() if run.late and not run.pending.done()]
        if stuck or late:
            log.warning(
                "closing with %d transfer job(s) still running: %s",
                len(stuck) + len(late),
                sorted(stuck | set(late)),
            )
        self.backend.close()

    # -- internals (the lock is held) ----------------------------------------------------------

    def _cancel_one(self, job_id: int) -> TransferJob | None:
        """The job, if it will now never touch memory: not started, or never submitted."""
        run = self._running.get(job_id)
        if run is None:
            return None if self.offloader is None else self.offloader.claim_unsubmitted(job_id)
        if run.late or not run.pending.cancel():
            return None
        del self._running[job_id]
        return run.job

    def _finish(self, job_id: int) -> None:
        run = self._running.pop(job_id)
        error = run.pending.error()
        seconds = time.perf_counter() - run.started
        stats = getattr(self.stats, run.job.direction)
        if run.late:
            stats.failed += 1
            self._finished.append(
                JobResult(
                    job_id,
                    False,
                    0,
                    seconds,
                    "the copy ended after its deadline (already reported failed)",
                    timed_out=True,
                )
            )
        elif error is None:
            stats.ok += 1
            stats.bytes += run.job.nbytes
            stats.seconds += seconds
            self._finished.append(JobResult(job_id, True, run.job.nbytes, seconds))
        else:
            stats.failed += 1
            self._finished.append(
                JobResult(job_id, False, 0, seconds, f"{type(error).__name__}: {error}")
            )

    def _expire(self, run: _Running, now: float) -> None:
        run.late = True
        self.stats.load.timed_out += 1
        message = f"TimeoutError: the load did not finish within {self.load_timeout_s:g} s"
        result = JobResult(
            run.job.job_id, False, 0, now - run.started, message, timed_out=True, final=False
        )
        self._finished.append(result)
        if not self._stuck_logged:
            self._stuck_logged = True
            log.error(
                "kvoffload: the %r copy backend left a load (job %d) running past "
                "load_timeout_s=%g s; it is reported failed (the engine recomputes) and its "
                "engine blocks stay in use until the copy ends. Later stuck loads of this worker "
                "are not logged again (count: TransferWorker.stats.load.timed_out)",
                self.backend.name or type(self.backend).__name__,
                run.job.job_id,
                self.load_timeout_s,
            )


def _checks_cover(offloader: Offloader, backend: CopyBackend) -> bool:
    """True when ``offloader.schedule_*`` checks what ``backend.submit`` would: block ids against
    the same layer groups, and slots of an index no larger than the arena."""
    groups = tuple(g.num_blocks for g in backend.layout.groups)
    return offloader.engine_blocks == groups and offloader.num_slots <= backend.arena.num_slots


def _job_ids(job_ids: Iterable[int], where: str) -> list[int]:
    ids = list(job_ids)
    bad = [j for j in ids if not isinstance(j, int) or isinstance(j, bool)]
    if bad:
        raise ValueError(f"{where}: expected int job ids, got {bad[0]!r}")
    return ids
