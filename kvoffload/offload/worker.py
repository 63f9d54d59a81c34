"""The worker side: runs transfer jobs asynchronously and reports them finished by id."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from kvoffload.offload.jobs import JobResult, TransferJob
from kvoffload.transfer.backend import CopyBackend, Pending

log = logging.getLogger(__name__)


@dataclass
class _Running:
    job: TransferJob
    pending: Pending
    started: float


class TransferWorker:
    """Submits jobs to a ``CopyBackend`` and collects their results; never raises a copy error.

    A copy that fails (bad memory, a driver error) comes back as ``JobResult(ok=False, error=...)``
    for the engine to handle by recomputing; bad *input* (a malformed job) raises ValueError at
    ``submit``.
    """

    def __init__(self, backend: CopyBackend) -> None:
        self.backend = backend
        self._running: dict[int, _Running] = {}
        self._finished: list[JobResult] = []

    def submit(self, job: TransferJob) -> None:
        if job.job_id in self._running:
            raise ValueError(f"submit: expected a new job id, got {job.job_id} already running")
        self._running[job.job_id] = _Running(
            job, self.backend.submit(job.specs), time.perf_counter()
        )

    def cancel(self, job_ids: Iterable[int]) -> list[int]:
        """Cancel jobs that have not started; they finish as ``cancelled``. Returns those ids."""
        cancelled = []
        for job_id in job_ids:
            run = self._running.get(job_id)
            if run is not None and run.pending.cancel():
                del self._running[job_id]
                self._finished.append(JobResult(job_id, False, 0, 0.0, "cancelled", cancelled=True))
                cancelled.append(job_id)
        return cancelled

    def get_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call (never blocks)."""
        for job_id in [j for j, run in self._running.items() if run.pending.done()]:
            self._finish(job_id)
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> set[int]:
        """Block until ``job_ids`` finish or ``timeout`` s pass; returns those still running."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        left = set()
        for job_id in job_ids:
            run = self._running.get(job_id)
            if run is None:
                continue
            remaining = None if deadline is None else max(0.0, deadline - time.perf_counter())
            if not run.pending.wait(remaining):
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
        run = self._running.get(job_id)
        if run is None:
            return
        if layer is not None:
            for spec in run.job.specs:
                self.backend.layout.groups[spec.group].layer_regions(layer)  # ValueError if absent
        run.pending.wait_on(stream, layer)

    def pending_count(self) -> int:
        return len(self._running)

    def close(self, timeout: float = 60.0) -> None:
        """Wait up to ``timeout`` s for running jobs, then release the backend."""
        stuck = self.wait(list(self._running), timeout)
        if stuck:
            log.warning("closing with %d transfer job(s) still running: %s", len(stuck), stuck)
        self.backend.close()

    def _finish(self, job_id: int) -> None:
        run = self._running.pop(job_id)
        error = run.pending.error()
        seconds = time.perf_counter() - run.started
        if error is None:
            self._finished.append(JobResult(job_id, True, run.job.nbytes, seconds))
        else:
            self._finished.append(
                JobResult(job_id, False, 0, seconds, f"{type(error).__name__}: {error}")
            )
