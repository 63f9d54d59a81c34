"""``kvoffload bench multi-gpu``: N processes, one per GPU, storing and loading at once, against
each GPU's link alone and the host's memory bandwidth, with and without NUMA placement.

Per ``--numa`` setting (default ``auto`` then ``off``) it starts N worker processes
(``multi_gpu_worker``: one per GPU; ``--same-gpu``: all on GPU 0; ``--device cpu``: N processes
copying CPU memory, for testing the harness), each with its own host arena placed by that setting.
Per ``--workloads`` item (``link``: contiguous copies both ways; ``kv``: kvoffload stores and loads
at once) it runs a window of ``--seconds`` on each worker alone, then on all at once from one
start time. The host's memory bandwidth is measured first in the same run (``host_memory``). The
JSON has the machine, date, topology (NUMA nodes, each worker's GPU, bus id, node, and where its
arena's pages are, read back), every window, and per workload: the aggregate GB/s of N at once
(all bytes over the span from the first start to the last end), the bound min(sum over GPUs of the
link alone, host memory traffic) and the aggregate's share of it.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvoffload.bench.common import console, default_out, machine_info, write_json

WORKLOADS = ("link", "kv")
TARGET = 0.9  # issue 29: the aggregate of N GPUs >= 0.9 of min(N x one link, host memory)
READY_S = 600.0  # longest a worker may take to build (pinning a large arena takes seconds)
START_LEAD_S = 0.5  # workers are told to start this far ahead, so all begin at once


def _csv(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, default=0, help="processes: 0 means every GPU (2 on CPU)")
    p.add_argument("--same-gpu", action="store_true", help="put every process on GPU 0")
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if present"
    )
    p.add_argument(
        "--numa",
        type=_csv,
        default=["auto", "off"],
        help="numa_node settings to compare, one run each: auto, off or a node id",
    )
    p.add_argument("--workloads", type=_csv, default=list(WORKLOADS), help="link and/or kv")
    p.add_argument("--seconds", type=float, default=3.0, help="length of each timed window")
    p.add_argument("--model", default="llama3-8b", help="model shape of the kv workload")
    p.add_argument("--layout", default="kv_split", help="engine layout of the kv workload")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--blocks", type=int, default=None, help="blocks each way (256; 16 on CPU)")
    p.add_argument("--method", default=None, help="copy backend (staged; host on CPU)")
    p.add_argument("--link-mib", type=int, default=None, help="MiB each way (256; 16 on CPU)")
    p.add_argument(
        "--host-mib",
        type=int,
        default=None,
        help="MiB the host memory probe copies (default: 64 per core, at least 1024, so that "
        "each thread's copy outlasts starting it)",
    )
    p.add_argument("--host-reps", type=int, default=5, help="timed host memory probe copies")
    p.add_argument("--no-bind-cpus", action="store_true", help="leave CPU affinity alone")
    p.add_argument("--sysfs", default="/sys", help="sysfs root (tests give a fake topology)")
    p.add_argument("--out", type=Path, default=None, help="JSON result path")
    p.add_argument("--no-plot", action="store_true", help="write no PNG beside the JSON")


def devices(args: argparse.Namespace) -> list[str]:
    """One torch device per process."""
    use_cuda = args.device == "cuda"
    count = 0
    if args.device != "cpu":
        from kvoffload.transfer.pinning import cuda_available

        if cuda_available():
            import torch

            use_cuda, count = True, torch.cuda.device_count()
        elif use_cuda:
            raise SystemExit("--device cuda: expected a CUDA GPU, found none")
    n = args.gpus or (count if use_cuda else 2)
    if n <= 0:
        raise SystemExit(f"--gpus: expected a number of processes > 0, got {n}")
    if not use_cuda:
        return ["cpu"] * n
    if args.same_gpu:
        return ["cuda:0"] * n
    if n > count:
        raise SystemExit(
            f"--gpus: expected at most the {count} GPUs present, got {n} (--same-gpu?)"
        )
    return [f"cuda:{i}" for i in range(n)]


def _check(args: argparse.Namespace) -> None:
    from kvoffload.store.numa import check_setting
    from kvoffload.transfer.shapes import LAYOUTS, MODELS

    if args.model not in MODELS:
        raise SystemExit(f"--model: expected a name from {sorted(MODELS)}, got {args.model!r}")
    if args.layout not in LAYOUTS:
        raise SystemExit(f"--layout: expected a name from {sorted(LAYOUTS)}, got {args.layout!r}")
    for w in args.workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"--workloads: expected names from {list(WORKLOADS)}, got {w!r}")
    for i, s in enumerate(args.numa):
        args.numa[i] = int(s) if s.isdigit() else s
        try:
            check_setting(args.numa[i])
        except ValueError as err:
            raise SystemExit(f"--numa: {err}") from err
    if args.seconds <= 0 or (args.host_mib or 1) <= 0 or args.host_reps <= 0:
        raise SystemExit("--seconds, --host-mib and --host-reps must be positive")


class Fleet:
    """The worker processes of one NUMA setting; ``window`` runs one timed window on some."""

    def __init__(self, specs: list[Any]) -> None:
        from kvoffload.bench.multi_gpu_worker import serve

        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self.conns, self.procs = [], []
        for spec in specs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=serve, args=(spec, child), name=f"kvoffload-bench-{spec.rank}"
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        try:
            self.infos = [self._answer(r, "ready", READY_S) for r in range(len(specs))]
        except BaseException:
            self.close()
            raise

    def _answer(self, rank: int, kind: str, timeout: float) -> dict[str, Any]:
        conn, proc = self.conns[rank], self.procs[rank]
        deadline = time.monotonic() + timeout
        while not conn.poll(0.2):
            if not proc.is_alive():
                raise RuntimeError(f"worker {rank} exited with code {proc.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {rank}: no {kind!r} answer after {timeout:.0f} s")
        msg = conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"worker {msg[1]}")
        if msg[0] != kind:
            raise RuntimeError(f"worker {rank}: expected a {kind!r} answer, got {msg[0]!r}")
        answer: dict[str, Any] = msg[1]
        return answer

    def window(self, workload: str, ranks: list[int], seconds: float) -> list[dict[str, Any]]:
        start_at = time.time() + START_LEAD_S
        for r in ranks:
            self.conns[r].send(("run", workload, start_at, seconds))
        return [self._answer(r, "done", READY_S + seconds) for r in ranks]

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if proc.is_alive():
                with contextlib.suppress(BrokenPipeError, OSError):  # exiting: join reaps it
                    conn.send(("close",))
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        for conn in self.conns:
            conn.close()


def aggregate(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Windows run at once: all bytes over the span from the first start to the last end, the
    sum of each worker's own rate beside it, and the share of the span all of them overlap."""
    start = min(r["start"] for r in results)
    end = max(r["end"] for r in results)
    common = min(r["end"] for r in results) - max(r["start"] for r in results)
    return {
        "GBps": sum(r["bytes"] for r in results) / (end - start) / 1e9,
        "sum_of_rates_GBps": sum(r["GBps"] for r in results),
        "overlap": max(common, 0.0) / (end - start),
    }


