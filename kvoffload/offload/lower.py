"""The scheduler side of the lower tiers: what to write down, what to bring up, and when.

Runs on the scheduler's thread next to the ``BlockIndex`` it shares with the ``Offloader``; the
bytes move on the ``TierMover``'s threads. Nothing here blocks and nothing here raises on a tier
failure: a failed write leaves the block on host only, a failed read rolls its slot back.

Going down, write-behind (not demote-on-evict):
    When an engine store completes, its blocks are queued, oldest first, for every lower tier that
    does not hold them yet. Up to ``backlog_blocks`` block writes run at once; each pins its host
    slot (``BlockIndex.pin``) until the tier has the bytes, so the slot can be neither evicted nor
    reused while it is being copied out. Eviction then never waits: it takes unpinned blocks,
    whose bytes are already below (or, when the tiers fell behind, never will be: counted
    ``lost``, a later miss).
    Why not demote-on-evict (write the victim when the host evicts it, holding the slot until the
    write finishes)? Then every store into a full host waits for a disk write per evicted block,
    and the request cannot free its GPU blocks until its store settles. ``kvoffload bench tiers``
    ran both side by side (``benchmarks/results/tiers_cpu_2026-11-22.json``; 2-core VM, ext4 on
    a virtio disk, stores back to back through a host tier a quarter of the stream): a 16-block
    store of 2 MiB blocks settled in 33 ms (p50) with write-behind against 129 ms with
    demote-on-evict (p99 115 vs 344 ms); with 64 KiB blocks 0.6 vs 3.8 ms. The price: when stores
    outrun the disk, blocks evicted before their turn never reach it (back to back, 128 of 256
    2 MiB blocks reached disk against 192 with demote-on-evict); with stores paced at 200 MB/s
    (under the disk's sustained write rate, as an engine's prefill would produce them) 224 of 256
    2 MiB and all 8,192 64 KiB blocks did. We keep the engine's path fast and let the disk take
    what it can; ``lost`` in ``tier_stats`` shows when it could not.

Coming up, promotion:
    ``lookup`` counts the leading keys READABLE on host (``ready``), then walks on: a key being
    written (an engine store or a promotion in flight) is *pending*; a key a tier holds gets a host
    slot through ``prepare_store`` (WRITING, so it is pending too, never readable early) and a read
    op; a key whose shared-tier presence is unknown starts one pipelined probe (``probing``) and
    ends the walk; a key nobody holds ends it. The ready keys are pinned while slots are taken, so
    making room never evicts what was just reported ready. When a read finishes, each block whose
    checksum matched becomes READABLE (``complete_store``) and the engine's next lookup reports it
    ready: the normal load path follows. A block that failed (missing, corrupt, timeout) is rolled
    back: the engine recomputes it, exactly as for a host miss. So a tier failure can only turn a
    pending block into a miss, never into wrong KV.

Whether a hit is worth loading (``load_rule.py``):
    Every block costs the same bytes and saves the same tokens, so the rule is one comparison per
    tier: its measured read rate against the engine's prefill rate. Before walking the keys, the
    lookup leaves out every tier whose rate cannot beat recomputing (``LoadRule.too_slow``): it
    is not asked about any key (no ``contains``, no probe, no read), so a request that recomputes
    pays no tier I/O, on its thread or behind it; the keys from where the walk stopped to the end
    of those it looks at are counted ``declined_without_lookup`` (not walked: their host states
    are read only for a re-measurement's sample). At a bounded pace (``REMEASURE_S``, doubling up to
    ``REMEASURE_MAX_S`` while the tier stays too slow) one such lookup starts a re-measurement in
    the background instead: up to ``SAMPLE_BLOCKS`` of the keys it left out are probed on a mover
    thread and those the tier holds are read up (``remeasured``), so a tier that got faster is
    taken again. Those reads are never reported pending (``_declined``) until READABLE. Tiers
    with no figures yet are asked and loaded (``loads_unmeasured``): that is how a tier gets
    measured; ``loads_taken`` counts blocks loaded because they beat recomputing.
    Blocks a request recomputed are written down as any other; to a tier that was not asked
    whether it holds them, the write first asks, on the mover's thread (``TierOp.ask_first``),
    and writes only the blocks it lacks.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvoffload.offload.load_rule import LoadRule
from kvoffload.offload.tiers import OpKind, TierMover, TierOp, TierResult
from kvoffload.store.index import FREE, READABLE, WRITING, BlockIndex
from kvoffload.store.keys import BlockKey
from kvoffload.store.tiers.base import Tier
from kvoffload.store.tiers.disk import DiskTier
from kvoffload.store.tiers.valkey import ValkeyTier

OP_BLOCKS = 16  # blocks per tier op: one pipeline / a run of disk I/O, then a result
LOOKAHEAD = 512  # most keys past the host prefix one lookup walks (at most half the host slots)
SAMPLE_BLOCKS = 2 * OP_BLOCKS  # blocks read up to re-measure a tier too slow to be asked
# A tier too slow to be asked is re-measured at most this often: first REMEASURE_S after it was
# found too slow, the interval doubling up to REMEASURE_MAX_S while it stays so. Each costs up to
# SAMPLE_BLOCKS block reads on the mover's threads, under whatever the engine runs then (on an
# H100, 32 reads of 2 MiB from a loopback Valkey took ~55 ms of two threads); back to
# REMEASURE_S once the tier is taken again.
REMEASURE_S = 5.0
REMEASURE_MAX_S = 80.0


@dataclass(frozen=True)
class TierLookup:
    """What ``Offloader.lookup_tiers`` found for a prefix of keys."""

    ready: int  # leading keys READABLE on host now: schedule_load(keys[:ready]) may follow
    pending: int  # keys right after those that are on their way to host; look up again later
    probing: bool  # a shared tier is being asked about the key after those; look up again

    @property
    def hit(self) -> int:
        """Keys that will be ready once pending blocks land (some may still turn into misses)."""
        return self.ready + self.pending


@dataclass
class FlowStats:
    writes: int = 0  # block writes started (one per block per tier)
    written: int = 0  # block writes that succeeded (or, asked first, found the block held)
    write_failures: int = 0  # block writes that failed (the block stays on host only)
    lost: int = 0  # blocks that left host before any write to a tier that lacked them
    promotions: int = 0  # blocks whose read up from a tier started
    promoted: int = 0  # blocks read up, verified and READABLE on host
    promote_failures: int = 0  # blocks whose read failed: rolled back, a miss
    probes: int = 0  # keys asked about with a probe
    loads_taken: int = 0  # blocks promoted for a request: expected faster than recomputing
    loads_unmeasured: int = 0  # blocks promoted for a request before the rule had its figures
    # keys a lookup did not ask a tier about, its read rate being unable to beat the prefill
    # rate: those from where its walk stopped to the end of the keys it looks at (LOOKAHEAD),
    # which the request recomputes with no tier I/O (one count per key per tier left out)
    declined_without_lookup: int = 0
    remeasured: int = 0  # blocks read up in the background to re-measure such a tier


class LowerTiers:
    def __init__(
        self,
        index: BlockIndex,
        mover: TierMover,
        backlog_blocks: int,
        rule: LoadRule | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if backlog_blocks <= 0:
            raise ValueError(f"expected backlog_blocks > 0, got {backlog_blocks}")
        self.index = index
        self.mover = mover
        self.backlog_blocks = backlog_blocks
        self.rule = rule if rule is not None else LoadRule(index.slot_bytes, None)
        self.names = list(mover.tiers)
        self.stats = FlowStats()
        self._ids = itertools.count()
        self._ops: dict[int, TierOp] = {}
        self._dirty: OrderedDict[BlockKey, tuple[str, ...]] = OrderedDict()
        self._pinned = 0  # block writes in flight (each pins its slot once)
        self._probing: set[BlockKey] = set()
        self._declined: set[BlockKey] = set()  # being read up, but not for the asking request
        self.clock = clock  # paces re-measurements
        self._remeasure: dict[str, tuple[float, float]] = {}  # too slow: (next at, interval)
        self._measuring: dict[int, str] = {}  # re-measurement probe op -> its tier
        self._op_reads: dict[int, int] = {}  # read op -> its promotion (for the rule's timing)
        self._reads: dict[int, list[Any]] = {}  # promotion -> [tier, ops left, ok blocks, s]

    # -- engine events ------------------------------------------------------------------------

    def stored(self, keys: Sequence[BlockKey]) -> None:
        """``keys`` became READABLE from engine stores: queue them for every tier."""
        for key in keys:
            self._dirty[key] = tuple(self.names)
        self._pump()

    def evicted(self, keys: Sequence[BlockKey]) -> None:
        """The host gave these blocks up; those not yet written anywhere are lost below."""
        for key in keys:
            if self._dirty.pop(key, None) is not None:
                self.stats.lost += 1

    def poll(self) -> None:
        """Apply finished tier ops to the index, then start queued writes."""
        for result in self.mover.get_finished():
            self._apply(result)
        self._pump()

    # -- lookup and promotion -----------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> TierLookup:
        self.poll()
        index = self.index
        ready = index.lookup(keys)
        rest = keys[ready : ready + min(LOOKAHEAD, max(1, index.num_slots // 2))]
        asked = self._askable()
        chain: list[BlockKey] = []  # keys after the ready prefix that are (or will be) on host
        held: list[BlockKey] = list(keys[:ready])  # READABLE: protected while slots are taken
        promote: dict[BlockKey, str] = {}
        unknown: list[BlockKey] = []
        for i, key in enumerate(rest):
            state = index.state(key)
            if state == READABLE:
                held.append(key)
            elif state == WRITING and key in self._declined:
                break  # coming up in the background; this request recomputes it
            elif state != WRITING:
                source, maybe = self._source(key, asked)
                if source is None:
                    if maybe:
                        unknown = [k for k in rest[i:] if index.state(k) == FREE]
                    elif len(asked) < len(self.names):
                        self._decline(rest[i:], asked)  # not walked: recomputed from here
                    break
                promote[key] = source
            chain.append(key)
        worth = self.rule.worth(Counter(promote.values())) if promote else None
        granted = self._promote(promote, held) if promote else set()
        # Every tier asked can beat recomputing, so the rule's verdict is True or None here.
        if worth:
            self.stats.loads_taken += len(granted)
        else:
            self.stats.loads_unmeasured += len(granted)
        pending = 0
        for key in chain:
            if key in promote and key not in granted:
                break
            pending += 1
        probing = bool(unknown) and pending == len(chain)
        if probing:
            self._probe(unknown)
        return TierLookup(ready, pending, probing)

    def _askable(self) -> list[str]:
        """The tiers a lookup asks: those whose measured rate can beat recomputing, or unmeasured.
        A tier found too slow is given its re-measurement time; one that got fast again loses it."""
        now = self.clock()
        asked = []
        for name in self.names:
            if self.rule.too_slow(name):
                self._remeasure.setdefault(name, (now + REMEASURE_S, REMEASURE_S))
            else:
                self._remeasure.pop(name, None)
                asked.append(name)
        return asked

    def _decline(self, keys: Sequence[BlockKey], asked: list[str]) -> None:
        """``keys`` (where the walk stopped, and on) are recomputed without asking the tiers left
        out of ``asked``; one of those whose re-measurement is due probes a sample of them in the
        background. Their host states are read only then: a declined lookup costs the same
        whatever the number of keys."""
        now = self.clock()
        for name in self.names:
            if name in asked:
                continue
            self.stats.declined_without_lookup += len(keys)
            at, interval = self._remeasure[name]
            if now < at:
                continue
            free = (k for k in keys if self.index.state(k) == FREE)
            sample = [k for k in itertools.islice(free, SAMPLE_BLOCKS) if k not in self._probing]
            if not sample:
                continue
            interval = min(2 * interval, REMEASURE_MAX_S)
            self._remeasure[name] = (now + interval, interval)
            self._probing.update(sample)
            self.stats.probes += len(sample)
            self._measuring[self._submit("probe", name, sample, [])] = name

    def _remeasured(self, name: str, keys: list[BlockKey]) -> None:
        """A re-measurement's probe found ``keys`` in tier ``name``: read up those still absent
        from host, in the background (never reported pending), timing the tier again."""
        keys = [k for k in keys if self.index.state(k) == FREE]
        if keys:
            granted = self._promote(dict.fromkeys(keys, name), [])
            self._declined.update(granted)
            self.stats.remeasured += len(granted)

    def _source(self, key: BlockKey, asked: list[str]) -> tuple[str | None, bool]:
        """The first tier of ``asked`` holding ``key``; else None and whether one does not know."""
        maybe = False
        for name in asked:
            known = self.mover.tiers[name].contains([key])[0]
            if known:
                return name, False
            maybe = maybe or known is None
        return None, maybe

    def _promote(self, promote: dict[BlockKey, str], held: list[BlockKey]) -> set[BlockKey]:
        index = self.index
        index.pin(held)
        try:
            plan = index.prepare_store(list(promote))
        finally:
            index.unpin(held)
        self.evicted(plan.evicted)
        by_tier: dict[str, list[tuple[BlockKey, int]]] = {}
        for key, slot in zip(plan.keys, plan.slots.tolist(), strict=True):
            by_tier.setdefault(promote[key], []).append((key, slot))
        for name, items in by_tier.items():
            promotion = next(self._ids)
            self._reads[promotion] = [name, 0, 0, 0.0]
            for start in range(0, len(items), OP_BLOCKS):
                chunk = items[start : start + OP_BLOCKS]
                op = self._submit("read", name, [k for k, _ in chunk], [s for _, s in chunk])
                self._op_reads[op] = promotion
                self._reads[promotion][1] += 1
        self.stats.promotions += len(plan.keys)
        return set(plan.keys)

    def _probe(self, keys: list[BlockKey]) -> None:
        keys = [k for k in keys if k not in self._probing]
        if not keys:
            return
        for name in self.names:
            tier = self.mover.tiers[name]
            asked = [k for k, known in zip(keys, tier.contains(keys), strict=True) if known is None]
            if asked:
                self._probing.update(asked)
                self.stats.probes += len(asked)
                self._submit("probe", name, asked, [])

    # -- writes -------------------------------------------------------------------------------

    def _pump(self, limit: int | None = None) -> None:
        """Start writes for the oldest queued blocks while the backlog has room."""
        limit = self.backlog_blocks if limit is None else limit
        index = self.index
        batches: dict[str, list[BlockKey]] = {}
        while self._dirty and self._pinned < limit:
            key, targets = self._dirty.popitem(last=False)
            if index.state(key) != READABLE:  # dropped by the engine (remove / reset)
                self.stats.lost += 1
                continue
            for name in targets:
                if self.mover.tiers[name].contains([key])[0]:
                    continue  # already there (written before, or this block came from it)
                batch = batches.setdefault(name, [])
                batch.append(key)
                self._pinned += 1
                if len(batch) == OP_BLOCKS:
                    self._write(name, batches.pop(name))
        for name, batch in batches.items():
            self._write(name, batch)

    def _write(self, name: str, keys: list[BlockKey]) -> None:
        slots = self.index.pin(keys)  # raises unless every key is READABLE: each has a slot
        # A tier left out of lookups was never asked about these: it may hold them already.
        self._submit("write", name, keys, slots.tolist(), ask_first=name in self._remeasure)
        self.stats.writes += len(keys)

    def _submit(
        self,
        kind: OpKind,
        tier: str,
        keys: list[BlockKey],
        slots: list[int],
        ask_first: bool = False,
    ) -> int:
        op = TierOp(next(self._ids), kind, tier, tuple(keys), tuple(slots), ask_first)
        self._ops[op.op_id] = op
        self.mover.submit(op)
        return op.op_id

    def _timed_read(self, op_id: int, ok: int, seconds: float) -> None:
        """A promotion's ops were all submitted at once: its time is its slowest op's."""
        promotion = self._op_reads.pop(op_id, None)
        if promotion is None:
            return
        timing = self._reads[promotion]
        timing[1] -= 1
        timing[2] += ok
        timing[3] = max(timing[3], seconds)
        if timing[1] == 0:
            del self._reads[promotion]
            self.rule.read(timing[0], timing[2], timing[3])

    def _apply(self, result: TierResult) -> None:
        op = self._ops.pop(result.op_id)
        ok = [k for k, good in zip(op.keys, result.ok, strict=True) if good]
        bad = [k for k, good in zip(op.keys, result.ok, strict=True) if not good]
        if op.kind == "write":
            self.index.unpin(op.keys)
            self._pinned -= len(op.keys)
            self.stats.written += len(ok)
            self.stats.write_failures += len(bad)
        elif op.kind == "read":
            if ok:
                self.index.complete_store(ok, success=True)
            if bad:
                self.index.complete_store(bad, success=False)
            self.stats.promoted += len(ok)
            self.stats.promote_failures += len(bad)
            self._declined.difference_update(op.keys)
            self._timed_read(op.op_id, len(ok), result.seconds)
            above = tuple(self.names[: self.names.index(op.tier)])
            for key in ok if above else ():  # a shared-tier hit is kept on local disk too
                self._dirty[key] = above
        else:
            self._probing.difference_update(op.keys)
            name = self._measuring.pop(result.op_id, None)
            if name is not None:
                self._remeasured(name, ok)

    # -- shutdown and numbers -----------------------------------------------------------------

    def drain(self, timeout: float) -> bool:
        """Write every queued block and wait for all ops; True if done within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            for result in self.mover.get_finished():
                self._apply(result)
            self._pump(limit=1 << 62)
            if not self._ops and not self._dirty:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.mover.wait_idle(min(left, 0.05))

    @property
    def backlog(self) -> int:
        """Blocks queued or being written to a tier."""
        return len(self._dirty) + self._pinned

    def snapshot(self) -> dict[str, Any]:
        tiers = {name: t.stats.snapshot() for name, t in self.mover.tiers.items()}
        reads = {name: h.snapshot() for name, h in self.mover.read_seconds.items()}
        up = {name: _usable(t) for name, t in self.mover.tiers.items()}
        return {
            "flow": asdict(self.stats),
            "tiers": tiers,
            "read_seconds": reads,
            "busy": self.mover.busy(),
            "up": up,
            "rule": self.rule.snapshot(),
        }


def _usable(tier: Tier) -> bool:
    """Valkey: its server answers; disk: its directory can be written (else it only reads)."""
    if isinstance(tier, ValkeyTier):
        return tier.up
    if isinstance(tier, DiskTier):
        return tier.writable
    return True
