"""``kvoffload bench tiers``: lower-tier throughput and latency on this machine, the two design
choices they decided, and a fleet of engines on a cluster under failover.

At the Llama-3-8B block sizes (block size 16, bf16): a whole host slot (2 MiB, every layer's K and
V) and one layer's K+V page (64 KiB). Every section is repeated ``--rounds`` times, its variants
interleaved inside each round, and the median round is reported. One module per section:

- ``format`` (``format.py``): raw disk I/O, one file per block against a slab file.
- ``disk`` and ``valkey`` (``put_get.py``): the real tiers, ``put``/``get`` of one block per
  call (latency) and of 16-block batches from 2 threads (throughput). Valkey runs on loopback
  (started here unless ``--valkey-url`` is given): its best case.
- ``policy`` (``policy.py``): write-behind against demote-on-evict through a full host tier.
- ``sharing`` (``--cluster``; ``sharing.py``): ``--processes`` engine processes sharing
  prefixes through one server and through a cluster (3 primaries + 3 replicas started here
  unless ``--cluster-url`` is given), side by side.
- ``read`` (``read.py``): one engine process reading 2 MiB blocks through its tier mover
  from one server and from a cluster beside it, against the server's raw GETs in the same run.
- ``--fleet [N]`` (``fleet.py``): N engine-like processes (default 8) storing and loading
  through a cluster (``--cluster-url``, or 3 + 3 started here, one of whose primaries is killed
  mid-run), against one process on one server: hits before / during / after the failover,
  lookup and load latency, GB/s, wrong bytes, hung or dead processes.

A missing client, server or an unreachable ``--valkey-url`` ends the run with one line on stderr
and exit status 1, before anything is measured; so does a bad option value.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvoffload.bench.common import console, default_out, machine_info, progress, write_json
from kvoffload.bench.tiers.common import BATCH, FP, SIZES, Fatal, blocks, fs_of, median_round
from kvoffload.bench.tiers.servers import need_client, servers

SECTIONS = ("format", "disk", "valkey", "policy", "sharing", "read")
DEFAULT_SECTIONS = ("format", "disk", "valkey", "policy")
FLEET_DEFAULT = 8  # --fleet without a number


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure")
    p.add_argument("--valkey-url", default=None, help="server to use (default: start one)")
    p.add_argument("--mib", type=int, default=256, help="MiB moved per size and variant")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions")
    p.add_argument(
        "--sections",
        default=None,
        help=f"comma separated, from {','.join(SECTIONS)} (default: {','.join(DEFAULT_SECTIONS)})",
    )
    p.add_argument(
        "--cluster",
        action="store_true",
        help="only the sharing section: processes sharing prefixes, one server vs a cluster",
    )
    p.add_argument(
        "--cluster-url",
        default=None,
        help="redis+cluster://host:port,... for --cluster and --fleet (default: start 3 primaries "
        "+ 3 replicas on 127.0.0.1; only a cluster started here has a primary killed)",
    )
    p.add_argument("--processes", type=int, default=4, help="sharing section: engine processes")
    p.add_argument(
        "--fleet",
        type=int,
        nargs="?",
        const=FLEET_DEFAULT,
        default=None,
        metavar="N",
        help=f"only the fleet run: N engine processes on a cluster under failover (N: "
        f"{FLEET_DEFAULT} when omitted)",
    )
    p.add_argument("--fleet-seconds", type=float, default=20.0, help="the fleet's timed window")
    p.add_argument(
        "--fleet-block-kib", type=int, default=256, help="the fleet's block (host slot), KiB"
    )
    p.add_argument("--out", type=Path, default=None, help="JSON result path")


def run(args: argparse.Namespace) -> int:
    if args.fleet is not None:
        from kvoffload.bench.tiers import fleet_cli

        return fleet_cli.run(args)
    sections = _sections(args)
    shared = {"valkey", "sharing", "read"} & set(sections)
    if shared:
        need_client("/".join(sorted(shared)), "--sections format,disk,policy")
    base = Path(tempfile.mkdtemp(prefix="kvoffload-bench-tiers-", dir=args.dir))
    result: dict[str, Any] = {"benchmark": "tiers", **machine_info(), "dir_fs": fs_of(base)}
    result["load_average_1min"] = {"start": os.getloadavg()[0]}  # a shared machine's busyness
    result["params"] = {"mib": args.mib, "rounds": args.rounds, "batch_blocks": BATCH}
    try:
        with contextlib.ExitStack() as stack:
            both = bool({"sharing", "read"} & set(sections))  # one server and a cluster
            urls = servers(stack, both, args, result) if shared else {}
            with progress() as bar:
                task = bar.add_task("tiers", total=len(sections) * len(SIZES) * args.rounds)
                for section in sections:
                    result[section] = {}
                    sizes = {"slot_2MiB": SIZES["slot_2MiB"]} if section == "read" else SIZES
                    for label, size in sizes.items():
                        bar.update(task, description=f"{section} {label}")
                        rounds = []
                        for r in range(args.rounds):
                            where = base / f"{section}-{label}-{r}"
                            rounds.append(_section(section, where, size, args, urls))
                            bar.advance(task)
                        result[section][label] = median_round(rounds)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result["load_average_1min"]["end"] = os.getloadavg()[0]
    _print(result)
    out = args.out or default_out("tiers", "cpu")
    console.print(f"wrote {write_json(out, result)}")
    return 0


def _sections(args: argparse.Namespace) -> list[str]:
    """The sections asked for; Fatal on bad values (checked before anything runs)."""
    given = args.sections if args.sections is not None else ",".join(DEFAULT_SECTIONS)
    sections = ["sharing"] if args.cluster else [x.strip() for x in given.split(",") if x.strip()]
    if not sections or not set(sections) <= set(SECTIONS) or args.mib <= 0 or args.rounds <= 0:
        raise Fatal(
            f"expected --sections from {list(SECTIONS)}, --mib > 0 and --rounds > 0, got "
            f"{given!r}, {args.mib}, {args.rounds}"
        )
    if args.processes <= 0:
        raise Fatal(f"expected --processes > 0, got {args.processes}")
    return sections


def _section(
    section: str, root: Path, size: int, args: argparse.Namespace, urls: dict[str, str]
) -> dict[str, Any]:
    if section == "read":
        from kvoffload.bench.tiers.read import read_round

        return read_round(urls, blocks(max(BATCH * 2, (args.mib << 20) // size), size))
    if section == "sharing":
        from kvoffload.bench.tiers.sharing import run_sharing

        total = args.mib << 20
        return {
            target: run_sharing(url, size, total, args.processes) for target, url in urls.items()
        }
    if section == "policy":
        from kvoffload.bench.tiers.policy import PACE_MBPS, policy_round

        n = max(BATCH * 2, (args.mib << 20) // size)
        host = max(BATCH * 4, n // 4)  # a host tier a quarter of what streams through it
        jobs = max(8, 2 * n // BATCH)  # twice the blocks of the other sections
        return {
            "write_behind": policy_round(root / "wb", size, host, jobs, demote=False),
            "demote_on_evict": policy_round(root / "de", size, host, jobs, demote=True),
            f"write_behind_paced_{PACE_MBPS}MBps": policy_round(
                root / "wbp", size, host, jobs, demote=False, pace_mbps=PACE_MBPS
            ),
        }
    data = blocks(max(BATCH * 2, (args.mib << 20) // size), size)
    if section == "format":
        from kvoffload.bench.tiers.format import format_files, format_slab

        files = format_files(root / "files", data)
        return {"file_per_block": files, "slab": format_slab(root / "slab", data)}
    from kvoffload.bench.tiers.put_get import disk_cold, tier_round

    if section == "disk":
        from kvoffload.store.tiers.disk import DiskTier, record_bytes_for

        cap = (3 * len(data) + 8) * record_bytes_for(size)
        return tier_round(lambda b: DiskTier(root, FP, b, cap), data, disk_cold)
    from kvoffload.store.tiers.valkey import ValkeyTier

    url = urls["one_server"]
    return tier_round(
        lambda b: ValkeyTier(url, FP, b, ttl_s=600, timeout_s=5.0), data, lambda t: None
    )


def _print(result: dict[str, Any]) -> None:
    from rich.table import Table

    for section in SECTIONS:
        if section not in result:
            continue
        table = Table(title=f"tiers: {section} (median of rounds)")
        table.add_column("size")
        table.add_column("variant")
        table.add_column("numbers")
        for label, row in result[section].items():
            variants = (
                row.items()
                if section in ("format", "policy", "sharing", "read")
                else [("tier", row)]
            )
            for name, numbers in variants:
                flat = ", ".join(
                    f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in _flatten(numbers).items()
                )
                table.add_row(label, name, flat)
        console.print(table)
    console.print(
        "size: block size; numbers: name=value, where MBps is MB/s (10^6 bytes per second), ms "
        "milliseconds, p50/p99 per-block latency percentiles; a name with sync or flushed "
        "includes the fsync that puts the bytes on the device; warm / cold reads hit / miss the "
        "page cache; batched_2threads: batches of blocks on 2 threads"
    )


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
