"""Fault injection for a bounded time: host + disk + Valkey traffic through the engine-neutral
API while bytes flip in slab files and in Valkey values, the server is killed (SIGKILL) or
frozen (SIGSTOP) and comes back empty, and the engine restarts on the same disk and server.

Every block's bytes are a function of its key (the oracle), so every load is checked whole.
Asserted: 0 wrong bytes, 0 exceptions reaching the caller, the host index's invariants after
every request, no pin or backlog left once the tiers drain, and that every kind of fault and
every tier actually took part. ``KVOFFLOAD_FAULT_S`` sets the duration (20 s by default; CI
runs 90 s); ``KVOFFLOAD_FAULT_REPORT`` names a JSON file for the counts (docs/tiers.md quotes
them).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kvoffload import prefix_block_keys
from kvoffload.offload.local import LocalOffload
from tests.tiers_support import BS, build, engine_kv, redis_client, running_server, tier_of

DURATION_S = float(os.environ.get("KVOFFLOAD_FAULT_S", "20"))
ENGINE_BLOCKS = 32
HOST_BLOCKS = 12  # small: prefixes keep leaving host and coming back from disk or Valkey
CONVERSATIONS, LENGTH = 24, 8  # prefixes of up to 8 blocks
GARBAGE = 0x5A
KILL_EVERY_S = (2.0, 6.0)  # the server is killed or frozen every 2-6 s (uniform)...
DOWN_S = (0.3, 1.5)  # ...and stays dead that long (then restarts, empty)
RESTART_EVERY_S = (4.0, 10.0)  # the engine restarts every 4-10 s


class Harness:
    def __init__(self, root: Path, url: str) -> None:
        self.root, self.url = root, url
        self.kv = engine_kv(0, ENGINE_BLOCKS)
        self.chains = [
            prefix_block_keys(np.arange(LENGTH * BS), BS, salt=b"conversation-%d" % c)
            for c in range(CONVERSATIONS)
        ]
        self.counts: Counter[str] = Counter()
        self.problems: list[str] = []
        self.tier_totals: Counter[str] = Counter()
        self.local = self.build()

    def build(self) -> LocalOffload:
        return build(
            self.kv,
            host_blocks=HOST_BLOCKS,
            disk_path=str(self.root / "disk"),
            disk_capacity_bytes=48 * (self.slot_bytes() + 4096),
            valkey_url=self.url,
            valkey_timeout_s=0.3,
        )

    def slot_bytes(self) -> int:
        return sum(t[:, 0].nbytes for t in self.kv)

    def content(self, key: bytes) -> list[np.ndarray]:
        """The oracle: a key's block, per layer, from a seed made of the key."""
        rng = np.random.default_rng(xxhash.xxh3_64_intdigest(key))
        return [rng.integers(-(2**15), 2**15, t[:, 0].shape, dtype=np.int16) for t in self.kv]

    # -- one engine request --------------------------------------------------------------------

    def request(self, rng: random.Random) -> None:
        off = self.local.offloader
        keys = self.chains[rng.randrange(CONVERSATIONS)][: rng.randint(1, LENGTH)]
        req = f"r{self.counts['requests']}"
        self.counts["requests"] += 1
        found = off.lookup_tiers(keys)
        deadline = time.monotonic() + 0.3
        while (found.pending or found.probing) and time.monotonic() < deadline:
            time.sleep(0.005)
            found = off.lookup_tiers(keys)
        dst = rng.sample(range(ENGINE_BLOCKS), len(keys))
        ready = found.ready
        if ready:
            for t in self.kv:
                t[:, dst[:ready]] = GARBAGE
            if self.run(off.schedule_load(req, keys[:ready], dst[:ready])):
                self.check(keys[:ready], dst[:ready])
        for key, block in zip(keys[ready:], dst[ready:], strict=True):  # "recompute" the rest
            for t, want in zip(self.kv, self.content(key), strict=True):
                t[:, block] = want
        job = off.schedule_store(req, keys[ready:], dst[ready:]) if ready < len(keys) else None
        if job is not None:
            self.run(job)
            self.counts["blocks_stored"] += len(job.keys)
        off.index.check_invariants()

    def run(self, job: Any) -> bool:
        worker = self.local.worker
        worker.submit(job)
        if worker.wait([job.job_id], timeout=30) != set():
            self.problems.append(f"job {job.job_id} did not finish in 30 s")
            return False
        results = worker.get_finished()
        self.local.offloader.complete(results)
        return all(r.ok for r in results)

    def check(self, keys: list[bytes], blocks: list[int]) -> None:
        for key, block in zip(keys, blocks, strict=True):
            got = [t[:, block] for t in self.kv]
            if not all(np.array_equal(g, w) for g, w in zip(got, self.content(key), strict=True)):
                self.problems.append(f"wrong bytes loaded for a block of {key.hex()}")
            self.counts["blocks_loaded_and_checked"] += 1

    # -- faults --------------------------------------------------------------------------------

    def flip_slab_byte(self, rng: random.Random) -> None:
        slabs = sorted((self.root / "disk").rglob("slab-*.kvs"))
        if not slabs:
            return
        path = rng.choice(slabs)
        size = path.stat().st_size
        if size == 0:
            return
        with open(path, "r+b") as f:
            f.seek(rng.randrange(size))
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
        self.counts["slab_bytes_flipped"] += 1

    def flip_value_byte(self, rng: random.Random, client: Any) -> None:
        name = client.randomkey()
        length = client.strlen(name) if name else 0
        if not length:
            return
        at = rng.randrange(length)
        byte = client.getrange(name, at, at)
        client.setrange(name, at, bytes([byte[0] ^ (1 << rng.randrange(8))]))
        self.counts["value_bytes_flipped"] += 1

    def restart_engine(self) -> None:
        self.close_engine()
        self.local = self.build()
        self.counts["engine_restarts"] += 1

    def close_engine(self) -> None:
        off = self.local.offloader
        off.drain_tiers(30)
        lower = off.lower
        assert lower is not None
        if lower.backlog:
            self.problems.append(f"{lower.backlog} block(s) still queued after a drain")
        pinned = [k for chain in self.chains for k in chain if off.index.readers(k)]
        if pinned:
            self.problems.append(f"{len(pinned)} block(s) still pinned after a drain")
        for name, snapshot in off.tier_stats()["tiers"].items():
            self.tier_totals.update({f"{name}.{k}": v for k, v in snapshot.items()})
        self.tier_totals.update({f"flow.{k}": v for k, v in off.tier_stats()["flow"].items()})
        self.local.close()


