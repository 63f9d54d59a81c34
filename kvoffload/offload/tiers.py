"""The worker side of the lower tiers: copy host slots to and from tiers on background threads.

The scheduler side (``kvoffload.offload.lower``) decides and pins; this side only moves bytes.
An op is plain data (``TierOp`` in, ``TierResult`` out, like ``TransferJob``/``JobResult``) so a
mover in another process could serve the same scheduler. Each tier has its own thread pool
(``threads`` threads): a slow or dead Valkey never holds up the disk, and numpy, file I/O and
socket I/O release the GIL while they copy.

``submit`` never blocks (the scheduler bounds how much is queued: every queued write pins a host
slot); ``get_finished`` never blocks. A tier that raises (a bug: tiers report failures as False)
is logged with its traceback and the op comes back all-False: a miss, never an exception in the
engine's thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from kvoffload.config import OffloadConfig
from kvoffload.offload.latency import TIER_READ_BUCKETS, Histogram
from kvoffload.store.arena import HostArena
from kvoffload.store.keys import BlockKey
from kvoffload.store.tiers.base import RateLimitedLog, Tier
from kvoffload.store.tiers.disk import DiskTier
from kvoffload.store.tiers.valkey import ValkeyTier
from kvoffload.transfer.layout import KVLayout

log = logging.getLogger(__name__)

OpKind = Literal["write", "read", "probe"]


@dataclass(frozen=True, eq=False)
class TierOp:
    op_id: int
    kind: OpKind  # write: host slot -> tier; read: tier -> host slot; probe: does the tier hold it
    tier: str
    keys: tuple[BlockKey, ...]
    slots: tuple[int, ...] = ()  # host slot per key (write, read)
    ask_first: bool = False  # write: probe the keys first and write only those the tier lacks


@dataclass(frozen=True)
class TierResult:
    op_id: int
    ok: tuple[bool, ...]  # per key: written / read and verified / held
    seconds: float  # submit to completion


class TierMover:
    def __init__(self, arena: HostArena, tiers: Sequence[Tier], threads: int = 2) -> None:
        if threads <= 0:
            raise ValueError(f"expected tier_threads > 0, got {threads}")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"expected tiers with distinct names, got {names}")
        for tier in tiers:
            if tier.block_bytes != arena.slot_bytes:
                raise ValueError(
                    f"expected tier {tier.name!r} to hold blocks of the host slot size "
                    f"({arena.slot_bytes} bytes), got {tier.block_bytes}"
                )
        self.arena = arena
        self.tiers: dict[str, Tier] = {t.name: t for t in tiers}
        self._pools = {
            t.name: ThreadPoolExecutor(threads, thread_name_prefix=f"kvoffload-{t.name}")
            for t in tiers
        }
        # per tier: submit-to-completion seconds of each read op (an op: up to 16 blocks)
        self.read_seconds = {t.name: Histogram(TIER_READ_BUCKETS) for t in tiers}
        # per "<tier>.<kind>": ops, blocks and seconds inside the tier's call (threads' busy time)
        self._busy: dict[str, dict[str, float]] = {}
        self._finished: deque[TierResult] = deque()
        self._count_lock = threading.Lock()
        self._in_flight = 0
        self._idle = threading.Condition(self._count_lock)
        self._failures = RateLimitedLog(log)

    def submit(self, op: TierOp) -> None:
        if op.tier not in self.tiers:
            raise ValueError(f"expected a tier in {list(self.tiers)}, got {op.tier!r}")
        if op.kind != "probe" and len(op.slots) != len(op.keys):
            raise ValueError(
                f"expected one host slot per key ({len(op.keys)}), got {len(op.slots)}"
            )
        with self._count_lock:
            self._in_flight += 1
        self._pools[op.tier].submit(self._run, op, time.perf_counter())

    def get_finished(self) -> list[TierResult]:
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def busy(self) -> dict[str, dict[str, float]]:
        """Per ``"<tier>.<kind>"``: ``ops``, ``blocks`` and ``s`` (seconds inside the tier's
        calls, summed over the threads): where the tiers' threads spent their time."""
        with self._count_lock:
            return {name: dict(totals) for name, totals in self._busy.items()}

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no op is running (their results wait in ``get_finished``)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)

    def close(self, timeout: float = 30.0) -> None:
        if not self.wait_idle(timeout):
            log.warning("closing the tier mover with %d op(s) still running", self._in_flight)
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        for tier in self.tiers.values():
            tier.close()

    def _run(self, op: TierOp, submitted: float) -> None:
        tier = self.tiers[op.tier]
        started = time.perf_counter()
        try:
            if op.kind == "probe":
                ok = tier.probe(op.keys)
            else:
                views = [memoryview(self.arena.slots[s]) for s in op.slots]
                if op.kind == "read":
                    ok = tier.get(op.keys, views)
                elif op.ask_first:
                    ok = _put_missing(tier, op.keys, views)
                else:
                    ok = tier.put(op.keys, views)
        except Exception as e:  # noqa: BLE001 (the thread boundary: a tier bug is a logged miss)
            self._failures.error(
                f"{op.tier}.{op.kind}.{type(e).__name__}",
                "tier %r failed on a %s of %d block(s): %s",
                op.tier,
                op.kind,
                len(op.keys),
                e,
            )
            ok = [False] * len(op.keys)
        done = time.perf_counter()
        seconds = done - submitted
        if op.kind == "read":
            self.read_seconds[op.tier].observe(seconds)
        self._finished.append(TierResult(op.op_id, tuple(ok), seconds))
        with self._idle:
            busy = self._busy.setdefault(f"{op.tier}.{op.kind}", {"ops": 0, "blocks": 0, "s": 0.0})
            busy["ops"] += 1
            busy["blocks"] += len(op.keys)
            busy["s"] += done - started
            self._in_flight -= 1
            self._idle.notify_all()


