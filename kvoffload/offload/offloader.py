"""The scheduler side: what is held, which transfers to run, and when a request is settled.

Engine loop, one request (see ``docs/api.md`` for the full example)::

    hit = offloader.lookup(keys)                       # leading blocks held on host
    job = offloader.schedule_load(req, keys[:hit], gpu_blocks[:hit])
    worker.submit(job)                                 # async
    ... offloader.complete(worker.get_finished())      # pins released, stats counted
    job = offloader.schedule_store(req, new_keys, new_gpu_blocks)   # after compute wrote them
    ... free the request's GPU blocks only once offloader.is_settled(req)

Each job pins what it touches (host slots being read or written) until its result is passed to
``complete``. ``abort`` cancels what has not started and lets in-flight copies finish; a request
is settled once none of its jobs is in flight.

With lower tiers attached (``attach_tiers``; ``build_local`` does it when the config names a disk
path or a Valkey URL), stored blocks are also written down behind the engine's back, and
``lookup_tiers`` (a richer ``lookup``) brings blocks a tier holds up into host slots: they are
reported ``pending`` until their bytes are verified, then ``ready``, and load like any host hit.
``kvoffload.offload.lower`` has the design; none of it blocks or raises on a tier failure.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvoffload.config import OffloadConfig
from kvoffload.offload.jobs import JobResult, TransferJob
from kvoffload.offload.lower import LowerTiers, TierLookup
from kvoffload.offload.tiers import TierMover
from kvoffload.store.index import BlockIndex
from kvoffload.store.keys import BlockKey
from kvoffload.transfer.spec import Direction, TransferSpec


class Offloader:
    def __init__(self, config: OffloadConfig, slot_bytes: int) -> None:
        self.config = config
        self.slot_bytes = slot_bytes
        self.index = BlockIndex(config.num_slots(slot_bytes), slot_bytes, config.eviction_policy)
        self._ids = itertools.count()
        self._jobs: dict[int, TransferJob] = {}
        self._by_req: dict[str, set[int]] = {}
        self._aborted: set[str] = set()
        self.lower: LowerTiers | None = None

    @property
    def num_slots(self) -> int:
        return self.index.num_slots

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` are held on host, ready to load."""
        return self.index.lookup(keys)

    def schedule_load(
        self, req_id: str, keys: Sequence[BlockKey], blocks: Sequence[int], group: int = 0
    ) -> TransferJob:
        """Pin held ``keys`` and describe their copy into engine ``blocks`` (same order)."""
        blocks_arr = self._blocks(keys, blocks)
        slots = self.index.prepare_load(keys)
        return self._job(req_id, "load", keys, TransferSpec("load", blocks_arr, slots, group))

    def schedule_store(
        self, req_id: str, keys: Sequence[BlockKey], blocks: Sequence[int], group: int = 0
    ) -> TransferJob | None:
        """Reserve slots for the ``keys`` not held yet; None when there is nothing to store.

        ``blocks`` are the engine blocks holding those keys' KV; the engine must have finished
        writing them (on a GPU, the backend orders the copy after the compute stream).
        """
        blocks_arr = self._blocks(keys, blocks)
        plan = self.index.prepare_store(keys)
        if self.lower is not None:
            self.lower.evicted(plan.evicted)
        if not plan.keys:
            return None
        position = {k: i for i, k in enumerate(keys)}
        chosen = blocks_arr[[position[k] for k in plan.keys]]
        return self._job(
            req_id, "store", plan.keys, TransferSpec("store", chosen, plan.slots, group)
        )

    def touch(self, keys: Iterable[BlockKey]) -> None:
        """Mark held ``keys`` as just used (e.g. blocks the engine's GPU cache keeps hitting, so
        the host copy of a hot system prompt is not the first evicted). Unknown keys are ignored."""
        self.index.touch(keys)

    def complete(self, results: Iterable[JobResult]) -> list[TransferJob]:
        """Apply finished jobs to the index: stores become readable (or roll back), loads unpin."""
        done = []
        for result in results:
            job = self._jobs.pop(result.job_id, None)
            if job is None:
                raise ValueError(
                    f"complete: expected a job in flight, got unknown id {result.job_id}"
                )
            if job.direction == "store":
                self.index.complete_store(job.keys, result.ok)
                if result.ok and self.lower is not None:
                    self.lower.stored(job.keys)
            else:
                self.index.complete_load(job.keys, result.ok)
            jobs = self._by_req[job.req_id]
            jobs.discard(job.job_id)
            if not jobs:
                del self._by_req[job.req_id]
                self._aborted.discard(job.req_id)
            done.append(job)
        if self.lower is not None:
            self.lower.poll()
        return done

    def abort(self, req_id: str) -> list[int]:
        """Mark ``req_id`` aborted; returns its jobs in flight, for ``TransferWorker.cancel``."""
        jobs = sorted(self._by_req.get(req_id, ()))
        if jobs:
            self._aborted.add(req_id)
        return jobs

    def is_settled(self, req_id: str) -> bool:
        """True when no job of ``req_id`` is in flight: its engine blocks may be reused."""
        return req_id not in self._by_req

    # -- lower tiers (disk, Valkey) ------------------------------------------------------------

    def attach_tiers(self, mover: TierMover) -> None:
        """Write stored blocks down to ``mover``'s tiers and promote their hits (see above)."""
        slots_cap = max(1, self.num_slots // 2)
        backlog = max(1, min(self.config.tier_write_backlog_bytes // self.slot_bytes, slots_cap))
        self.lower = LowerTiers(self.index, mover, backlog)

    def lookup_tiers(self, keys: Sequence[BlockKey]) -> TierLookup:
        """Like ``lookup``, and also start bringing up the next blocks a lower tier holds.

        ``ready`` leading keys are on host now (as ``lookup`` returns); ``pending`` more after
        them are on their way (being stored, or read up from disk/Valkey and checked): look up
        again on a later step. A pending block whose read fails becomes a miss. Never blocks.
        """
        if self.lower is None:
            return TierLookup(self.index.lookup(keys), 0, False)
        return self.lower.lookup(keys)

    def poll_tiers(self) -> None:
        """Apply finished lower-tier reads and writes (``complete`` and ``lookup_tiers`` do too)."""
        if self.lower is not None:
            self.lower.poll()

    def drain_tiers(self, timeout: float) -> bool:
        """Block until every stored block is written down (or ``timeout`` s); for shutdown."""
        return True if self.lower is None else self.lower.drain(timeout)

    def tier_stats(self) -> dict[str, Any]:
        """Counters of the lower tiers: ``flow`` (writes, promotions, lost) and per tier."""
        return {} if self.lower is None else self.lower.snapshot()

    def in_flight(self, req_id: str | None = None) -> set[int]:
        if req_id is None:
            return set(self._jobs)
        return set(self._by_req.get(req_id, ()))

    def _blocks(self, keys: Sequence[BlockKey], blocks: Sequence[int]) -> np.ndarray:
        arr = np.ascontiguousarray(blocks, dtype=np.int64).reshape(-1)
        if len(arr) != len(keys):
            raise ValueError(f"expected one engine block per key ({len(keys)}), got {len(arr)}")
        return arr

    def _job(
        self, req_id: str, direction: Direction, keys: Sequence[BlockKey], spec: TransferSpec
    ) -> TransferJob:
        job = TransferJob(
            next(self._ids), req_id, direction, tuple(keys), (spec,), len(keys) * self.slot_bytes
        )
        self._jobs[job.job_id] = job
        self._by_req.setdefault(req_id, set()).add(job.job_id)
        return job
