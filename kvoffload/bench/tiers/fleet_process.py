"""One engine-like process of ``kvoffload bench tiers --fleet``: the engine-neutral API
(``build_local``, the ``host`` copy backend, the Valkey tier) serving chat-like requests whose
prefixes other processes stored, every loaded byte checked.

Engine: 2 layers of ``[2, blocks, 16 tokens, 1, width]`` int16 KV in numpy (one host slot is
``block_bytes``). Every block's bytes are known from its key alone (the oracle: one of a few
random rows, with the key stamped at the start of each of its K and V pages), so a block loaded
from anywhere can be checked byte for byte, and a block swapped for another shows.

Prefill: process ``i`` of ``n`` stores shared prefixes ``i, i + n, ...`` and waits until each is
written down to the shared tier. Then all processes start together (a barrier the parent joins)
and, until ``seconds`` have passed, serve requests: a random shared prefix of ``prefix_blocks``
blocks plus ``fresh_blocks`` new blocks of this request (a new turn). Per request: ``lookup_tiers``
once per scheduler step (``STEP_S``) until nothing is pending or probing (at most
``LOOKUP_BOUND_S``), load the ``ready`` blocks into the engine and compare them with the oracle,
then "recompute" the rest (write the oracle) and store them (write-behind to the shared tier).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

BS = 16  # tokens per block
LAYERS = 2
POOL = 8  # distinct random rows behind the oracle's blocks
STAMP = 16  # key bytes stamped at the start of every K and V page
STEP_S = 0.002  # a scheduler step: how often a request looks up again while blocks are pending
LOOKUP_BOUND_S = 5.0  # a request stops waiting for pending blocks after this (counted, a miss)
DONE_WAIT_S = 30.0  # for the others to finish their last request (under the parent's bound)
MODEL = "bench/fleet@1"


@dataclass(frozen=True)
class FleetProcessSpec:
    """What every process of one run is given (picklable: processes are spawned)."""

    url: str
    namespace: str
    block_bytes: int  # one host slot: every layer's K and V page of a block
    prefixes: int  # shared prefixes, stored at prefill
    prefix_blocks: int  # blocks of a shared prefix (what a request may hit)
    fresh_blocks: int  # new blocks per request (always a miss, then stored)
    seconds: float  # the timed window, from the start barrier
    timeout_s: float  # valkey_timeout_s
    ttl_s: int  # valkey_ttl_s: what a crashed run leaves behind expires

    @property
    def host_blocks(self) -> int:
        """Room for promoting a whole prefix (half the slots) and a few requests: small, so
        most hits come up from the shared tier, not from this process's own host copy."""
        return 4 * (self.prefix_blocks + self.fresh_blocks)


class Oracle:
    """The bytes every block must hold, from its key: ``want(key)`` (one slot's bytes)."""

    def __init__(self, block_bytes: int) -> None:
        rng = np.random.default_rng(block_bytes)
        self.pool = rng.integers(0, 256, (POOL, block_bytes), dtype=np.uint8)
        self.pages = 2 * LAYERS

    def want(self, key: bytes) -> np.ndarray:
        out: np.ndarray = self.pool[key[0] % POOL].copy()
        out.reshape(self.pages, -1)[:, :STAMP] = np.frombuffer(key[:STAMP], dtype=np.uint8)
        return out


class Engine:
    """The KV tensors of one engine and the block <-> slot-bytes mapping of ``KVLayout``."""

    def __init__(self, block_bytes: int, num_blocks: int) -> None:
        width = block_bytes // (LAYERS * 2 * BS * 2)  # int16 elements per token per K or V
        self.kv = [np.zeros((2, num_blocks, BS, 1, width), dtype=np.int16) for _ in range(LAYERS)]

    def write(self, block: int, data: np.ndarray) -> None:
        pages = data.view(np.int16).reshape(LAYERS, 2, BS, 1, -1)
        for layer, t in enumerate(self.kv):
            t[:, block] = pages[layer]

    def wrong_bytes(self, block: int, want: np.ndarray) -> int:
        have = np.concatenate(
            [np.ascontiguousarray(t[:, block]).ravel().view(np.uint8) for t in self.kv]
        )
        return int(np.count_nonzero(have != want))

    def clear(self, blocks: int) -> None:
        for t in self.kv:
            t[:, :blocks] = 0


def shared_keys(prefix: int, spec: FleetProcessSpec) -> list[bytes]:
    from kvoffload.store.keys import prefix_block_keys

    tokens = np.arange(spec.prefix_blocks * BS, dtype=np.int64) + prefix * 1_000_000
    return prefix_block_keys(tokens, BS, salt=b"fleet")


def fresh_keys(parent: bytes, proc: int, request: int, spec: FleetProcessSpec) -> list[bytes]:
    from kvoffload.store.keys import prefix_block_keys

    tokens = np.arange(spec.fresh_blocks * BS, dtype=np.int64) + (proc << 40) + (request << 20)
    return prefix_block_keys(tokens, BS, salt=b"fleet", parent=parent)


