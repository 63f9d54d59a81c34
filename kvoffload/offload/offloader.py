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

This is the boundary: every call validates all of its input before it changes anything, and a
refused call (ValueError, "expected X, got Y") leaves the index, the pins and the request's
bookkeeping as they were. Inside (the index, the ledger, the worker's backend) the checked input
is an invariant and is not checked again. One check is the index's own: it finds only non-empty
``bytes`` keys, so a list of keys goes to it as given and is scanned in Python (and its int block
hashes made keys) only where the index refuses or misses a key; the refusals are the same.
Every call takes this object's lock, so several threads may share one Offloader. After ``close``
the calls that act raise ValueError ("expected an open Offloader, got a closed one");
``is_settled``, ``in_flight`` and the statistics still answer.

A job runs at most once and only real results count: the Offloader's ``JobLedger``
(``kvoffload.offload.ledger``), shared with the ``TransferWorker`` built with it, admits each job
it handed out once and accepts in ``complete`` only results that worker reported.

With lower tiers attached (``attach_tiers``; ``build_local`` does it when the config names a disk
path or a Valkey URL), stored blocks are also written down behind the engine's back, and
``lookup_tiers`` (a richer ``lookup``) brings blocks a tier holds up into host slots: they are
reported ``pending`` until their bytes are verified, then ``ready``, and load like any host hit.
``kvoffload.offload.lower`` has the design; none of it blocks or raises on a tier failure.
"""

from __future__ import annotations

import functools
import itertools
import math
import secrets
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvoffload.config import OffloadConfig
from kvoffload.offload.inputs import engine_block_ids, not_held
from kvoffload.offload.jobs import JobResult, TransferJob
from kvoffload.offload.ledger import JobLedger
from kvoffload.offload.load_rule import LoadRule
from kvoffload.offload.lower import LowerTiers, TierLookup
from kvoffload.offload.tiers import TierMover
from kvoffload.store.index import BlockIndex
from kvoffload.store.keys import BlockKey, KeyArray, checked_keys, key_list, key_rows
from kvoffload.transfer.spec import Direction, TransferSpec

_REFUSED = {
    "unknown": "unknown id(s) {}",
    "unsubmitted": "id(s) {} never submitted to its worker",
    "unreported": "result(s) for id(s) {} that its worker did not report (made up, or completed "
    "already)",
}

# ``lookup``'s check of a list of keys, run by the index only when one is missed
_check_lookup = functools.partial(checked_keys, where="lookup")


class Offloader:
    """The scheduler half of the engine-neutral API: host-held blocks, jobs, settled requests.

    Built by ``build_local`` (with its ``TransferWorker`` and host arena) or by hand for a worker
    built with it: ``TransferWorker(backend, Offloader(config, layout.slot_bytes,
    [g.num_blocks for g in layout.groups], layout.block_size))``. ``lookup`` says how much of a
    prefix is held, ``schedule_load``/``schedule_store`` pin or reserve host slots and return a
    ``TransferJob`` for the worker, ``complete`` applies the worker's results, ``is_settled`` says
    when a request's engine blocks may be reused. Thread-safe; the module docstring has the
    contract and ``docs/api.md`` the loop.

    >>> off = Offloader(OffloadConfig(host_capacity_blocks=8), slot_bytes=4096, engine_blocks=[64])
    >>> off.lookup([b"k0", b"k1"])
    0
    """

    def __init__(
        self,
        config: OffloadConfig,
        slot_bytes: int,
        engine_blocks: Sequence[int] | None = None,
        block_size: int | None = None,
    ) -> None:
        """``engine_blocks``: the engine's blocks per layer group (``build_local`` passes the
        layout's), so that block ids are range-checked at ``schedule_*``; a worker can only be
        built with an Offloader that has them. None checks only ``>= 0`` (a scheduler without a
        worker, in tests). ``block_size``: tokens per block, for the prefill-tokens-saved count."""
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
        self.index = BlockIndex(
            config.num_slots(slot_bytes), slot_bytes, config.eviction_policy, config.eviction_window
        )
        self.lower: LowerTiers | None = None
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._ledger = JobLedger(self._lock)  # the worker built with this Offloader shares it
        self._timed_out = 0  # loads reported timed out, ever
        self._closed = False

    @property
    def num_slots(self) -> int:
        return self.index.num_slots

    @property
    def closed(self) -> bool:
        return self._closed

    def lookup(self, keys: Sequence[BlockKey] | KeyArray) -> int:
        """How many leading ``keys`` are held on host, ready to load."""
        with self._lock:
            if self._closed:
                self._check_open("lookup")
            if isinstance(keys, list):  # scanned only if a key is missed (``BlockIndex.lookup``)
                return self.index.lookup(keys, _check_lookup)
            if isinstance(keys, np.ndarray):  # read in place: the index keeps nothing of them
                return self.index.lookup(key_rows(keys, "lookup", copy=False))
            return self.index.lookup(checked_keys(keys, "lookup"))

    def schedule_load(
        self,
        req_id: str,
        keys: Sequence[BlockKey] | KeyArray,
        blocks: Sequence[int] | np.ndarray,
        group: int = 0,
    ) -> TransferJob:
        """Pin held ``keys`` and describe their copy into engine ``blocks`` (same order, distinct).

        Raises ValueError, changing nothing, unless every key is held (READABLE) and ``blocks``
        is a 1-D sequence of distinct engine block ids of layer ``group``, one per key.
        """
        with self._lock:
            if self._closed:
                self._check_open("schedule_load")
            keys, blocks_arr = self._checked(req_id, keys, blocks, group, "load")
            keys, slots = self._prepare_load(keys)
            return self._job(req_id, "load", keys, TransferSpec("load", blocks_arr, slots, group))

    def schedule_store(
        self,
        req_id: str,
        keys: Sequence[BlockKey] | KeyArray,
        blocks: Sequence[int] | np.ndarray,
        group: int = 0,
    ) -> TransferJob | None:
        """Reserve slots for the ``keys`` not held yet; None when there is nothing to store.

        ``blocks`` are the engine blocks holding those keys' KV (a block may repeat; keys may
        not); the engine must have finished writing them (on a GPU, the backend orders the copy
        after the compute stream). Raises ValueError, changing nothing, on bad input.
        """
        with self._lock:
            if self._closed:
                self._check_open("schedule_store")
            keys, blocks_arr = self._checked(req_id, keys, blocks, group, "store")
            want = self.lower is not None  # the lower tiers take the evicted keys
            try:
                plan_keys, slots, positions, evicted, _, _ = self.index.reserve(keys, want)
            except ValueError:
                scanned = self._scanned(keys, "schedule_store")
                if scanned is None:
                    raise
                plan_keys, slots, positions, evicted, _, _ = self.index.reserve(scanned, want)
            if self.lower is not None:
                self.lower.evicted(evicted)
            if not len(slots):
                return None
            chosen = blocks_arr
            if positions is not None:  # some keys were held already
                chosen = blocks_arr[positions]
                chosen.setflags(write=False)
            spec = TransferSpec("store", chosen, slots, group)
            return self._job(req_id, "store", plan_keys, spec)

    def touch(self, keys: Iterable[BlockKey] | KeyArray) -> None:
        """Mark held ``keys`` as just used (e.g. blocks the engine's GPU cache keeps hitting, so
        the host copy of a hot system prompt is not the first evicted). Unknown keys are ignored."""
        with self._lock:
            self._check_open("touch")
            self.index.touch(checked_keys(keys, "touch", ordered=False))

    def complete(self, results: Iterable[JobResult]) -> list[TransferJob]:
        """Apply the worker's results: stores become readable (or roll back), loads unpin.

        Returns the job of each result applied. Only a result the worker reported (from
        ``get_finished``) for a job this Offloader submitted counts, once: an unknown or
        completed id, a job never submitted, a result the worker did not hand out (a forged
        ``ok=True``, a ``final=False`` for a store) is refused. A refused one does not stop the
        others: every real one is applied first, so no request is stranded, and then ValueError
        names the refused ids. A ``final=False`` result (a load past its deadline) counts the
        timeout and keeps the job in flight, its host slots pinned, until its final result.
        """
        with self._lock:
            if self._closed:
                self._check_open("complete")
            done: list[TransferJob] = []
            refused: dict[str, list[object]] = {}  # why -> ids, filled on the first refusal
            # a late load's timeout first, when its end comes in the same call
            items: list[object] = results if type(results) is list else list(results)
            if len(items) > 1:  # sorted as a copy: the caller's list stays as given
                items = sorted(items, key=lambda r: not isinstance(r, JobResult) or r.final)
            accept = self._ledger.accept
            for result in items:
                if not isinstance(result, JobResult):
                    refused = refused or {why: [] for why in _REFUSED}
                    refused["unknown"].append(result)
                    continue
                job, why, late = accept(result)  # a final one settles its job, else it is late
                if job is None:
                    refused = refused or {why: [] for why in _REFUSED}
                    refused[why].append(result.job_id)
                    continue
                if result.final:  # a late load was reported failed: the engine recomputed
                    self._apply(job, result.ok and not late)
                else:
                    self._timed_out += 1
                done.append(job)
            if self.lower is not None:
                self.lower.poll()
            if refused:
                got = "; ".join(_REFUSED[w].format(ids) for w, ids in refused.items() if ids)
                raise ValueError(
                    "complete: expected results its worker reported for job ids this Offloader "
                    f"submitted, got {got} (the {len(done)} known result(s) were applied)"
                )
            return done

    def abort(self, req_id: str) -> list[int]:
        """Returns ``req_id``'s jobs in flight, for ``TransferWorker.cancel`` (which cancels those
        not started, also those never submitted: ``worker.cancel(off.abort(req))`` lets ``req``
        settle once its running copies end)."""
        with self._lock:
            self._check_open("abort")
            if not isinstance(req_id, str):
                raise ValueError(f"abort: expected a str req_id, got {req_id!r}")
            return sorted(self._ledger.jobs(req_id))

    def is_settled(self, req_id: str) -> bool:
        """True when no job of ``req_id`` is in flight: its engine blocks may be reused."""
        with self._lock:
            return self._ledger.is_settled(req_id)

    def close(self) -> None:
        """Settle every job still in flight, then refuse further calls (ValueError). Idempotent.

        A job whose final result its worker reported and nobody completed gets that result; any
        other job fails: a store leaves nothing readable, a load unpins its slots. Every request
        is then settled and nothing is pinned. Close the worker first (``LocalOffload.close``
        does): a copy still running after this may write into slots given up here.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for job, reported in self._ledger.close():
                late = self._ledger.is_late(job.job_id)
                ok = not late and any(r.final and r.ok for r in reported)
                self._apply(self._ledger.settle(job.job_id), ok)

    # -- lower tiers (disk, Valkey) ------------------------------------------------------------

    def attach_tiers(self, mover: TierMover) -> None:
        """Write stored blocks down to ``mover``'s tiers and promote their hits (see above)."""
        with self._lock:
            slots_cap = max(1, self.num_slots // 2)
            backlog_bytes = self.config.tier_write_backlog_bytes
            backlog = max(1, min(backlog_bytes // self.slot_bytes, slots_cap))
            rule = LoadRule(self.slot_bytes, self.block_size, self.config.prefill_tokens_per_s)
            self.lower = LowerTiers(self.index, mover, backlog, rule)

    def report_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` of prefill in ``seconds``: the rate ``lookup_tiers``
        weighs a lower-tier load against (``kvoffload.offload.load_rule``). ValueError, changing
        nothing, unless ``tokens`` is an int >= 0 and ``seconds`` a finite number >= 0."""
        if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 0:
            raise ValueError(f"report_prefill: expected tokens as an int >= 0, got {tokens!r}")
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float, np.floating, np.integer))
            or not math.isfinite(seconds)
            or seconds < 0
        ):
            raise ValueError(
                f"report_prefill: expected seconds as a finite number >= 0, got {seconds!r}"
            )
        with self._lock:
            self._check_open("report_prefill")
            if self.lower is not None:
                self.lower.rule.prefill(int(tokens), float(seconds))

    def lookup_tiers(self, keys: Sequence[BlockKey] | KeyArray) -> TierLookup:
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
            return self.lower.lookup(key_list(keys))

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
            return self._ledger.jobs(req_id)

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
                "jobs_in_flight": len(self._ledger),
                "loads_timed_out": self._timed_out,
                "loads_late": self._ledger.num_late(),
                "prefill_tokens_saved": saved,
                "tiers": {} if self.lower is None else self.lower.snapshot(),
            }

    # -- internals (the lock is held) ----------------------------------------------------------

    def _check_open(self, where: str) -> None:
        if self._closed:
            raise ValueError(f"{where}: expected an open Offloader, got a closed one")

    def _checked(
        self,
        req_id: str,
        keys: Sequence[BlockKey] | KeyArray,
        blocks: Sequence[int] | np.ndarray,
        group: int,
        direction: Direction,
    ) -> tuple[list[BlockKey] | KeyArray, np.ndarray]:
        """``schedule_*``'s checks of its input, in its order: the keys, then the engine blocks.

        A list of keys is left to the index to check (``_scanned``): it finds only non-empty
        ``bytes``, so a call whose keys it accepts needs no scan of them in Python."""
        if not isinstance(keys, list):
            checked = checked_keys(keys, f"schedule_{direction}")
            return checked, engine_block_ids(
                req_id, len(checked), blocks, group, direction, self.engine_blocks
            )
        try:
            return keys, engine_block_ids(
                req_id, len(keys), blocks, group, direction, self.engine_blocks
            )
        except ValueError:
            checked_keys(keys, f"schedule_{direction}")  # a bad key is refused before bad blocks
            raise

    def _scanned(
        self, keys: list[BlockKey] | KeyArray, where: str
    ) -> list[BlockKey] | KeyArray | None:
        """Keys the index refused, as ``checked_keys`` makes them (ValueError in the API's words
        for a bad one; int block hashes become keys); None where that changes nothing: the index
        refused the keys themselves."""
        if not isinstance(keys, list):
            return None
        checked = checked_keys(keys, where)
        return None if checked is keys else checked

    def _prepare_load(
        self, keys: list[BlockKey] | KeyArray
    ) -> tuple[list[BlockKey] | KeyArray, np.ndarray]:
        """The keys (scanned if the index refused them as given) and their pinned slots."""
        try:
            return keys, self.index.prepare_load(keys)
        except ValueError as err:
            refusal = err
        scanned = self._scanned(keys, "schedule_load")
        if scanned is not None:
            try:
                return scanned, self.index.prepare_load(scanned)
            except ValueError as err:
                keys, refusal = scanned, err
        raise not_held(self.index, keys, "schedule_load", refusal)

    def _job(
        self,
        req_id: str,
        direction: Direction,
        keys: Sequence[BlockKey] | KeyArray,
        spec: TransferSpec,
    ) -> TransferJob:
        # a job is data that cannot change once checked: its id arrays are read-only already
        # (``engine_block_ids``, the index's slots), keys given as an array are made so here
        held: tuple[BlockKey, ...] | np.ndarray
        if type(keys) is list:
            held = tuple(keys)
        elif isinstance(keys, np.ndarray):
            if keys.flags.writeable:  # rows chosen from the keys
                keys.setflags(write=False)
            held = keys
        else:
            held = tuple(keys)
        nbytes = len(held) * self.slot_bytes
        job = TransferJob(next(self._ids), req_id, direction, held, (spec,), nbytes, self.token)
        self._ledger.add(job)
        return job

    def _apply(self, job: TransferJob, ok: bool) -> None:
        """Release what a settled job held: a store's keys become readable or roll back, a
        load's slots unpin. A closed Offloader writes nothing more to the lower tiers."""
        slots = job.specs[0].slots  # the job's one spec: its keys' slots, in order
        if job.direction == "store":
            self.index.complete_store(job.keys, ok, slots)
            if ok and self.lower is not None and not self._closed:
                self.lower.stored(key_list(job.keys))
        else:
            self.index.complete_load(job.keys, ok, slots)