def bound(alone: list[dict[str, Any]], host_traffic_GBps: float) -> dict[str, Any]:
    """min(the links, host memory): per device the best rate a worker reached on it alone (workers
    sharing one GPU share its link), summed over devices, against the host's memory traffic."""
    per_device: dict[str, float] = {}
    for r in alone:
        per_device[r["device"]] = max(per_device.get(r["device"], 0.0), r["GBps"])
    links = sum(per_device.values())
    return {
        "links_GBps": links,
        "host_memory_GBps": host_traffic_GBps,
        "GBps": min(links, host_traffic_GBps),
        "limited_by": "links" if links <= host_traffic_GBps else "host memory",
    }


def measure(fleet: Fleet, workload: str, seconds: float, host_GBps: float) -> dict[str, Any]:
    ranks = list(range(len(fleet.procs)))
    alone = [fleet.window(workload, [r], seconds)[0] for r in ranks]
    together = fleet.window(workload, ranks, seconds)
    agg, lim = aggregate(together), bound(alone, host_GBps)
    return {
        "workload": workload,
        "alone": alone,
        "together": together,
        "aggregate": agg,
        "bound": lim,
        "of_bound": agg["GBps"] / lim["GBps"],
        "meets_target": agg["GBps"] >= TARGET * lim["GBps"],
        "exact": all(r["exact"] for r in (*alone, *together)),
    }