def fault_kinds(rng: random.Random) -> Iterator[str]:
    """The server's faults in order: a kill, then a freeze, then kills 70% of the time.

    Its own generator, so that how many requests ran between two faults (which varies with the
    machine) never changes which fault comes next, and a short run still sees both kinds.
    """
    yield "kill"
    yield "freeze"
    while True:
        yield "kill" if rng.random() < 0.7 else "freeze"


def test_faults_never_give_wrong_bytes_or_exceptions(tmp_path):
    rng = random.Random(1234)
    faults = fault_kinds(random.Random(4321))
    with running_server() as server:
        h = Harness(tmp_path, server.url)
        tier = tier_of(h.local, "valkey")
        assert tier.up
        down_until = 0.0
        paused_until = 0.0
        start = time.monotonic()
        next_kill, next_restart = start + 1.5, start + 3.0
        end = start + DURATION_S
        while time.monotonic() < end:
            now = time.monotonic()
            try:
                h.request(rng)
            except BaseException as e:  # noqa: BLE001 (counted: none may reach the caller)
                h.problems.append(f"{type(e).__name__}: {e}")
            if down_until and now > down_until:
                server.start()  # same port, empty: every block it held is gone
                down_until = 0.0
            if paused_until and now > paused_until:
                server.resume()
                paused_until = 0.0
            server_ok = not down_until and not paused_until
            if server_ok and now > next_kill:
                if next(faults) == "kill":
                    server.kill()
                    down_until = now + rng.uniform(*DOWN_S)
                    h.counts["server_kills"] += 1
                else:
                    server.pause()
                    paused_until = now + rng.uniform(0.5, 1.0)
                    h.counts["server_freezes"] += 1
                next_kill = now + rng.uniform(*KILL_EVERY_S)
            if now > next_restart:
                h.restart_engine()
                next_restart = now + rng.uniform(*RESTART_EVERY_S)
            if rng.random() < 0.08:
                h.flip_slab_byte(rng)
            if not down_until and not paused_until and rng.random() < 0.08:
                client = redis_client(server)
                h.flip_value_byte(rng, client)
                client.close()
        if paused_until:
            server.resume()
        if down_until:
            server.start()
        h.close_engine()
    report: dict[str, Any] = {"duration_s": DURATION_S, **h.counts, "problems": len(h.problems)}
    report["tier_counters"] = {k: v for k, v in sorted(h.tier_totals.items()) if v}
    print(json.dumps(report, indent=1))
    if os.environ.get("KVOFFLOAD_FAULT_REPORT"):
        Path(os.environ["KVOFFLOAD_FAULT_REPORT"]).write_text(json.dumps(report, indent=1))
    assert h.problems == []
    for fault in (
        "server_kills",
        "server_freezes",
        "engine_restarts",
        "slab_bytes_flipped",
        "value_bytes_flipped",
    ):
        assert h.counts[fault] >= 1, f"no {fault} in {DURATION_S} s"
    totals = h.tier_totals
    assert totals["disk.gets"] > 0 and totals["valkey.gets"] > 0 and totals["flow.promoted"] > 0
    assert h.counts["blocks_loaded_and_checked"] > 100
