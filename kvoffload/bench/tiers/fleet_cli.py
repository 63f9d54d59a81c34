"""``kvoffload bench tiers --fleet``, the command side: its options checked, the servers, the run
(``fleet.py``), its table, and the exit status (1 when something that must never happen
did: a wrong byte, a process hung, failed or dead)."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any

from kvoffload.bench.common import console, default_out, machine_info, write_json
from kvoffload.bench.tiers.common import Fatal
from kvoffload.bench.tiers.servers import need_client, servers

FLEET_MAX = 64  # processes: each is a Python interpreter with its own host tier
FLEET_SECONDS_MAX = 3600.0
FLEET_BLOCK_KIB_MAX = 32 << 10  # a Valkey value holds a block plus its header: under 64 MiB


def check_fleet(args: argparse.Namespace) -> None:
    """Fatal, before anything starts, on a fleet option out of range or a clashing option."""
    if args.cluster or args.sections is not None:
        raise Fatal(
            "expected --fleet alone (it is its own run), got it with "
            + ("--cluster" if args.cluster else f"--sections {args.sections}")
        )
    if not 1 <= args.fleet <= FLEET_MAX:
        raise Fatal(f"expected --fleet between 1 and {FLEET_MAX} processes, got {args.fleet}")
    if not 0 < args.fleet_seconds <= FLEET_SECONDS_MAX:
        raise Fatal(
            f"expected --fleet-seconds > 0 and <= {FLEET_SECONDS_MAX:g}, got {args.fleet_seconds}"
        )
    if not 1 <= args.fleet_block_kib <= FLEET_BLOCK_KIB_MAX:
        raise Fatal(
            f"expected --fleet-block-kib between 1 and {FLEET_BLOCK_KIB_MAX}, got "
            f"{args.fleet_block_kib}"
        )
    if args.cluster_url is not None:
        from kvoffload.store.tiers.endpoint import parse_valkey_url

        try:
            cluster = parse_valkey_url(args.cluster_url).cluster
        except ValueError as e:
            raise Fatal(f"--cluster-url: {e}") from None
        if not cluster:
            raise Fatal(
                f"expected --cluster-url redis+cluster://host:port[,host:port...] (or "
                f"rediss+cluster://), got {args.cluster_url!r}"
            )


def run(args: argparse.Namespace) -> int:
    from kvoffload.bench.tiers.fleet import NODE_TIMEOUT_MS, FleetParams, run_fleet

    check_fleet(args)
    need_client("fleet", "a run without --fleet")
    seconds = float(args.fleet_seconds)
    params = FleetParams(
        processes=args.fleet,
        seconds=seconds,
        baseline_s=max(2.0, 0.3 * seconds),
        block_bytes=args.fleet_block_kib << 10,
    )
    result: dict[str, Any] = {"benchmark": "tiers_fleet", **machine_info()}
    result["load_average_1m"] = {"start": os.getloadavg()[0]}  # others' work on the machine
    with contextlib.ExitStack() as stack:
        started: dict[str, Any] = {}
        urls = servers(stack, True, args, result, started, NODE_TIMEOUT_MS)
        console.print(
            f"fleet: {params.processes} processes, {seconds:g} s window (and 2 one-process "
            f"runs of {params.baseline_s:g} s)"
        )
        result["fleet"] = run_fleet(params, urls, started.get("cluster"))
    result["load_average_1m"]["end"] = os.getloadavg()[0]
    print_fleet(result["fleet"])
    out = args.out or default_out("tiers_fleet", "cpu")
    console.print(f"wrote {write_json(out, result)}")
    problems = fleet_problems(result["fleet"]["fleet"])
    if problems:
        console.print(f"kvoffload bench tiers --fleet: FAILED: {'; '.join(problems)}")
        return 1
    return 0


def fleet_problems(run: dict[str, Any]) -> list[str]:
    """What must never happen in a fleet run, in words (empty: none happened)."""
    procs = run["processes"]
    problems = []
    if run["wrong_bytes"]:
        problems.append(f"{run['wrong_bytes']} wrong bytes loaded")
    if procs["hung"] or procs["reported"] != procs["count"]:
        problems.append(f"{procs['count'] - procs['reported']} processes did not report in time")
    if procs["errors"] or any(code != 0 for code in procs["exitcodes"]):
        problems.append(f"process errors {procs['errors']}, exit codes {procs['exitcodes']}")
    if procs["alive_at_kill"] not in (None, procs["count"]):
        problems.append(f"only {procs['alive_at_kill']} processes alive at the kill")
    return problems


def print_fleet(fleet: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="tiers: fleet (hits = blocks loaded / shared-prefix blocks asked)")
    for col in (
        "processes",
        "phase",
        "s",
        "requests",
        "hit rate",
        "hit GB/s",
        "lookup p50/p99 ms",
        "load p50/p99 ms",
    ):
        table.add_column(col)
    runs = {"one_process_one_server": "1, server", "one_process_cluster": "1, cluster"}
    runs["fleet"] = f"{fleet['params']['processes']}, cluster"
    for run, label in runs.items():
        for phase, row in fleet[run]["phases"].items():
            table.add_row(
                label,
                phase,
                f"{row['seconds']:.1f}",
                str(row["requests"]),
                f"{row['hit_rate']:.3f}",
                f"{row['hit_GBps']:.3f}",
                f"{row['lookup']['p50_ms']:.2f}/{row['lookup']['p99_ms']:.2f}",
                f"{row['load']['p50_ms']:.1f}/{row['load']['p99_ms']:.1f}",
            )
    console.print(table)
    run = fleet["fleet"]
    console.print(
        f"fleet: wrong bytes {run['wrong_bytes']}, processes {run['processes']}, "
        f"failover {run['failover']}, recovery {run.get('recovery')}, ratios {fleet['ratios']}"
    )
