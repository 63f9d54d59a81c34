"""Our disk and Valkey tiers as vLLM ``SecondaryTierManager`` classes (``secondary_tiers``).

vLLM's tiering manager (``vllm/v1/kv_offload/tiering/``) keeps a host (CPU) primary tier and
cascades every chunk stored there to each secondary tier, then promotes chunks back into host slots
on a lookup that misses the host. These classes are such tiers, built on kvoffload's own tiers
(``DiskTier``, ``ValkeyTier``) and ``TierMover``; they work under vLLM's ``TieringOffloadingSpec``
and under ``KVOffloadSpec`` alike::

    {"type": "KVOffloadDiskTier", "module_path": "kvoffload.integrations.vllm",
     "disk_path": "/mnt/nvme/kv", "disk_capacity_bytes": 549755813888}

What they keep that vLLM's tiers do not promise:

- A lookup never waits: the disk tier answers from its in-memory map; Valkey from what this process
  last learnt, else one pipelined ``EXISTS`` per step for every unknown key, on a mover thread,
  with ``RETRY`` meanwhile (vLLM defers the request a step). A Valkey server that is down, frozen or
  slow is a miss once its timeout has passed, and every later lookup is a miss at once until a
  background ping finds it back.
- A value is a whole host chunk (every TP/PP rank's shard, in rank order) in kvoffload's block
  format: magic, checksums of header and payload, the layout fingerprint and the key. A read that
  fails any check, comes back short, or times out leaves its host slot unreadable (vLLM's primary
  rolls the promotion back and the engine recomputes those tokens): never wrong KV, never an error
  raised into vLLM. The fingerprint (``row_fingerprint``) covers the model identity, KV dtype,
  parallel layout, chunk geometry, the spec's row layout and the vLLM version, so values of other
  models, ranks, layouts or versions are never read.
- Reads and writes run on the tier's own threads (``tier_threads``), in batches of 16 chunks.
- Values are shared across TP sizes where the host row's bytes do not depend on the parallel
  layout: vLLM's single-copy layout of a replicated (MLA) KV cache, and its certified
  parallelism-free canonical layout; elsewhere the layout is in the fingerprint.
- With ``enable_kv_events`` (an entry's key, as for vLLM's ``fs`` tier; always on for our flat
  keys) and vLLM's KV events on, what the tier stores and drops is reported as vLLM's events
  (``tier_events.py``).
- ``touch`` makes chunks the tier's most recently used (Valkey: the server's LRU clock). No
  per-request state is kept (lookups are per key), so ``on_request_finished`` has nothing to do.
- A ``disk_path`` that cannot be created or written stops the engine at start-up (``ValueError``).
"""

from __future__ import annotations

import itertools
import logging
import tempfile
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.integrations.vllm.options import DISK_TIER, VALKEY_TIER, parse_tier_options
from kvoffload.integrations.vllm.region import RowArena
from kvoffload.integrations.vllm.row_identity import model_identity, row_fingerprint, spec_fact
from kvoffload.integrations.vllm.tier_events import Residency
from kvoffload.offload.latency import TIER_READ_BUCKETS
from kvoffload.offload.tiers import TierMover, TierOp, TierResult, build_tiers
from kvoffload.store.tiers.disk import DiskTier
from kvoffload.store.tiers.endpoint import redact_url
from kvoffload.store.tiers.private import make_private_dirs
from kvoffload.store.tiers.valkey import ValkeyTier

log = logging.getLogger(__name__)

OP_CHUNKS = 16  # chunks per mover op: one pipeline round trip / a run of disk I/O
PROBE_CHUNKS = 512  # keys per EXISTS pipeline
# TierStats fields reported as counters (vllm:kvoffload_<tier>_<field>); bytes and job counts are
# in vLLM's own vllm:kv_offload_tiering_* metrics.
COUNTERS = {
    "puts": "chunks written",
    "put_failures": "chunk writes that failed (I/O error, full disk, server down or slow)",
    "put_skipped": "chunk writes not attempted (already held, too large, tier down)",
    "gets": "chunks read and verified",
    "misses": "reads of a chunk the tier did not have (evicted, expired)",
    "corrupt": "reads whose checksum, fingerprint or key did not match (deleted, a miss)",
    "errors": "reads that failed on I/O, a timeout or a connection error (a miss)",
    "evictions": "chunks dropped to stay under capacity",
    "reconnects": "times the server came back after being down",
}
EVICTION_SLACK = 16  # extra oldest keys checked per detected disk eviction (order is approximate)
EVENTS_KEY = "enable_kv_events"


