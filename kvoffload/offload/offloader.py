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
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np

from kvoffload.config import OffloadConfig
from kvoffload.offload.jobs import JobResult, TransferJob
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
        if not plan.keys:
            return None
        position = {k: i for i, k in enumerate(keys)}
        chosen = blocks_arr[[position[k] for k in plan.keys]]
        return self._job(
            req_id, "store", plan.keys, TransferSpec("store", chosen, plan.slots, group)
        )

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
            else:
                self.index.complete_load(job.keys, result.ok)
            jobs = self._by_req[job.req_id]
            jobs.discard(job.job_id)
            if not jobs:
                del self._by_req[job.req_id]
                self._aborted.discard(job.req_id)
            done.append(job)
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
