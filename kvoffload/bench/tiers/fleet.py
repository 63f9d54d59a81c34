"""``kvoffload bench tiers --fleet N``: a fleet of engine-like processes sharing a Valkey/Redis
Cluster, one primary killed mid-run, against one process on one server.

Three runs, each of processes spawned here (``fleet_process.py``: the engine-neutral API
with the ``host`` copy backend and the Valkey tier, every loaded byte checked against an oracle):

- ``one_process_one_server`` and ``one_process_cluster``: one process, ``baseline_s`` seconds;
- ``fleet``: ``processes`` processes on the cluster for ``seconds`` seconds. On a cluster started
  here (3 primaries + 3 replicas on 127.0.0.1, ``cluster-node-timeout`` ``NODE_TIMEOUT_MS``), one
  primary is killed with SIGKILL at ``KILL_AT`` of the window; no ``CLUSTER FAILOVER`` is sent:
  its replica is promoted by the cluster's own failure detection. A cluster given by URL is
  never touched (no kill; the whole window is ``before``).

Requests are put in phases by the time they started: ``before`` the kill, ``during`` (until the
parent sees the replica promoted: the victim gone from ``CLUSTER NODES``' primaries, three left)
and ``after``. Per phase: requests, hit rate (blocks loaded / shared-prefix blocks asked),
blocks read up from the cluster (``promoted``), GB/s of hits into the engine and of promotions
(bytes over the phase's wall time, all processes together), p50/p99 of each ``lookup_tiers``
call (``lookup``) and of the time from a request's first lookup until its hits were in the
engine (``load``). And: wrong bytes (must be 0), every process alive at the kill and exited 0,
each within ``FINISH_BOUND_S`` of the window's end (a process past it is killed and reported
hung), and how long after the kill each process first had a whole prefix hit from the cluster
again.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import secrets
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvoffload.bench.tiers.common import Fatal, lat
from kvoffload.bench.tiers.fleet_process import FleetProcessSpec, serve

NODE_TIMEOUT_MS = 1000  # cluster-node-timeout of a cluster started here: failover in ~2-3 s
KILL_AT = 0.3  # the primary dies at this fraction of the fleet's window
PREFILL_BOUND_S = 300.0  # every process must have prefilled and reached the start by then
PROMOTION_BOUND_S = 30.0  # the replica must have taken over by then (else: never promoted)
FINISH_BOUND_S = 60.0  # after the window: every process must have reported by then
TIMELINE_BINS = 20  # the fleet's hit rate over time, in this many slices of the window
TTL_S = 600  # what a crashed run leaves on a user's cluster expires after this


@dataclass(frozen=True)
class FleetParams:
    """The fleet's shape (``tiers.py`` checks the user's values)."""

    processes: int = 8
    seconds: float = 20.0
    baseline_s: float = 6.0
    block_bytes: int = 256 << 10
    prefixes: int = 32
    prefix_blocks: int = 8
    fresh_blocks: int = 2
    timeout_s: float = 0.5  # valkey_timeout_s, the library's default

    def spec(self, url: str, seconds: float) -> FleetProcessSpec:
        return FleetProcessSpec(
            url=url,
            namespace="bench-fleet-" + secrets.token_hex(4),
            block_bytes=self.block_bytes,
            prefixes=self.prefixes,
            prefix_blocks=self.prefix_blocks,
            fresh_blocks=self.fresh_blocks,
            seconds=seconds,
            timeout_s=self.timeout_s,
            ttl_s=TTL_S,
        )


def run_fleet(params: FleetParams, urls: dict[str, str], cluster: Any | None) -> dict[str, Any]:
    """The three runs. ``cluster``: the ``LocalCluster`` behind ``urls["cluster"]`` when it was
    started here (one of its primaries is killed), else None."""
    out: dict[str, Any] = {
        "params": {**asdict(params), "host_blocks": params.spec("", 0).host_blocks},
        "node_timeout_ms": NODE_TIMEOUT_MS if cluster is not None else None,
        "kill_at_fraction": KILL_AT if cluster is not None else None,
    }
    out["one_process_one_server"] = one_run(params, urls["one_server"], 1, params.baseline_s)
    out["one_process_cluster"] = one_run(params, urls["cluster"], 1, params.baseline_s)
    out["fleet"] = one_run(params, urls["cluster"], params.processes, params.seconds, cluster)
    base = out["one_process_one_server"]["phases"]["before"]["hit_GBps"]
    fleet = out["fleet"]["phases"]["before"]["hit_GBps"]
    alone = out["one_process_cluster"]["phases"]["before"]["hit_GBps"]
    out["ratios"] = {
        "fleet_before_vs_one_process_one_server": fleet / base if base else None,
        "fleet_before_vs_one_process_cluster": fleet / alone if alone else None,
    }
    return out


def one_run(
    params: FleetParams, url: str, procs: int, seconds: float, cluster: Any | None = None
) -> dict[str, Any]:
    spec = params.spec(url, seconds)
    ctx = mp.get_context("spawn")
    start, done, results = ctx.Barrier(procs + 1), ctx.Barrier(procs), ctx.Queue()
    workers = [
        ctx.Process(target=_main, args=(spec, p, procs, start, done, results), daemon=True)
        for p in range(procs)
    ]
    stopped = False
    try:
        for w in workers:
            w.start()
        try:
            start.wait(PREFILL_BOUND_S)
        except threading.BrokenBarrierError:
            _stop(workers)
            raise Fatal(f"a fleet process failed before the start: {_errors(results)}") from None
        t_start = time.monotonic()
        end = t_start + seconds
        kill_at = t_start + KILL_AT * seconds
        failover = _failover(cluster, kill_at, end, workers) if cluster else None
        got, errors = _collect(results, procs, end + FINISH_BOUND_S)
        hung = _stop(workers)
        stopped = True
    finally:
        if not stopped:  # the parent failed (or was interrupted): no process outlives the run
            for w in workers:
                if w.is_alive():
                    w.kill()
                    w.join(5.0)
    out = summarise(params, got, t_start, end, failover)
    out["processes"] = {
        "count": procs,
        "reported": len(got),
        "errors": errors,
        "hung": hung,
        "exitcodes": [w.exitcode for w in workers],
        # when the last report reached the parent, from the window's end (bound: FINISH_BOUND_S)
        "last_report_after_window_s": max((g["received"] - end for g in got), default=None),
        "alive_at_kill": None if failover is None else failover.pop("alive_at_kill"),
    }
    out["failover"] = None
    if failover is not None:
        out["failover"] = {
            "victim_port": failover["victim_port"],
            "killed_at_s": failover["killed_at"] - t_start,  # into the window
            "promoted_after_s": failover["promoted_after_s"],  # None: not in the window
        }
    return out


def _main(
    spec: FleetProcessSpec, proc: int, procs: int, start: Any, done: Any, results: Any
) -> None:
    try:
        results.put(serve(spec, proc, procs, start, done))
    except BaseException as e:  # reported to the parent, which reports it in the result
        start.abort()
        done.abort()
        results.put({"error": f"process {proc}: {type(e).__name__}: {e}"})
        raise


def _failover(cluster: Any, when: float, end: float, workers: list[Any]) -> dict[str, Any]:
    """Kill a primary at ``when`` (SIGKILL) and watch its replica take over (until ``end``, the
    window's, or ``PROMOTION_BOUND_S``)."""
    time.sleep(max(0.0, when - time.monotonic()))
    victim = cluster.primary_ports()[0]
    alive = sum(w.is_alive() for w in workers)
    killed_at = time.monotonic()
    cluster.node(victim).kill()
    promoted_at = None
    while time.monotonic() < min(end, killed_at + PROMOTION_BOUND_S):
        ports = cluster.primary_ports()
        if victim not in ports and len(ports) == cluster.primaries:
            promoted_at = time.monotonic()
            break
        time.sleep(0.1)
    return {
        "victim_port": victim,
        "killed_at": killed_at,
        "promoted_at": promoted_at,
        "promoted_after_s": None if promoted_at is None else promoted_at - killed_at,
        "alive_at_kill": alive,
    }


def _collect(results: Any, procs: int, deadline: float) -> tuple[list[dict[str, Any]], list[str]]:
    """Every process's report (or error) until ``deadline``; each report gets ``received``."""
    got: list[dict[str, Any]] = []
    errors: list[str] = []
    while len(got) + len(errors) < procs and time.monotonic() < deadline:
        try:
            item = results.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            continue
        item["received"] = time.monotonic()
        if "error" in item:
            errors.append(item["error"])
        else:
            got.append(item)
    return got, errors


def _errors(results: Any) -> list[str]:
    _, errors = _collect(results, 1, time.monotonic() + 1.0)
    return errors


def _stop(workers: list[Any]) -> int:
    """Join every process; one still running 5 s later is killed. Returns how many were."""
    hung = 0
    for w in workers:
        w.join(5.0)
        if w.is_alive():
            hung += 1
            w.kill()
            w.join(5.0)
    return hung


def summarise(
    params: FleetParams,
    got: list[dict[str, Any]],
    t_start: float,
    end: float,
    failover: dict[str, Any] | None,
) -> dict[str, Any]:
    killed = promoted = end
    if failover is not None:
        killed = failover["killed_at"]
        promoted = failover["promoted_at"] or end
    bounds = {"before": (t_start, killed), "during": (killed, promoted), "after": (promoted, end)}
    rows = [r for g in got for r in g["requests"]]
    lookups = [x for g in got for x in g["lookups"]]
    phases = {
        name: _phase(params, rows, lookups, lo, hi)
        for name, (lo, hi) in bounds.items()
        if hi > lo or name == "before"
    }
    tiers = [g["tier_stats"]["tiers"]["valkey"] for g in got]
    flows = got[0]["tier_stats"]["flow"] if got else {}
    out: dict[str, Any] = {
        "window_s": end - t_start,
        "phases": phases,
        "wrong_bytes": sum(g["wrong_bytes"] for g in got),
        "lookups_bounded": sum(g["lookups_bounded"] for g in got),
        "valkey": {k: sum(t[k] for t in tiers) for k in (tiers[0] if tiers else {})},
        "flow": {k: sum(g["tier_stats"]["flow"][k] for g in got) for k in flows},
    }
    if failover is not None:
        out["recovery"] = _recovery(params, got, killed, promoted)
        out["timeline"] = _timeline(rows, t_start, end, params.prefix_blocks)
    return out


def _phase(
    params: FleetParams,
    rows: list[tuple[float, float, int, int, float]],
    lookups: list[tuple[float, float]],
    lo: float,
    hi: float,
) -> dict[str, Any]:
    mine = [r for r in rows if lo <= r[0] < hi]
    seconds = max(hi - lo, 1e-9)
    asked = len(mine) * params.prefix_blocks
    hits = sum(r[2] for r in mine)
    promoted = sum(r[3] for r in mine)
    return {
        "seconds": hi - lo,
        "requests": len(mine),
        "blocks_asked": asked,
        "hits": hits,
        "hit_rate": hits / asked if asked else 0.0,
        "promoted": promoted,
        "hit_GBps": hits * params.block_bytes / seconds / 1e9,
        "promoted_GBps": promoted * params.block_bytes / seconds / 1e9,
        "lookup": lat([s for t, s in lookups if lo <= t < hi]),
        "load": lat([r[4] for r in mine if r[4] >= 0]),
    }


def _recovery(
    params: FleetParams, got: list[dict[str, Any]], killed: float, promoted: float
) -> dict[str, Any]:
    """Per process, seconds from the kill to the start of its first request whose whole shared
    prefix hit with blocks read up from the cluster (None: never), and how many processes had
    hits from the cluster after the promotion."""
    each: list[float | None] = []
    for g in got:
        whole = [r for r in g["requests"] if r[2] >= params.prefix_blocks and r[3] > 0]
        back = [r[0] for r in whole if r[0] >= killed]
        each.append(min(back) - killed if back else None)
    seen = [x for x in each if x is not None]
    return {
        "cluster_hits_again_after_kill_s": each,
        "median_s": statistics.median(seen) if seen else None,
        "max_s": max(seen) if seen else None,
        "processes_with_cluster_hits_after_promotion": sum(
            any(r[0] >= promoted and r[3] > 0 for r in g["requests"]) for g in got
        ),
    }


def _timeline(
    rows: list[tuple[float, float, int, int, float]], t_start: float, end: float, prefix: int
) -> list[dict[str, Any]]:
    """Per ``TIMELINE_BINS`` th of the window: requests started, hit rate, blocks promoted."""
    step = (end - t_start) / TIMELINE_BINS
    out = []
    for i in range(TIMELINE_BINS):
        lo = t_start + i * step
        mine = [r for r in rows if lo <= r[0] < lo + step]
        asked = len(mine) * prefix
        hit_rate = sum(r[2] for r in mine) / asked if asked else 0.0
        promoted = sum(r[3] for r in mine)
        out.append(
            {"from_s": i * step, "requests": len(mine), "hit_rate": hit_rate, "promoted": promoted}
        )
    return out