def _put_missing(tier: Tier, keys: Sequence[BlockKey], views: list[memoryview]) -> list[bool]:
    """``tier.put`` of the keys a probe does not find (True for those it holds already)."""
    held = tier.probe(keys)
    todo = [i for i, h in enumerate(held) if not h]
    written = tier.put([keys[i] for i in todo], [views[i] for i in todo]) if todo else []
    ok = list(held)
    for i, w in zip(todo, written, strict=True):
        ok[i] = w
    return ok


def build_tiers(config: OffloadConfig, fingerprint: str, block_bytes: int) -> list[Tier]:
    """The lower tiers ``config`` names, disk first, then Valkey, for blocks of ``block_bytes``
    under ``fingerprint`` (also used by the vLLM adapter, whose host rows have no ``KVLayout``).

    Raises ``TierStartupError`` when a server refuses the credentials or the TLS handshake.
    """
    tiers: list[Tier] = []
    if config.disk_path is not None:
        tiers.append(
            DiskTier(config.disk_path, fingerprint, block_bytes, config.disk_capacity_bytes)
        )
    if config.valkey_url is not None:
        try:
            tiers.append(
                ValkeyTier(
                    config.valkey_url,
                    fingerprint,
                    block_bytes,
                    ttl_s=config.valkey_ttl_s,
                    max_value_bytes=config.valkey_max_value_bytes,
                    timeout_s=config.valkey_timeout_s,
                    pool_size=config.valkey_pool_size,
                    namespace=config.valkey_namespace,
                    password_env=config.valkey_password_env,
                    password_file=config.valkey_password_file,
                    tls_ca_file=config.valkey_tls_ca_file,
                    tls_cert_file=config.valkey_tls_cert_file,
                    tls_key_file=config.valkey_tls_key_file,
                )
            )
        except BaseException:
            for tier in tiers:
                tier.close()  # the disk tier's directory lock
            raise
    return tiers


def build_mover(layout: KVLayout, config: OffloadConfig, arena: HostArena) -> TierMover | None:
    """The lower tiers ``config`` names (disk first, then Valkey), or None when it names none."""
    tiers = build_tiers(config, layout.fingerprint(config.model_id), arena.slot_bytes)
    return TierMover(arena, tiers, config.tier_threads) if tiers else None
