"""The worker side: runs transfer jobs asynchronously and reports them finished by id.

A worker is built with the ``Offloader`` whose jobs it runs (``build_local`` builds both), and
checks at construction that the Offloader range-checks block ids against this backend's layout and
owns no more host slots than its arena. It then shares that Offloader's ``JobLedger``
(``kvoffload.offload.ledger``): ``submit`` runs only the very job object the Offloader handed out,
in flight and not submitted before, and every result ``get_finished`` hands out is recorded there,
so that ``Offloader.complete`` accepts only real results. A refused job raises ValueError before
any memory is touched. A job admitted so was validated in ``schedule_*`` and cannot have changed
since (its arrays are read-only), so it goes to ``backend.submit_checked``, which skips the
costlier checks (see ``CopyBackend.submit_checked``).

Load deadline: a load still running ``load_timeout_s`` after ``submit`` is reported failed
(``JobResult(ok=False, timed_out=True, final=False)``: the engine recomputes those blocks) while
its copy may still write into the engine blocks; it stays in flight, its host slots pinned and its
request unsettled, until the copy really ends and its final result comes. The first time a
backend leaves a load past its deadline it is logged at ERROR, once per worker.

Every call takes this worker's lock (never while blocking on a copy), so several threads may share
one worker. After ``close``, ``submit`` raises ValueError ("expected an open TransferWorker, got a
closed one"); ``cancel`` and ``get_finished`` still work, so that every request can settle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from time import perf_counter
from typing import Any

from kvoffload.config import DEFAULT_LOAD_TIMEOUT_S
from kvoffload.offload.jobs import JobResult, TransferJob
from kvoffload.offload.latency import LAYER_WAIT_BUCKETS, TRANSFER_BUCKETS, Histogram
from kvoffload.offload.offloader import Offloader
from kvoffload.transfer.backend import CopyBackend, LayerGate, LayerWaiter, Pending, check_layer
from kvoffload.transfer.stall import StallTimer

log = logging.getLogger(__name__)


class _Running:
    """A submitted job (slots, no dataclass: one is made per submit on the engine's thread)."""

    __slots__ = ("deadline", "job", "late", "pending", "started")

    def __init__(
        self, job: TransferJob, pending: Pending, started: float, deadline: float | None
    ) -> None:
        self.job = job
        self.pending = pending
        self.started = started
        self.deadline = deadline  # loads only: perf_counter() time it is reported failed at
        self.late = False  # reported timed out; the copy has not ended


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


class TransferWorker:
    """Runs the jobs of one ``Offloader`` on a ``CopyBackend`` and collects their results; never
    raises a copy error.

    A copy that fails (bad memory, a driver error) comes back as ``JobResult(ok=False, error=...)``
    for the engine to handle by recomputing; bad *input* (a job that ran before, is running, or is
    not its Offloader's) raises ValueError at ``submit``.

    >>> worker = TransferWorker(backend, offloader)  # what build_local does   # doctest: +SKIP
    """

    def __init__(
        self,
        backend: CopyBackend,
        offloader: Offloader,
        load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
    ) -> None:
        """Run ``offloader``'s jobs on ``backend``. ValueError unless ``offloader`` was built for
        ``backend``'s layout (``engine_blocks`` and ``slot_bytes`` of the layout) with at most as
        many host slots as ``backend``'s arena, or for a ``load_timeout_s`` that is not > 0."""
        if isinstance(load_timeout_s, bool) or not 0 < load_timeout_s < float("inf"):
            raise ValueError(f"expected load_timeout_s > 0 seconds, got {load_timeout_s!r}")
        _check_fit(offloader, backend)
        self.backend = backend
        self.offloader = offloader
        self.load_timeout_s = float(load_timeout_s)
        self.stats = WorkerStats()
        # successful jobs' submit-to-completion seconds per direction, and the host seconds
        # wait_on(layer=...) took for a job still running (CPU backends block until the layer
        # arrives; GPU backends only order the stream, so there it is the host's enqueue time)
        self.latency = {
            "store": Histogram(TRANSFER_BUCKETS),
            "load": Histogram(TRANSFER_BUCKETS),
            "layer_wait": Histogram(LAYER_WAIT_BUCKETS),
        }
        self._ledger = offloader._ledger  # the one record of which job may run, and its results
        self._lock = threading.Lock()
        self._running: dict[int, _Running] = {}
        self._finished: list[JobResult] = []
        self._stuck_logged = False
        self._closed = False

    def submit(self, job: TransferJob) -> None:
        """Start ``job``'s copy; ValueError, touching no memory, unless it is a job this worker's
        Offloader handed out, in flight and not submitted before, and this worker is open."""
        with self._lock:
            if self._closed:
                raise ValueError("submit: expected an open TransferWorker, got a closed one")
            self._take(job, "submit")
            try:
                self._start(job)
            except BaseException:
                self._ledger.untake(job)
                raise

    def step(self, jobs: Sequence[TransferJob], *, background: bool = False) -> list[JobResult]:
        """One call per engine step: submit ``jobs`` in order (as ``submit`` does), then return
        ``get_finished()``. ValueError, submitting none of them, unless every job is one this
        worker may run (as ``submit`` checks). An error of the copy backend itself on job k
        (its core closed under it, out of memory) propagates with jobs before k submitted (they
        run and are reported as usual) and k onwards not (each may be submitted again).

        ``background=True`` hands the copies' enqueue to the backend's own thread (the native
        ``staged`` core; other backends ignore it), so this call costs the engine's thread only
        the hand-over. Use it where the engine is about to wait for the device, e.g. stores
        handed over after a forward is launched and before its token is read; not before a
        launch, where our thread's driver calls would slow the engine's (docs/api.md,
        "Background hand-over"). A load handed over so is safe to wait on: ``wait_on`` first
        waits on the host (bounded) until its copies are enqueued, a layer's wait only until
        that layer's slice is."""
        if not isinstance(jobs, (list, tuple)):
            raise ValueError(f"step: expected a list of TransferJob, got {type(jobs).__name__}")
        if not isinstance(background, bool):
            raise ValueError(f"step: expected background True or False, got {background!r}")
        with self._lock:
            if self._closed and jobs:
                raise ValueError("step: expected an open TransferWorker, got a closed one")
            for i, job in enumerate(jobs):
                try:
                    self._take(job, "step")
                except BaseException:
                    for done in jobs[:i]:
                        self._ledger.untake(done)
                    raise
            for k, job in enumerate(jobs):
                try:
                    self._start(job, background)
                except BaseException:
                    for left in jobs[k:]:
                        self._ledger.untake(left)
                    raise
            return self._collect()  # ``get_finished`` under the same hold of the lock

    def layer_gate(self, layers: int) -> WorkerGate:
        """A ``LayerGate`` (``kvoffload.transfer.backend``) whose ``open`` takes job ids: for an
        engine whose forward is one CUDA graph with the per-layer waits captured inside it.

        >>> gate = worker.layer_gate(num_layers)                       # doctest: +SKIP
        >>> with torch.cuda.graph(g): ... gate.wait(stream, i) ...     # in the forward, per layer
        >>> gate.open(stream, [load_job_id]); g.replay()               # each step
        """
        with self._lock:
            if self._closed:
                raise ValueError("layer_gate: expected an open TransferWorker, got a closed one")
            return WorkerGate(self, self.backend.layer_gate(layers))

    def cancel(self, job_ids: Iterable[int]) -> list[int]:
        """Cancel jobs that have not started; they finish as ``cancelled``. Returns those ids.

        A job of this worker's Offloader that was never submitted is cancelled too (it can then
        never run), so ``worker.cancel(offloader.abort(req))`` always lets ``req`` settle, also
        after this worker's ``close`` (cancelling touches no memory). Once the Offloader is closed
        every job is settled already: nothing is left to cancel and this returns [].
        """
        ids = _job_ids(job_ids, "cancel")
        with self._lock:
            return self._cancel_locked(ids)

    def get_finished(self) -> list[JobResult]:
        """Results of jobs finished (or past their deadline) since the last call; never blocks."""
        with self._lock:
            return self._collect()

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
        layer the group does not have, and for a job id its Offloader never handed out.
        """
        run = self._run_of(job_id, "wait_on")
        if run is None:
            return
        if layer is not None:
            for spec in run.job.specs:
                self.backend.layout.groups[spec.group].layer_regions(layer)  # ValueError if absent
        start = time.perf_counter()
        run.pending.wait_on(stream, layer)
        if layer is not None:
            self.latency["layer_wait"].observe(time.perf_counter() - start)

    def enqueued(self, job_id: int) -> bool:
        """True once every copy of ``job_id`` is enqueued (or the job finished, or will never
        run), so ``wait_on(job_id)`` of the whole job would not wait on the host; never blocks.
        False only for a job handed over with ``step(..., background=True)`` (or queued behind
        another) whose copies kvoffload's thread is still enqueueing. ValueError for a job id
        its Offloader never handed out."""
        run = self._run_of(job_id, "enqueued")
        return run is None or run.pending.enqueued()

    def layer_waiter(
        self, job_id: int, stream: object = None, timer: StallTimer | None = None
    ) -> LayerWaiter:
        """``wait_on(job_id, stream, layer)`` bound once, for an engine that waits before each
        layer's attention: ``waiter = worker.layer_waiter(job_id, stream)``, then ``waiter(i)``
        per layer (ValueError for a layer the job's groups do not have; the copy's error raised
        as ``wait_on`` raises it). The job, the stream and the layer count are resolved here and
        the waiter is the backend's own (``Pending.layer_waiter``), so a call is one Python call
        that checks ``layer``: against the job's groups while its Offloader has it in flight,
        against the largest group once it was completed (nothing is left to wait for). On the
        native core a waiter enqueues one GPU-side wait per layer slice of the load: the other
        layers of a slice return without a driver call.

        ``timer`` (a ``StallTimer`` of at least the job's layers): each layer's wait is timed
        into it, on the device where the wait is the device's (docs/api.md, "Stalls")."""
        if timer is not None and not isinstance(timer, StallTimer):
            raise ValueError(
                f"layer_waiter: expected timer a StallTimer or None, got {type(timer).__name__}"
            )
        run = self._run_of(job_id, "layer_waiter")
        groups = self.backend.layout.groups
        job = run.job if run is not None else self._ledger.job(job_id)
        if job is not None:
            layers = min((groups[s.group].num_layers for s in job.specs), default=0)
        else:
            layers = max(g.num_layers for g in groups)
        if timer is not None and timer.layers < layers:
            raise ValueError(
                f"layer_waiter: expected a StallTimer of >= {layers} layers (the job's), "
                f"got {timer.layers}"
            )
        if run is not None:
            if timer is None:
                return run.pending.layer_waiter(stream, layers)
            return run.pending.layer_waiter(stream, layers, timer)

        def landed(layer: int) -> None:
            if type(layer) is not int or not 0 <= layer < layers:
                check_layer(layer, layers)

        return landed

    def pending_count(self) -> int:
        with self._lock:
            return len(self._running)

    def snapshot(self) -> dict[str, Any]:
        """Counters per direction and the queue depth, in one consistent read, and ``latency``:
        the histograms' snapshots (``Histogram.snapshot``) by name."""
        with self._lock:
            latency = {name: h.snapshot() for name, h in self.latency.items()}
            return {"queue_depth": len(self._running), **asdict(self.stats), "latency": latency}

    def close(self, timeout: float = 60.0) -> None:
        """Refuse new jobs, wait up to ``timeout`` s for submitted ones, cancel those that have
        not started by then, and release the backend. Their results still come from
        ``get_finished``. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            running = list(self._running)
        self.wait(running, timeout)
        with self._lock:
            self._cancel_locked(list(self._running))  # those that have not started yet
            stuck = sorted(j for j, run in self._running.items() if not run.pending.done())
        if stuck:
            log.warning("closing with %d transfer job(s) still running: %s", len(stuck), stuck)
        self.backend.close()

    def _run_of(self, job_id: int, where: str) -> _Running | None:
        """``job_id``'s running job (None once it finished); ValueError for an id its Offloader
        never handed out."""
        with self._lock:
            run = self._running.get(job_id)
        if run is None and not self._ledger.handed_out(job_id):
            raise ValueError(f"{where}: expected a job id its Offloader handed out, got {job_id!r}")
        return run

    # -- internals (the lock is held) ----------------------------------------------------------

    def _take(self, job: TransferJob, where: str) -> None:
        """Claim ``job`` in the ledger; ValueError, changing nothing, unless it may run here."""
        if not isinstance(job, TransferJob):
            raise ValueError(f"{where}: expected a TransferJob, got {type(job).__name__}")
        if job.job_id in self._running:
            raise ValueError(f"{where}: expected a new job id, got {job.job_id} already running")
        self._ledger.take(job, where)

    def _start(self, job: TransferJob, background: bool = False) -> None:
        """Hand a claimed job's copy to the backend and track it (its deadline for a load)."""
        if background:
            pending = self.backend.submit_checked(job.specs, background=True)
        else:
            pending = self.backend.submit_checked(job.specs)
        now = perf_counter()
        deadline = now + self.load_timeout_s if job.direction == "load" else None
        self._running[job.job_id] = _Running(job, pending, now, deadline)

    def _collect(self) -> list[JobResult]:
        """``get_finished``'s work."""
        running = self._running
        if running:
            now = perf_counter()
            for job_id, run in list(running.items()):
                if run.pending.done():
                    self._finish(job_id, now)
                elif not run.late and run.deadline is not None and now >= run.deadline:
                    self._expire(run, now)
        out = self._finished
        if out:
            self._finished = []
            self._ledger.report(out)  # what Offloader.complete will accept
            return out
        return []

    def _cancel_locked(self, job_ids: list[int]) -> list[int]:
        cancelled = []
        for job_id in job_ids:
            job = self._cancel_one(job_id)
            if job is None:
                continue
            getattr(self.stats, job.direction).cancelled += 1
            self._finished.append(JobResult(job_id, False, 0, 0.0, "cancelled", cancelled=True))
            cancelled.append(job_id)
        return cancelled

    def _cancel_one(self, job_id: int) -> TransferJob | None:
        """The job, if it will now never touch memory: not started, or never submitted."""
        run = self._running.get(job_id)
        if run is None:
            return self._ledger.take_unsubmitted(job_id)
        if run.late or not run.pending.cancel():
            return None
        del self._running[job_id]
        return run.job

    def _finish(self, job_id: int, now: float) -> None:
        run = self._running.pop(job_id)
        job = run.job
        error = run.pending.error()
        seconds = now - run.started  # ``now``: when get_finished looked, just before done()
        stats = getattr(self.stats, job.direction)
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
            nbytes = job.nbytes
            stats.ok += 1
            stats.bytes += nbytes
            stats.seconds += seconds
            self.latency[job.direction].observe(seconds)
            self._finished.append(JobResult(job_id, True, nbytes, seconds))
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


class WorkerGate:
    """``TransferWorker.layer_gate``: a ``LayerGate`` opened by job ids. A job already finished
    (or never submitted to this worker) counts as landed."""

    def __init__(self, worker: TransferWorker, gate: LayerGate) -> None:
        self._worker = worker
        self.gate = gate
        self.layers = gate.layers

    def wait(self, stream: object, layer: int) -> None:
        """Enqueue on ``stream`` (capturable in a CUDA graph): wait until ``layer`` is open.
        ValueError for a layer outside the gate."""
        self.gate.wait(stream, layer)

    def open(self, stream: object, job_ids: Iterable[int]) -> None:
        """Once per step, before the replay on ``stream`` (also with no jobs): close every layer,
        then open each once every job in ``job_ids`` has landed it; the host does not wait for
        the copies. A replay without an ``open`` of its own passes what the last one opened."""
        ids = _job_ids(job_ids, "open")
        with self._worker._lock:
            pendings = [run.pending for j in ids if (run := self._worker._running.get(j))]
        self.gate.open(stream, pendings)


def _check_fit(offloader: Offloader, backend: CopyBackend) -> None:
    """ValueError unless ``offloader.schedule_*`` checks what ``backend.submit`` would: block ids
    against the same layer groups, slots of an index no larger than the arena."""
    if not isinstance(offloader, Offloader):
        raise ValueError(
            f"expected the Offloader whose jobs this worker runs, got {type(offloader).__name__}"
        )
    groups = tuple(g.num_blocks for g in backend.layout.groups)
    if offloader.engine_blocks != groups or offloader.slot_bytes != backend.layout.slot_bytes:
        raise ValueError(
            "expected an Offloader built for this backend's layout (engine_blocks="
            f"{list(groups)}, slot_bytes={backend.layout.slot_bytes}, as build_local passes), got "
            f"engine_blocks={offloader.engine_blocks}, slot_bytes={offloader.slot_bytes}"
        )
    if offloader.num_slots > backend.arena.num_slots:
        raise ValueError(
            f"expected an Offloader with at most {backend.arena.num_slots} host slots (the "
            f"backend's arena), got {offloader.num_slots}"
        )


def _job_ids(job_ids: Iterable[int], where: str) -> list[int]:
    ids = list(job_ids)
    bad = [j for j in ids if not isinstance(j, int) or isinstance(j, bool)]
    if bad:
        raise ValueError(f"{where}: expected int job ids, got {bad[0]!r}")
    return ids