def check_disk_path(path: str) -> None:
    """ValueError unless ``path`` is (or can be made) a directory this process can write in."""
    try:
        make_private_dirs(Path(path))  # 0700: the tier's blocks hold the users' prompts
    except OSError as e:
        raise ValueError(
            f"expected disk_path to be a directory kvoffload can create, got {path!r}: "
            f"cannot create it ({e.strerror or e})"
        ) from e
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(
            f"expected disk_path to be a directory kvoffload can write files in, got {path!r}: "
            f"not writable ({e.strerror or e})"
        ) from e


@dataclass
class _Job:
    job_id: int
    keys: list[OffloadKey]
    ops_left: int
    failed: set[OffloadKey] = field(default_factory=set)
    seconds: float = 0.0


class _KVOffloadTier(SecondaryTierManager):
    """One kvoffload lower tier behind vLLM's secondary-tier contract (see the module docstring)."""

    kind: ClassVar[str]  # DISK_TIER or VALKEY_TIER
    short: ClassVar[str]  # disk or valkey, in metric names
    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        """``options``: the entry's keys (``parse_tier_options``, plus ``enable_kv_events``);
        ValueError names a bad one, or a ``disk_path`` that cannot be created or written."""
        events = options.pop(EVENTS_KEY, False)
        if not isinstance(events, bool):
            raise ValueError(f"expected {EVENTS_KEY} to be true or false, got {events!r}")
        opts = parse_tier_options(self.kind, options, model_identity(offloading_spec))
        if opts.config.disk_path is not None:
            check_disk_path(opts.config.disk_path)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(opts.locality)
        self.options = opts
        arena = RowArena(primary_kv_view)
        self.fingerprint = row_fingerprint(offloading_spec, arena.slot_bytes, opts.config.model_id)
        (self.tier,) = build_tiers(opts.config, self.fingerprint, arena.slot_bytes)
        self.mover = TierMover(arena, [self.tier], opts.config.tier_threads)
        self.residency = self._residency(offloading_spec, events)
        self._evictions = self.tier.stats.evictions  # disk evictions already looked at
        self._ids = itertools.count()
        self._op_job: dict[int, int | None] = {}  # mover op id -> job id (None: a probe)
        self._op_keys: dict[int, tuple[OffloadKey, ...]] = {}
        self._op_kind: dict[int, str] = {}
        self._jobs: dict[int, _Job] = {}
        self._finished: list[JobResult] = []  # jobs done without an op
        self._probe_wanted: dict[OffloadKey, None] = {}  # ordered set, sent at the step's end
        self._probing: set[OffloadKey] = set()
        self._reported = dict.fromkeys(COUNTERS, 0)
        self._counters_sent = False  # the first get_stats sends every counter, zeros included
        self._read_seconds: list[float] = []  # read ops finished since the last get_stats

    # -- lookups (never block) ----------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        known = self.tier.contains([key])[0]
        if known is None:
            if key not in self._probing:
                self._probe_wanted[key] = None
            return LookupResult.RETRY
        return LookupResult.HIT if known else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        keys = list(self._probe_wanted)
        self._probe_wanted.clear()
        self._probing.update(keys)
        for start in range(0, len(keys), PROBE_CHUNKS):
            self._submit("probe", keys[start : start + PROBE_CHUNKS], (), None)

    # -- jobs (submitted at once, copied on the mover's threads) ------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        held = self.tier.contains(keys)
        todo = [
            (k, int(c))
            for k, c, h in zip(keys, job_metadata.chunk_ids, held, strict=True)
            if h is not True
        ]
        if self.residency is not None and len(todo) < len(keys):
            self.residency.stored(k for k, h in zip(keys, held, strict=True) if h is True)
        self._start(job_metadata.job_id, keys, "write", todo)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunks = [int(c) for c in job_metadata.chunk_ids]
        self._start(job_metadata.job_id, keys, "read", list(zip(keys, chunks, strict=True)))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done, self._finished = self._finished, []
        for result in self.mover.get_finished():
            job_id = self._op_job.pop(result.op_id)
            keys = self._op_keys.pop(result.op_id)
            kind = self._op_kind.pop(result.op_id)
            if self.residency is not None:
                self._observe(self.residency, kind, keys, result)
            if kind == "read":
                self._read_seconds.append(result.seconds)
            if job_id is None:
                self._probing.difference_update(keys)
                continue
            job = self._jobs[job_id]
            job.failed.update(k for k, ok in zip(keys, result.ok, strict=True) if not ok)
            job.seconds = max(job.seconds, result.seconds)
            job.ops_left -= 1
            if job.ops_left == 0:
                done.append(self._result(self._jobs.pop(job_id)))
        return done

    def drain_jobs(self) -> None:
        self.mover.wait_idle()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """``keys`` become the tier's most recently used: on disk at once; on Valkey by one
        pipelined ``STRLEN`` sent from the mover's thread (it resets the server's LRU clock of
        each value, for ``allkeys-lru``; the TTL is refreshed only by reads and writes)."""
        keys = list(keys)
        if isinstance(self.tier, DiskTier):
            _touch_disk(self.tier, keys)
            if self.residency is not None:
                self.residency.seen(keys)
            return
        for start in range(0, len(keys), PROBE_CHUNKS):
            self._submit("probe", keys[start : start + PROBE_CHUNKS], (), None)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.residency is None:
            return ()
        if isinstance(self.tier, DiskTier):
            self._find_evicted(self.residency)
        return self.residency.take()

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._finished or self._probe_wanted or self._probing)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def shutdown(self) -> None:
        self.mover.close()
        self.mover.arena.close()

    # -- metrics ------------------------------------------------------------------------------

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        defs: dict[str, OffloadingMetricMetadata] = {
            f"vllm:kvoffload_{cls.short}_{name}": OffloadingCounterMetadata(
                f"kvoffload {cls.short} tier: {doc}."
            )
            for name, doc in COUNTERS.items()
        }
        defs[f"vllm:kvoffload_{cls.short}_read_seconds"] = OffloadingHistogramMetadata(
            f"kvoffload {cls.short} tier: submit-to-completion seconds of each read op (up to "
            f"{OP_CHUNKS} chunks).",
            buckets=TIER_READ_BUCKETS,
        )
        if cls.kind == VALKEY_TIER:
            defs["vllm:kvoffload_valkey_up"] = OffloadingGaugeMetadata(
                "1 while the kvoffload Valkey tier reaches its server, 0 while it is down."
            )
        return defs

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        now = self.tier.stats.snapshot()
        for name in COUNTERS:
            delta = now[name] - self._reported[name]
            if delta or not self._counters_sent:  # a series at 0 from the start (Prometheus)
                stats.increase_counter(f"vllm:kvoffload_{self.short}_{name}", delta)
                self._reported[name] = now[name]
        self._counters_sent = True
        for seconds in self._read_seconds:
            stats.observe_histogram(f"vllm:kvoffload_{self.short}_read_seconds", seconds)
        self._read_seconds.clear()
        if isinstance(self.tier, ValkeyTier):
            stats.set_gauge("vllm:kvoffload_valkey_up", float(self.tier.up))
        return stats

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("kvoffload_model_id", "kvoffload_fingerprint", "kvoffload_location")

    def config_info(self) -> dict[str, str | int | float | bool]:
        config = self.options.config
        location = config.disk_path or redact_url(config.valkey_url or "")
        return {
            "kvoffload_model_id": config.model_id,
            "kvoffload_fingerprint": self.fingerprint,
            "kvoffload_location": location,
        }

    # -- helpers ------------------------------------------------------------------------------

    def _start(
        self,
        job_id: int,
        keys: list[OffloadKey],
        kind: str,
        todo: list[tuple[OffloadKey, int]],
    ) -> None:
        job = _Job(job_id, keys, ops_left=0)
        for start in range(0, len(todo), OP_CHUNKS):
            part = todo[start : start + OP_CHUNKS]
            self._submit(kind, [k for k, _ in part], tuple(c for _, c in part), job_id)
            job.ops_left += 1
        if job.ops_left:
            self._jobs[job_id] = job
        else:  # nothing to copy (every chunk already held)
            self._finished.append(self._result(job))

    def _submit(
        self, kind: Any, keys: list[OffloadKey], chunks: tuple[int, ...], job_id: int | None
    ) -> None:
        op = TierOp(next(self._ids), kind, self.tier.name, tuple(keys), chunks)
        self._op_job[op.op_id] = job_id
        self._op_keys[op.op_id] = op.keys
        self._op_kind[op.op_id] = kind
        self.mover.submit(op)

    # -- events -------------------------------------------------------------------------------

    def _residency(self, spec: OffloadingSpec, enabled: bool) -> Residency | None:
        """What to announce, when this entry asked for events and vLLM publishes them."""
        config = getattr(spec, "kv_events_config", None)
        if not enabled or spec_fact(config, "enable_kv_cache_events", bool) is not True:
            if enabled:
                log.warning(
                    "%s: %s is set but vLLM's KV cache events are off; no events are emitted",
                    self.tier_type,
                    EVENTS_KEY,
                )
            return None
        ttl = self.options.config.valkey_ttl_s if isinstance(self.tier, ValkeyTier) else 0
        return Residency(self.medium, self.locality, self.tier_type, expire_s=ttl or None)

    def _observe(
        self, residency: Residency, kind: str, keys: tuple[OffloadKey, ...], result: TierResult
    ) -> None:
        """A finished op's keys: written or read is held; a key that failed and that the tier now
        says it does not hold (while it is up: a Valkey that is down knows nothing) is gone."""
        ok = [k for k, good in zip(keys, result.ok, strict=True) if good]
        if kind != "probe":
            residency.stored(ok)
        failed = [k for k, good in zip(keys, result.ok, strict=True) if not good]
        if failed and getattr(self.tier, "up", True):
            held = self.tier.contains(failed)
            residency.removed(k for k, h in zip(failed, held, strict=True) if h is False)

    def _find_evicted(self, residency: Residency) -> None:
        """The disk tier evicts its least recently used chunk to make room: per eviction since the
        last look, check the oldest announced chunks (their order follows the tier's)."""
        evictions = self.tier.stats.evictions
        count, self._evictions = evictions - self._evictions, evictions
        if count > 0:
            oldest = residency.oldest(count + EVICTION_SLACK)
            held = self.tier.contains(oldest)
            residency.removed(k for k, h in zip(oldest, held, strict=True) if h is False)

    def _result(self, job: _Job) -> JobResult:
        ok = [k for k in job.keys if k not in job.failed]
        return JobResult(
            job_id=job.job_id,
            success=not job.failed,
            successful_keys=tuple(ok) if job.failed and ok else None,
            transfer_time=job.seconds,
            transfer_bytes=len(ok) * self.block_size_bytes,
        )


