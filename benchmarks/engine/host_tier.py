"""kvoffload as the engine's second tier, through the public engine-neutral API only.

This file is the integration example of ``docs/e2e.md``. The engine calls:

- ``lookup(keys)`` for the blocks its GPU prefix cache missed: how many of them the host holds;
- ``load(req, keys, blocks)`` to copy those into freshly allocated GPU blocks before prefill
  (blocking: prefill reads them next); a failed or timed-out load is a miss, never wrong KV;
- ``store(req, keys, blocks)`` right after compute wrote new full blocks (write-behind: the copy
  runs beside the next compute, and a block is on host long before the GPU pool evicts it);
- ``settled(req)`` before a finished request's blocks go back to the free queue: a block whose
  store is still reading it must not be overwritten.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import kvoffload as kvo
from benchmarks.engine.kv_cache import PagedKVCache

BlockKey = bytes


@dataclass
class TierStats:
    loads: int = 0  # blocks
    load_bytes: int = 0
    load_seconds: float = 0.0  # submit to completion, summed over load jobs
    stores: int = 0
    store_bytes: int = 0
    store_seconds: float = 0.0  # submit to the poll that saw it finish: an upper bound
    failures: int = 0


class HostTier:
    def __init__(
        self, cache: PagedKVCache, config: kvo.OffloadConfig, load_timeout: float = 30.0
    ) -> None:
        self.layout = kvo.KVLayout.from_tensors(cache.tensors, cache.block_size, block_dim=1)
        self.local = kvo.build_local(self.layout, config)
        self.offloader = self.local.offloader
        self.worker = self.local.worker
        self.load_timeout = load_timeout
        self.stats = TierStats()

    @property
    def capacity_blocks(self) -> int:
        return self.offloader.num_slots

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        return self.offloader.lookup(keys)

    def load(self, req_id: str, keys: Sequence[BlockKey], blocks: Sequence[int]) -> bool:
        """Copy held ``keys`` into GPU ``blocks``; True once their KV is there.

        False means recompute: the load failed, or did not finish within ``load_timeout`` (then
        ``blocks`` may still be written to until ``settled(req_id)``).
        """
        job = self.offloader.schedule_load(req_id, keys, blocks)
        self.worker.submit(job)
        if self.worker.wait([job.job_id], self.load_timeout):
            self.worker.cancel(self.offloader.abort(req_id))
        results = {r.job_id: r for r in self._poll()}
        result = results.get(job.job_id)
        return result is not None and result.ok

    def store(self, req_id: str, keys: Sequence[BlockKey], blocks: Sequence[int]) -> None:
        """Start copying new full blocks to host (keys held already are skipped)."""
        job = self.offloader.schedule_store(req_id, keys, blocks)
        if job is not None:
            self.worker.submit(job)

    def settled(self, req_id: str) -> bool:
        self._poll()
        return self.offloader.is_settled(req_id)

    def wait_settled(self, req_id: str) -> None:
        self.worker.wait(self.offloader.in_flight(req_id))
        self._poll()

    def close(self) -> None:
        self.local.close()

    def _poll(self) -> list[kvo.JobResult]:
        results = self.worker.get_finished()
        jobs = {j.job_id: j for j in self.offloader.complete(results)}
        s = self.stats
        for r in results:
            n = len(jobs[r.job_id].keys)
            if not r.ok:
                s.failures += n
            elif jobs[r.job_id].direction == "load":
                s.loads += n
                s.load_bytes += r.nbytes
                s.load_seconds += r.seconds
            else:
                s.stores += n
                s.store_bytes += r.nbytes
                s.store_seconds += r.seconds
        return results