def serve(spec: FleetProcessSpec, proc: int, procs: int, start: Any, done: Any) -> dict[str, Any]:
    """Prefill, wait at ``start``, serve until the window closes, wait at ``done``, clean up.
    Returns what the parent summarises (timestamps are ``time.monotonic``, shared by all
    processes of the machine)."""
    from kvoffload import KVLayout, OffloadConfig, build_local

    engine = Engine(spec.block_bytes, spec.prefix_blocks + spec.fresh_blocks)
    config = OffloadConfig(
        host_capacity_blocks=spec.host_blocks,
        backend="host",
        model_id=MODEL,
        valkey_url=spec.url,
        valkey_namespace=spec.namespace,
        valkey_timeout_s=spec.timeout_s,
        valkey_ttl_s=spec.ttl_s,
    )
    local = build_local(KVLayout.from_tensors(engine.kv, block_size=BS, block_dim=1), config)
    runner = Requests(local, engine, Oracle(spec.block_bytes), spec, proc)
    try:
        for prefix in range(proc, spec.prefixes, procs):
            runner.prefill(shared_keys(prefix, spec))
        start.wait(300)
        end = time.monotonic() + spec.seconds
        order = np.random.default_rng(proc)
        while time.monotonic() < end:
            runner.request(int(order.integers(spec.prefixes)))
        local.offloader.drain_tiers(5.0)
        stats = local.offloader.tier_stats()
        with contextlib.suppress(threading.BrokenBarrierError):  # a peer died: none to wait for
            done.wait(DONE_WAIT_S)  # nobody deletes shared blocks while another still reads them
        runner.discard_stored()
    finally:
        local.close(tier_drain_s=0.0)
    return {**runner.report(), "tier_stats": stats}


class Requests:
    """One process's requests and what they measured."""

    def __init__(
        self, local: Any, engine: Engine, oracle: Oracle, spec: FleetProcessSpec, proc: int
    ) -> None:
        self.local, self.engine, self.oracle = local, engine, oracle
        self.spec, self.proc = spec, proc
        self.off = local.offloader
        self.count = 0
        self.rows: list[tuple[float, float, int, int, float]] = []  # t0, t1, hit, promoted, load_s
        self.lookups: list[tuple[float, float]] = []  # (when, seconds) of each lookup_tiers call
        self.wrong_bytes = 0
        self.lookups_bounded = 0  # requests that stopped waiting at LOOKUP_BOUND_S
        self.stored: list[bytes] = []

    def prefill(self, keys: list[bytes]) -> None:
        self.store(keys, 0, f"prefill-{self.proc}-{self.count}")
        self.count += 1
        self.off.drain_tiers(30.0)  # down in the shared tier before the next prefix evicts it

    def request(self, prefix: int) -> None:
        shared = shared_keys(prefix, self.spec)
        keys = shared + fresh_keys(shared[-1], self.proc, self.count, self.spec)
        req = f"r{self.proc}-{self.count}"
        self.count += 1
        self.engine.clear(len(keys))  # a loaded block must come from the load
        promoted = self.off.tier_stats()["flow"]["promoted"]
        t0 = time.monotonic()
        found = self.lookup(keys, t0)
        hit, load_s = found.ready, -1.0
        if hit and not self.run(self.off.schedule_load(req, keys[:hit], list(range(hit)))):
            hit = 0  # a failed load is a miss: the engine recomputes those blocks
        if hit:
            load_s = time.monotonic() - t0
            for b in range(hit):
                self.wrong_bytes += self.engine.wrong_bytes(b, self.oracle.want(keys[b]))
        promoted = self.off.tier_stats()["flow"]["promoted"] - promoted
        self.store(keys, hit, req)
        self.rows.append((t0, time.monotonic(), hit, promoted, load_s))

    def lookup(self, keys: list[bytes], t0: float) -> Any:
        while True:
            t = time.perf_counter()
            found = self.off.lookup_tiers(keys)
            self.lookups.append((t0, time.perf_counter() - t))
            if not found.pending and not found.probing:
                return found
            if time.monotonic() - t0 > LOOKUP_BOUND_S:
                self.lookups_bounded += 1
                return found
            time.sleep(STEP_S)

    def store(self, keys: list[bytes], first: int, req: str) -> None:
        """Recompute ``keys[first:]`` (write the oracle) into engine blocks and store them."""
        for b in range(first, len(keys)):
            self.engine.write(b, self.oracle.want(keys[b]))
        job = self.off.schedule_store(req, keys[first:], list(range(first, len(keys))))
        if job is not None and self.run(job):
            self.stored.extend(keys[first:])

    def run(self, job: Any) -> bool:
        """Submit ``job``, wait for it, hand its result over; whether it succeeded."""
        worker = self.local.worker
        worker.submit(job)
        if worker.wait([job.job_id], 30.0):
            raise RuntimeError(f"a {job.direction} job did not finish in 30 s")
        results = worker.get_finished()
        self.off.complete(results)
        return all(r.ok for r in results if r.job_id == job.job_id)

    def discard_stored(self) -> None:
        """Delete what this process wrote (a user's cluster keeps nothing of the run)."""
        tier = self.local.mover.tiers["valkey"]
        for i in range(0, len(self.stored), 256):
            tier.discard(self.stored[i : i + 256])

    def report(self) -> dict[str, Any]:
        return {
            "proc": self.proc,
            "requests": self.rows,
            "lookups": self.lookups,
            "wrong_bytes": self.wrong_bytes,
            "lookups_bounded": self.lookups_bounded,
        }
