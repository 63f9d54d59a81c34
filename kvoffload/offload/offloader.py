"""The scheduler side: what is held, which transfers to run, and when a request is settled.

Engine loop, one request (see ``docs/api.md`` for the full example)::

    hit = offloader.lookup(keys)                       # leading blocks held on host
    job = offloader.schedule_load(req, keys[:hit], gpu_blocks[:hit])
    worker.submit(job)                                 # async
    ... offloader.complete(worker.get_finished())      # pins released, stats counted
    job = offloader.schedule_store(req, new_keys, new_gpu_blocks)   # after compute wrote them
    ... free the request's GPU blocks only once offloader.is_settled(req)

Each job pins what it touches (host slots being read or written) until its final result is passed
to ``complete``. ``abort`` cancels what has not started and lets in-flight copies finish; a
request is settled once none of its jobs is in flight. A load past its deadline is reported failed
early (``JobResult.final=False``: recompute) but stays in flight until its copy really ended.

Every call validates all of its input before it changes anything: a refused call (ValueError)
leaves the index, the pins and the request's bookkeeping as they were. Every call takes this
object's lock, so several threads may share one Offloader. After ``close`` the calls that act
raise RuntimeError; ``is_settled``, ``in_flight`` and the statistics still answer.

A job runs at most once: each job carries this Offloader's ``token``, and a ``TransferWorker``
paired with it (``build_local`` pairs them) runs only a job this Offloader has in flight and has
not handed out before (``claim``).

With lower tiers attached (``attach_tiers``; ``build_local`` does it when the config names a disk
path or a Valkey URL), stored blocks are also written down behind the engine's back, and
``lookup_tiers`` (a richer ``lookup``) brings blocks a tier holds up into host slots: they are
reported ``pending`` until their bytes are verified, then ``ready``, and load like any host hit.
``kvoffload.offload.lower`` has the design; none of it blocks or raises on a tier failure.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvoffload.config import OffloadConfig
from kvoffload.offload.jobs import JobResult, TransferJob
from kvoffload.offload.lower import LowerTiers, TierLookup
from kvoffload.offload.tiers import TierMover
from kvoffload.store.index import BlockIndex
from kvoffload.store.keys import BlockKey, checked_keys
from kvoffload.transfer.spec import Direction, TransferSpec, check_engine_blocks


class Offloader:
    def __init__(
        self,
        config: OffloadConfig,
        slot_bytes: int,
        engine_blocks: Sequence[int] | None = None,
        block_size: int | None = None,
    ) -> None:
        """``engine_blocks``: the engine's blocks per layer group (``build_local`` passes the
        layout's), so that block ids are range-checked at ``schedule_*``; None checks only
        ``>= 0``. ``block_size``: tokens per block, for the prefill-tokens-saved count."""
        if not isinstance(slot_bytes, int) or isinstance(slot_bytes, bool) or slot_bytes <= 0:
            raise ValueError(f"expected slot_bytes to be a positive int, got {slot_bytes!r}")
        if engine_blocks is not None and (
            not engine_blocks or any(not isinstance(n, int) or n <= 0 for n in engine_blocks)
        ):
            raise ValueError(f"expected engine_blocks > 0 per layer group, got {engine_blocks}")
        self.config = config
        self.slot_bytes = slot_bytes
        self.engine_blocks = None if engine_blocks is None else tuple(engine_blocks)
        self.block_size = block_size
        self.token = secrets.token_hex(8)  # stamped on every job: whose it is
        self.index = BlockIndex(config.num_slots(slot_bytes), slot_bytes, config.eviction_policy)
        self.lower: LowerTiers | None = None
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._jobs: dict[int, TransferJob] = {}
        self._by_req: dict[str, set[int]] = {}
        self._aborted: set[str] = set()
        self._claimed: set[int] = set()  # handed to the paired worker (submitted or cancelled)
        self._late: set[int] = set()  # loads reported timed out whose copy has not ended
        self._timed_out = 0  # loads reported timed out, ever
        self._closed = False

    @property
    def num_slots(self) -> int:
        return self.index.num_slots

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` are held on host, ready to load."""
        with self._lock:
            self._check_open("lookup")
            return self.index.lookup(checked_keys(keys, "lookup"))

    def schedule_load(
        self, req_id: str, keys: Sequence[BlockKey], blocks: Sequence[int], group: int = 0
    ) -> TransferJob:
        """Pin held ``keys`` and describe their copy into engine ``blocks`` (same order, distinct).

        Raises ValueError, changing nothing, unless every key is held (READABLE) and ``blocks``
        are distinct engine block ids of layer ``group``, one per key.
        """
        with self._lock:
            self._check_open("schedule_load")
            keys = checked_keys(keys, "schedule_load")
            blocks_arr = self._engine_blocks(req_id, keys, blocks, group, "load")
            slots = self.index.prepare_load(keys)
            return self._job(req_id, "load", keys, TransferSpec("load", blocks_arr, slots, group))

    def schedule_store(
        self, req_id: str, keys: Sequence[BlockKey], blocks: Sequence[int], group: int = 0
    ) -> TransferJob | None:
        """Reserve slots for the ``keys`` not held yet; None when there is nothing to store.

        ``blocks`` are the engine blocks holding those keys' KV (a block may repeat; keys may
        not); the engine must have finished writing them (on a GPU, the backend orders the copy
        after the compute stream). Raises ValueError, changing nothing, on bad input.
        """
        with self._lock:
            self._check_open("schedule_store")
            keys = checked_keys(keys, "schedule_store")
            blocks_arr = self._engine_blocks(req_id, keys, blocks, group, "store")
            plan = self.index.prepare_store(keys)
            if self.lower is not None:
                self.lower.evicted(plan.evicted)
            if not plan.keys:
                return None
            position = {k: i for i, k in enumerate(keys)}
            chosen = blocks_arr[[position[k] for k in plan.keys]]
            spec = TransferSpec("store", chosen, plan.slots, group)
            return self._job(req_id, "store", plan.keys, spec)

    def touch(self, keys: Iterable[BlockKey]) -> None:
        """Mark held ``keys`` as just used (e.g. blocks the engine's GPU cache keeps hitting, so
        the host copy of a hot system prompt is not the first evicted). Unknown keys are ignored."""
        with self._lock:
            self._check_open("touch")
            self.index.touch(checked_keys(keys, "touch"))

    def complete(self, results: Iterable[JobResult]) -> list[TransferJob]:
        """Apply finished jobs to the index: stores become readable (or roll back), loads unpin.

        Returns the job of each result applied. A result whose id is not in flight (unknown,
        already completed, or not a ``JobResult``) does not stop the others: every known one is
        applied first, so no request is stranded, and then ValueError names the unknown ids.
        A ``final=False`` result (a load past its deadline) counts the timeout and keeps the job
        in flight, its host slots pinned, until its final result.
        """
        with self._lock:
            self._check_open("complete")
            done: list[TransferJob] = []
            unknown: list[object] = []
            for result in results:
                known = isinstance(result, JobResult) and isinstance(result.job_id, int)
                job = self._jobs.get(result.job_id) if known else None
                if job is None or (not result.final and job.job_id in self._late):
                    unknown.append(getattr(result, "job_id", result))
                    continue
                if result.final:
                    self._apply(job, result)
                else:
                    self._late.add(job.job_id)
                    self._timed_out += 1
                done.append(job)
            if self.lower is not None:
                self.lower.poll()
            if unknown:
                raise ValueError(
                    f"complete: expected results of jobs in flight, got unknown id(s) {unknown} "
                    f"(the {len(done)} known result(s) were applied)"
                )
            return done

    def abort(self, req_id: str) -> list[int]:
        """Mark ``req_id`` aborted; returns its jobs in flight, for ``TransferWorker.cancel``
        (which also settles jobs of it that were never submitted)."""
        with self._lock:
            self._check_open("abort")
            jobs = sorted(self._by_req.get(req_id, ()))
            if jobs:
                self._aborted.add(req_id)
            return jobs

    def is_settled(self, req_id: str) -> bool:
        """True when no job of ``req_id`` is in flight: its engine blocks may be reused."""
        with self._lock:
            return req_id not in self._by_req

    def close(self) -> None:
        """Refuse further calls (RuntimeError). Idempotent; ``LocalOffload.close`` calls it."""
        with self._lock:
            self._closed = True

    # -- the paired worker ---------------------------------------------------------------------

    def claim(self, job: TransferJob) -> None:
        """Hand ``job`` to the paired worker to run: ValueError unless it is this Offloader's job
        (the very object ``schedule_*`` returned), in flight, and not handed out before."""
        with self._lock:
            self._check_open("claim")
            if not isinstance(job, TransferJob) or self._jobs.get(job.job_id) is not job:
                what = getattr(job, "job_id", job)
                raise ValueError(
                    f"submit: expected a job this worker's Offloader has in flight, got job {what}"
                    " that it did not create or has already completed (a job runs at most once)"
                )
            if job.job_id in self._claimed:
                raise ValueError(
                    f"submit: expected a job not submitted before, got job {job.job_id} that was "
                    "already submitted or cancelled (a job runs at most once)"
                )
            self._claimed.add(job.job_id)

    def unclaim(self, job: TransferJob) -> None:
        """Undo ``claim`` for a job the worker's backend refused before it touched memory."""
        with self._lock:
            self._claimed.discard(job.job_id)

    def claim_unsubmitted(self, job_id: int) -> TransferJob | None:
        """Claim an in-flight job that was never submitted, so that the worker can report it
        cancelled (it will never run); None if there is no such job."""
        with self._lock:
            job = self._jobs.get(job_id)
            if self._closed or job is None or job_id in self._claimed:
                return None
            self._claimed.add(job_id)
            return job

    # -- lower tiers (disk, Valkey) ------------------------------------------------------------

    def attach_tiers(self, mover: TierMover) -> None:
        """Write stored blocks down to ``mover``'s tiers and promote their hits (see above)."""
        with self._lock:
            slots_cap = max(1, self.num_slots // 2)
            backlog_bytes = self.config.tier_write_backlog_bytes
            backlog = max(1, min(backlog_bytes // self.slot_bytes, slots_cap))
            self.lower = LowerTiers(self.index, mover, backlog)

    def lookup_tiers(self, keys: Sequence[BlockKey]) -> TierLookup:
        """Like ``lookup``, and also start bringing up the next blocks a lower tier holds.

        ``ready`` leading keys are on host now (as ``lookup`` returns); ``pending`` more after
        them are on their way (being stored, or read up from disk/Valkey and checked): look up
        again on a later step. A pending block whose read fails becomes a miss. Never blocks.
        """
        with self._lock:
            self._check_open("lookup_tiers")
            keys = checked_keys(keys, "lookup_tiers")
            if self.lower is None:
                return TierLookup(self.index.lookup(keys), 0, False)
            return self.lower.lookup(keys)

    def poll_tiers(self) -> None:
        """Apply finished lower-tier reads and writes (``complete`` and ``lookup_tiers`` do too)."""
        with self._lock:
            self._check_open("poll_tiers")
            if self.lower is not None:
                self.lower.poll()

    def drain_tiers(self, timeout: float) -> bool:
        """Block until every stored block is written down (or ``timeout`` s); for shutdown. Other
        threads' calls wait meanwhile."""
        with self._lock:
            self._check_open("drain_tiers")
            return True if self.lower is None else self.lower.drain(timeout)

    def tier_stats(self) -> dict[str, Any]:
        """Counters of the lower tiers: ``flow`` (writes, promotions, lost) and per tier."""
        with self._lock:
            return {} if self.lower is None else self.lower.snapshot()

    # -- introspection -------------------------------------------------------------------------

    def in_flight(self, req_id: str | None = None) -> set[int]:
        with self._lock:
            if req_id is None:
                return set(self._jobs)
            return set(self._by_req.get(req_id, ()))

    def snapshot(self) -> dict[str, Any]:
        """Counters and gauges in one consistent read (``kvoffload.metrics`` exports them)."""
        with self._lock:
            ix = self.index
            saved = None if self.block_size is None else ix.stats.loads * self.block_size
            return {
                "host": ix.stats.snapshot(),
                "slots": {
                    "total": ix.num_slots,
                    "free": ix.num_free,
                    "writing": ix.num_writing,
                    "readable": ix.num_readable,
                    "pinned": ix.num_pinned,
                },
                "jobs_in_flight": len(self._jobs),
                "loads_timed_out": self._timed_out,
                "loads_late": len(self._late),
                "prefill_tokens_saved": saved,
                "tiers": {} if self.lower is None else self.lower.snapshot(),
            }

    # -- internals (the lock is held) ----------------------------------------------------------

    def _check_open(self, where: str) -> None:
        if self._closed:
            raise RuntimeError(f"{where}: this Offloader is closed; build a new one")

    def _engine_blocks(
        self,
        req_id: str,
        keys: list[BlockKey],
        blocks: Sequence[int],
        group: int,
        direction: Direction,
    ) -> np.ndarray:
        if not isinstance(req_id, str):
            raise ValueError(f"schedule_{direction}: expected a str req_id, got {req_id!r}")
        raw = np.asarray(blocks)
        if raw.size and raw.dtype.kind not in "iu":
            raise ValueError(
                f"schedule_{direction}: expected int engine block ids, got dtype {raw.dtype}"
            )
        arr = np.ascontiguousarray(raw, dtype=np.int64).reshape(-1)
        if len(arr) != len(keys) or raw.ndim > 1:
            raise ValueError(
                f"schedule_{direction}: expected one engine block per key ({len(keys)}), got "
                f"{len(arr)}"
            )
        try:
            check_engine_blocks(direction, arr, group, self.engine_blocks)
        except ValueError as err:
            raise ValueError(f"schedule_{direction}: {err}") from None
        return arr

    def _job(
        self, req_id: str, direction: Direction, keys: Sequence[BlockKey], spec: TransferSpec
    ) -> TransferJob:
        job = TransferJob(
            next(self._ids),
            req_id,
            direction,
            tuple(keys),
            (spec,),
            len(keys) * self.slot_bytes,
            self.token,
        )
        self._jobs[job.job_id] = job
        self._by_req.setdefault(req_id, set()).add(job.job_id)
        return job

    def _apply(self, job: TransferJob, result: JobResult) -> None:
        """The job's final result: release what it held; its request may settle."""
        del self._jobs[job.job_id]
        self._claimed.discard(job.job_id)
        late = job.job_id in self._late
        self._late.discard(job.job_id)
        ok = result.ok and not late  # a late load was reported failed: the engine recomputed
        if job.direction == "store":
            self.index.complete_store(job.keys, ok)
            if ok and self.lower is not None:
                self.lower.stored(job.keys)
        else:
            self.index.complete_load(job.keys, ok)
        jobs = self._by_req[job.req_id]
        jobs.discard(job.job_id)
        if not jobs:
            del self._by_req[job.req_id]
            self._aborted.discard(job.req_id)