class KVOffloadDiskTier(_KVOffloadTier):
    """kvoffload's slab-file disk tier (``disk_path``, ``disk_capacity_bytes``; ``docs/vllm.md``).

    One process per directory: a second engine on the same ``disk_path`` finds it locked and runs
    without it (share between engines through Valkey). Blocks survive a restart."""

    kind = DISK_TIER
    short = "disk"
    cache_hit_source = CacheHitSource.DISK


class KVOffloadValkeyTier(_KVOffloadTier):
    """kvoffload's shared Valkey/Redis tier (``valkey_url``, ``valkey_ttl_s``, ...), for several
    engines at once (``docs/vllm.md``)."""

    kind = VALKEY_TIER
    short = "valkey"
    cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED


def _touch_disk(tier: DiskTier, keys: list[OffloadKey]) -> None:
    """Move ``keys`` to the recent end of the disk tier's LRU order, as a read does.

    DiskTier (``kvoffload/store``) has no public touch yet: its order is the ``_where`` map under
    ``_lock``, which ``_get_one`` refreshes the same way; ``tests/vllm/test_tier_events.py``
    fails if that changes. To move into ``DiskTier.touch``."""
    with tier._lock:
        where = tier._where
        for key in keys:
            if key in where:
                where.move_to_end(key)