def run(args: argparse.Namespace) -> int:
    from kvoffload.bench.host_memory import probe
    from kvoffload.bench.multi_gpu_worker import WorkerSpec
    from kvoffload.store.numa import Topology

    _check(args)
    devs = devices(args)
    cuda = devs[0].startswith("cuda")
    cores = len(os.sched_getaffinity(0))
    threads = sorted({1, max(1, cores // 2), cores})
    host_mib = args.host_mib or max(1024, 64 * cores)
    console.print(f"host memory: {host_mib} MiB copies on {threads} threads")
    host = probe(host_mib << 20, threads, args.host_reps)
    base = WorkerSpec(
        rank=0,
        device=devs[0],
        numa_node="off",
        bind_cpus=not args.no_bind_cpus,
        model=args.model,
        layout=args.layout,
        block_size=args.block_size,
        blocks=args.blocks or (256 if cuda else 16),
        method=args.method or ("staged" if cuda else "host"),
        link_bytes=(args.link_mib or (256 if cuda else 16)) << 20,
        sysfs=args.sysfs,
    )
    topology = Topology(Path(args.sysfs))
    result: dict[str, Any] = {"benchmark": "multi_gpu", **machine_info()}
    result["topology"] = {"numa_nodes": topology.describe()}
    result["args"] = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    result["args"]["out"] = str(args.out) if args.out else None
    result["host_memory"] = host
    result["runs"] = []
    for setting in args.numa:
        specs = [replace(base, rank=i, device=d, numa_node=setting) for i, d in enumerate(devs)]
        console.print(f"numa_node={setting!r}: starting {len(specs)} workers on {devs}")
        fleet = Fleet(specs)
        try:
            rows = [measure(fleet, w, args.seconds, host["traffic_GBps"]) for w in args.workloads]
        finally:
            fleet.close()
        result["runs"].append({"numa_node": setting, "workers": fleet.infos, "workloads": rows})
        result["topology"].setdefault("workers", [_where(i, topology) for i in fleet.infos])
    out = args.out or default_out("multi_gpu", devs[0] if not cuda else f"{len(devs)}gpu")
    _print(result)
    console.print(f"wrote {write_json(out, result)}")
    if not args.no_plot:
        from kvoffload.bench.multi_gpu_plot import plot

        console.print(f"wrote {plot(result, out.with_suffix('.png'))}")
    if not all(w["exact"] for r in result["runs"] for w in r["workloads"]):
        console.print("a window's bytes differ from their source: see 'exact' in the JSON")
        return 1
    return 0


def _where(info: dict[str, Any], topology: Any) -> dict[str, Any]:
    """A worker's device and the NUMA node sysfs gives its PCI address."""
    bus = info["bus_id"]
    node = topology.device_node(bus) if bus else None
    return {
        "rank": info["rank"],
        "device": info["device"],
        "name": info["device_name"],
        "bus_id": bus,
        "numa_node": node,
    }


def _print(result: dict[str, Any]) -> None:
    from rich.table import Table

    host = result["host_memory"]["traffic_GBps"]
    table = Table(title=f"GB/s, both ways summed; host memory traffic {host:.1f} GB/s")
    for col in ("numa", "work", "alone", "together", "aggregate", "bound", "of bound"):
        table.add_column(col, justify="left" if col in ("numa", "work") else "right")
    for run in result["runs"]:
        for w in run["workloads"]:
            table.add_row(
                str(run["numa_node"]),
                w["workload"],
                " ".join(f"{r['GBps']:.1f}" for r in w["alone"]),
                " ".join(f"{r['GBps']:.1f}" for r in w["together"]),
                f"{w['aggregate']['GBps']:.1f}",
                f"{w['bound']['GBps']:.1f}",
                f"{w['of_bound']:.0%}",
            )
    console.print(table)
