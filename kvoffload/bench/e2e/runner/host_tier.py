"""kvoffload as the engine's second tier, through the public engine-neutral API only.

This file is the integration example of ``docs/e2e.md``. The engine calls:

- ``lookup(keys)`` for the blocks its GPU prefix cache missed: how many of them the host holds;
- ``start_load(req, keys, blocks)`` to start copying those into freshly allocated GPU blocks
  (nothing waits here), then ``wait_layer(load, i)`` right before layer i's attention reads them
  (on a GPU the compute stream waits, the host does not), then ``finish_load(load)`` before the
  first token is used: a failed or timed-out load is a miss, recomputed, never wrong KV;
- ``store(req, keys, blocks)`` for blocks whose KV should reach host (after compute wrote them);
- ``settled(req)`` before blocks a store reads go back to the free queue: a block whose store is
  still reading it must not be overwritten.

Jobs reach the worker in one call per engine step, ``TransferWorker.step(jobs)``, which submits
them and returns the jobs finished since the last step: ``store`` queues its job, ``poll`` (and
``start_load``, which must not wait) hands the queue over. A load's per-layer waits go through one
``TransferWorker.layer_waiter`` bound at its first wait (a native wait per layer slice after that);
a forward captured whole in a CUDA graph waits through ``layer_gate`` instead. Every kvoffload
call goes through a ``calls.timed`` proxy, so ``calls`` holds the host time the engine's thread
spent inside them (``LAYER_WAIT`` names the per-layer wait).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvoffload as kvo
from kvoffload.bench.e2e.runner.calls import INSTRUMENT, PROBE, CallClock, timed
from kvoffload.bench.e2e.runner.kv_cache import PagedKVCache

BlockKey = bytes
LAYER_WAIT = "worker.layer_waiter(layer)"  # the per-layer wait's name in ``calls``
log = logging.getLogger(__name__)


@dataclass
class TierStats:
    loads: int = 0  # blocks
    load_bytes: int = 0
    load_seconds: float = 0.0  # submit to completion seen, summed over load jobs
    stores: int = 0
    store_bytes: int = 0
    store_seconds: float = 0.0  # submit to the poll that saw it finish: an upper bound
    failures: int = 0


@dataclass
class Load:
    """One load in flight, from ``start_load`` to ``finish_load``."""

    req_id: str
    job_id: int
    blocks: int
    submitted: float  # perf_counter at submit
    start: Any = None  # CUDA event recorded on the engine's stream before the submit
    end: Any = None  # CUDA event on a side stream, once every layer has arrived
    failed: bool = False  # a layer's wait raised: the copy failed
    waiter: Any = None  # TransferWorker.layer_waiter, bound at the first layer's wait
    timer: Any = None  # the waits' StallTimer (per layer GPU wait), where they are timed
    specs: tuple[Any, ...] = ()  # the job's TransferSpecs (``slot_runs`` reads their slots)


def slot_runs(specs: Sequence[Any]) -> int:
    """Runs of consecutive host slots a load reads, over its specs: the native core moves each
    run as one pitched copy per layer slice (benchmarks/runs_probe.py times what each costs)."""
    runs = 0
    for spec in specs:
        slots = np.sort(np.asarray(spec.slots))
        if len(slots):
            runs += 1 + int(np.count_nonzero(np.diff(slots) != 1))
    return runs


class HostTier:
    def __init__(
        self, cache: PagedKVCache, config: kvo.OffloadConfig, load_timeout: float = 30.0
    ) -> None:
        self.layout = kvo.KVLayout.from_tensors(cache.tensors, cache.block_size, block_dim=1)
        self.local = kvo.build_local(self.layout, config)
        self.calls = CallClock()  # host time inside every kvoffload call (the attribution)
        self.offloader = timed(self.local.offloader, self.calls, "offloader")
        self.worker = timed(self.local.worker, self.calls, "worker")
        self._queued: list[kvo.TransferJob] = []  # scheduled, handed over at the next step
        self._gate: Any = None
        self._stalls: kvo.StallTimer | None = None  # ``stall_timer``
        self.load_timeout = load_timeout
        self.layers = self.layout.groups[0].num_layers
        self.stats = TierStats()
        self._load_ok: dict[int, bool] = {}  # finished loads' results, until finish_load
        self.cuda = self.layout.is_cuda
        self._probe: Any = None  # a CUDA stream that only waits for loads, to time them
        if self.cuda:
            import torch

            self._probe = torch.cuda.Stream(cache.tensors[0].device)  # type: ignore[no-untyped-call]

    @property
    def capacity_blocks(self) -> int:
        return self.offloader.num_slots

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        return self.offloader.lookup(keys)

    def start_load(
        self,
        req_id: str,
        keys: Sequence[BlockKey],
        blocks: Sequence[int],
        background: bool = False,
    ) -> Load:
        """Start copying held ``keys`` into GPU ``blocks`` (ordered after the work enqueued so far
        on the current stream, which may still read those blocks' old contents). ``background``:
        kvoffload's thread enqueues the copies (the layer waits need not wait for that)."""
        job = self.offloader.schedule_load(req_id, keys, blocks)
        start = None
        if self.cuda:
            import torch

            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
        self._queued.append(job)
        self.poll(background)  # the load starts now, with the stores queued before it
        load = Load(req_id, job.job_id, len(keys), time.perf_counter(), start, specs=job.specs)
        if not background:  # its end marked on the device now: load_ms is the load's own time
            self.time_load(load)  # (background: once kvoffload's thread has enqueued it)
        return load

    def wait_layer(self, load: Load, layer: int) -> None:
        """Before layer ``layer``'s attention reads the loaded blocks: on a GPU the current stream
        waits for that layer's copy (the host does not block); on a CPU the host waits. A copy
        that failed is noted and ends as a miss in ``finish_load``; the caller recomputes."""
        if load.waiter is None:  # bound to the current stream, once per load
            load.waiter = self.worker.layer_waiter(load.job_id, timer=load.timer)
        self._guard(load, layer, LAYER_WAIT, load.waiter, layer)
        if (
            self.cuda
            and load.end is None
            and self.calls.call(f"{PROBE}enqueued", self.local.worker.enqueued, load.job_id)
        ):
            self.time_load(load)  # a background load's end, once its copies are enqueued

    def end_waits(self, load: Load | None) -> None:
        """After the forward's layer waits: the StallTimer's own records, inside their time, noted
        apart (``calls.INSTRUMENT``)."""
        if load is not None and load.timer is not None:
            self.calls.note(INSTRUMENT, load.timer.own_seconds())

    def stall_timer(self) -> kvo.StallTimer:
        """The tier's StallTimer, reset: for one load's waits (one request at a time)."""
        if self._stalls is None:
            self._stalls = kvo.StallTimer(self.layers)
        self._stalls.reset()
        return self._stalls

    def layer_waits(self, load: Load, sections: dict[str, float], layers: int) -> list[float]:
        """Per layer, seconds its attention waited for ``load`` on the device, once the device
        passed the forward: from the waits' StallTimer where the waiter ran (eager, piecewise),
        else from the sections a full graph's captured events timed (``wait{i}``)."""
        if load.waiter is None or load.timer is None:
            return [sections.pop(f"wait{i}", 0.0) for i in range(layers)]
        stalls = load.timer.stalls()[:layers]
        if any(s is None for s in stalls):
            raise RuntimeError(f"expected the device past every timed wait, got {stalls}")
        return [float(s) for s in stalls]

    def time_load(self, load: Load) -> None:
        """On a GPU, record ``load.end`` when the load's last byte lands (a side stream waits for
        its last layer, whose words the load writes with its end, enqueued right after the
        submit, so the event marks the load's end and not when the host got here: before
        2026-11-27 it was enqueued after the forward's launch, and an eager forward's ``load_ms``
        read its whole launch phase). A background load's is enqueued at the first layer wait
        or gate open that finds its copies enqueued (``TransferWorker.enqueued``): earlier, the
        side stream's wait would make this thread wait for that enqueue. Once per load; no-op on
        a CPU."""
        if self.cuda and load.end is None and self._wait_on(load, self._probe, PROBE):
            import torch

            load.end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            load.end.record(self._probe)

    def finish_load(self, load: Load) -> bool:
        """True once every block of ``load`` is in place; False means recompute them (the load
        failed, or did not finish within ``load_timeout``: then its blocks may still be written
        until ``settled(req_id)``)."""
        self.time_load(load)
        if self.worker.wait([load.job_id], self.load_timeout):
            self.worker.cancel(self.offloader.abort(load.req_id))
        self.poll()
        return self._load_ok.pop(load.job_id, False) and not load.failed

    def load(self, req_id: str, keys: Sequence[BlockKey], blocks: Sequence[int]) -> bool:
        """``start_load`` and ``finish_load`` in one call: the blocking form."""
        return self.finish_load(self.start_load(req_id, keys, blocks))

    def store(self, req_id: str, keys: Sequence[BlockKey], blocks: Sequence[int]) -> bool:
        """Copy blocks to host from the next ``poll`` on (keys held already are skipped); False:
        nothing to copy."""
        job = self.offloader.schedule_store(req_id, keys, blocks)
        if job is not None:
            self._queued.append(job)
        return job is not None

    def settled(self, req_id: str) -> bool:
        self.poll()
        return self.offloader.is_settled(req_id)

    def is_settled(self, req_id: str) -> bool:
        """As of the last ``poll``."""
        return self.offloader.is_settled(req_id)

    def wait_settled(self, req_id: str) -> None:
        if self._queued:
            self.poll()  # a queued job must run before it can settle
        self.worker.wait(self.offloader.in_flight(req_id))
        self.poll()

    def layer_gate(self) -> Any:
        """The worker's ``LayerGate`` (one flag word per layer), timed: a CUDA graph captures
        ``gate.wait(stream, layer)`` before each layer's attention; ``open_layers`` opens it once
        per step. One per tier (the native engine holds at most 8)."""
        if self._gate is None:
            self._gate = timed(self.worker.layer_gate(self.layers), self.calls, "gate")
        return self._gate

    def open_layers(self, stream: Any, loads: Sequence[Load]) -> None:
        """Before a step's graph replay on ``stream``: layer L opens once every load's layer L
        has landed (at once without loads)."""
        self.layer_gate().open(stream, [load.job_id for load in loads])
        for load in loads:  # the open waited for their enqueue
            if load.end is None:
                self.time_load(load)

    def close(self) -> None:
        self.local.close()

    def _wait_on(self, load: Load, stream: Any, label: str) -> bool:
        """``TransferWorker.wait_on`` for the load's last layer (landed with the rest of it);
        False if the copy failed."""
        wait, last = self.local.worker.wait_on, self.layers - 1
        return self._guard(load, None, f"{label}worker.wait_on", wait, load.job_id, stream, last)

    def _guard(self, load: Load, layer: int | None, name: str, wait: Any, *args: Any) -> bool:
        """A wait for ``load`` (timed as ``name``); False, and ``load.failed``, if the copy
        failed."""
        if load.failed:
            return False
        try:
            self.calls.call(name, wait, *args)
        except Exception:  # the copy's own error, whatever its type: a miss, recomputed
            log.warning("load of %s failed (layer %s); recomputing", load.req_id, layer)
            log.debug("the load's error", exc_info=True)
            load.failed = True
        return not load.failed

    def poll(self, background: bool = False) -> list[kvo.JobResult]:
        """Hand the queued jobs over and apply the jobs finished since the last poll (stats;
        loads' results for finish_load): one ``TransferWorker.step`` call (``background``: its
        copies enqueued by kvoffload's thread, for a caller about to wait on the device)."""
        queued, self._queued = self._queued, []
        results = self.worker.step(queued, background=background)
        jobs = {j.job_id: j for j in self.offloader.complete(results)}
        s = self.stats
        for r in results:
            n, load = len(jobs[r.job_id].keys), jobs[r.job_id].direction == "load"
            if load:
                self._load_ok[r.job_id] = r.ok
            if not r.ok:
                s.failures += n
            elif load:
                s.loads += n
                s.load_bytes += r.nbytes
                s.load_seconds += r.seconds
            else:
                s.stores += n
                s.store_bytes += r.nbytes
                s.store_seconds += r.seconds
        return results
