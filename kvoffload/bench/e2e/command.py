"""``kvoffload bench e2e``: time to first token with and without kvoffload on a model runner.

It runs the model runner of ``kvoffload.bench.e2e.runner`` (a Llama-architecture decoder with
random weights, a paged KV cache, a GPU block pool with prefix caching) on one or more workloads
(multi-turn chat, chat that fits the GPU, a shared-document pool, chat mixed with unique prompts)
in the modes
``recompute``, ``gpu`` (GPU prefix cache), ``gpu_all`` (a GPU pool that never evicts: the ideal)
and ``kvoffload`` (GPU prefix cache plus kvoffload's host tier), then a zero-reuse workload for
kvoffload's overhead, then a bit-exact check of KV restored from host, and prints the targets it
is judged by; all of it once per engine graph mode (``--graph``: eager, piecewise, full). Its
options and the run they build: ``args.py``. See docs/e2e.md.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from kvoffload.bench.common import console, default_out, machine_info, progress, write_json
from kvoffload.bench.e2e.args import add_arguments as add_arguments  # cli.py routes to it
from kvoffload.bench.e2e.args import build_config


def run(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        raise SystemExit(
            "kvoffload bench e2e: expected torch (pip install -e '.[bench]'), got none installed"
        ) from None
    from kvoffload.bench.e2e.runner import dtype as dtypes
    from kvoffload.bench.e2e.runner.bench import run_bench

    if args.driver_times:  # before any native core opens (calls.py)
        os.environ["KVOFFLOAD_DRIVER_TIMES"] = "1"
    cuda = bool(torch.cuda.is_available())
    if args.device.startswith("cuda") and not cuda:
        raise SystemExit(f"--device {args.device}: expected a CUDA GPU, got none")
    if args.lower_tiers is not None:  # restored prefixes from disk and Valkey (lower_tiers.py)
        from kvoffload.bench.e2e.runner.lower_tiers import main as lower_tiers_main

        return lower_tiers_main(args, cuda)
    on_gpu = cuda and args.device != "cpu"
    cfg = build_config(args, on_gpu, dtypes.resolve(args.dtype, "cuda" if on_gpu else "cpu"))
    if not cfg.device.startswith("cuda"):
        threads = args.threads if args.threads is not None else max(1, (os.cpu_count() or 2) - 1)
        if threads <= 0:
            raise SystemExit(f"--threads: expected a positive count, got {threads}")
        torch.set_num_threads(threads)
    device = device_info(cfg.device)
    console.print(_describe(cfg))
    with progress() as bar:
        task = bar.add_task("e2e", total=cfg.steps())

        def advance(what: str) -> None:
            bar.update(task, advance=1, description=what)

        results = run_bench(cfg, advance)
    out = args.out or default_out(f"e2e_{cfg.model}", device["name"])
    result = {
        "benchmark": "e2e",
        **machine_info(),
        "device": device,
        "config": _config_dict(cfg),
        "results": results,
    }
    write_json(out, result)
    _print(result)
    console.print(f"JSON: {out}")
    if not args.no_plot:
        _plot(result, out.with_suffix(".png"))
    failed = [c for run in results["runs"].values() for c in run["verify"] if not c["ok"]]
    if failed:
        console.print(f"[red]correctness check FAILED on {len(failed)} sampled turn(s)[/red]")
        return 1
    return 0


def device_info(name: str) -> dict[str, Any]:
    """The run's torch version and device: name, CUDA and driver on a GPU; the CPU's name and
    torch's threads elsewhere."""
    import torch

    from kvoffload.bench.common import cpu_name

    info: dict[str, Any] = {"torch": torch.__version__}
    if name.startswith("cuda"):
        dev = torch.device(name)
        info["name"] = torch.cuda.get_device_name(dev)
        info["cuda"] = torch.version.cuda
        info["driver"] = _driver()
    else:
        info["name"] = "cpu " + cpu_name()
        info["threads"] = torch.get_num_threads()
    return info


def _driver() -> str | None:
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def _config_dict(cfg: Any) -> dict[str, Any]:
    import dataclasses

    out = dataclasses.asdict(cfg)
    out["workloads"] = [
        {
            **r.workload.as_dict(),
            **{k: v for k, v in dataclasses.asdict(r).items() if k != "workload"},
        }
        for r in cfg.workloads
    ]
    return out


def _describe(cfg: Any) -> str:
    lines = [
        f"e2e: {cfg.model} ({cfg.dtype}) on {cfg.device}, blocks of {cfg.block_size} tokens; "
        f"graph modes {','.join(cfg.graphs)}"
    ]
    for r in cfg.workloads:
        lines.append(
            f"  {r.workload.describe()}; {r.workload.distinct_blocks(cfg.block_size)} distinct "
            f"blocks, GPU pool {r.gpu_blocks}, host {r.host_blocks}; modes {','.join(r.modes)}"
            + (f"; {r.rounds} rounds" if r.rounds > 1 else "")
        )
    return "\n".join(lines)


def _print(result: dict[str, Any]) -> None:
    res = result["results"]
    console.print(
        f"link (kvoffload's blocking load, best of {len(res['link']['seconds'])}): "
        f"{res['link']['GBps']:.1f} GB/s"
    )
    for graph, run in res["runs"].items():
        _print_run(graph, run)


def _print_run(graph: str, run: dict[str, Any]) -> None:
    from rich.table import Table

    from kvoffload.bench.e2e.runner.targets import Target

    for kind, w in run["workloads"].items():
        which = "all requests" if kind == "fits" else "returning requests"
        table = Table(title=f"{kind}, {graph} graphs: TTFT ms, {which}")
        for col in ("mode", "graph", "p50", "p90", "p99", "turns/s", "GPU", "host", "wait", "hid"):
            table.add_column(col, justify="right")
        for mode, m in w["modes"].items():
            t = m["ttft_ms"] if kind == "fits" else m["ttft_ms_returning"]
            ov = m["overlap"]
            waited = ov["median_per_request_ms"]["exposed"] if ov else None
            hidden = ov["hidden_share"] if ov else None
            table.add_row(
                mode,
                graph,
                f"{t.get('p50', 0):.1f}",
                f"{t.get('p90', 0):.1f}",
                f"{t.get('p99', 0):.1f}",
                f"{m['turns_per_s']:.2f}",
                f"{100 * m['hit_ratio']['gpu']:.0f}%",
                f"{100 * m['hit_ratio']['host']:.0f}%",
                "-" if waited is None else f"{waited:.1f}",
                "-" if hidden is None else f"{100 * hidden:.0f}%",
            )
        console.print(table)
        att = w.get("attribution")
        if att:
            _print_attribution(kind, graph, att)
    console.print(
        "p50/p90/p99: TTFT percentiles (ms); turns/s: requests finished per second; GPU/host: "
        "share of prompt tokens hit there; wait: ms a restored request's attention waited for "
        "its load (median); hid: share of load time under prefill (GPU only); -: no load"
    )
    zero = run["zero_reuse"]
    if zero:
        tps, over = zero["turns_per_s"], zero["overhead_turns_per_s"]
        console.print(
            f"zero reuse ({zero['rounds']} rounds x {zero['turns_per_round']} unique prompts of "
            f"{zero['prompt_tokens']} tokens), turns/s: gpu {tps['gpu']:.2f}, "
            + ", ".join(f"{n} {tps[n]:.2f} (cost {100 * over[n]:+.1f}%)" for n in over)
            + "; cost: turns/s lost against gpu (negative: faster than gpu)"
        )
    for c in run["verify"]:
        console.print(
            f"verify turn {c['turn']} ({c['restored_host_hit_tokens']} of {c['prompt_tokens']} "
            f"tokens restored): KV {c['restored_kv_bit_equal']}, logits {c['logits_bit_equal']}, "
            f"{c['decode_steps']} tokens {c['greedy_tokens_equal']} -> "
            f"{'ok' if c['ok'] else 'FAILED'}"
        )
    for r in run.get("graph_replays", []):
        console.print(
            f"graph replay vs eager step, {r['tokens']} tokens in bucket {r['bucket']}: logits "
            f"bit-equal {r['logits_bit_equal']}"
        )
    console.print(f"targets ({graph}):")
    for t in run["targets"]:
        console.print("  " + Target(**{k: v for k, v in t.items() if k != "met"}).line())


RATIOS = ("launch_vs_gpu_all", "p50_vs_gpu_all", "p99_vs_gpu_all")


def _print_attribution(kind: str, graph: str, att: dict[str, Any]) -> None:
    """One restored request's medians: kvoffload's calls, launch against gpu_all, GPU wait."""
    from rich.table import Table

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    table = Table(title=f"{kind}, {graph}: {att['requests']} restored, medians")
    for col in ("graph", "kvoffload calls", "ms", "calls"):
        table.add_column(col, justify="right")
    for name, value in att["kvo_ms_p50"].items():
        table.add_row(graph, name, ms(value), f"{att['kvo_calls_p50'][name]:.0f}")
    table.add_row(graph, "total (no probes)", ms(att["kvo_ms_total_p50"]), "")
    table.add_row(graph, "of it before token 1", ms(att["kvo_ms_in_ttft_p50"]), "")
    console.print(table)
    wait, timed = att["wait_call_us_p50"], att.get("wait_call_us_timed_p50")
    ratio = att["launch_vs_gpu_all"]
    console.print(
        f"  launch {ms(att['launch_ms_p50'])} ms vs gpu_all {ms(att['gpu_all_launch_ms_p50'])} "
        f"ms ({'-' if ratio is None else f'{ratio:.2f}x'}); GPU waited {ms(att['gpu_wait_ms_p50'])}"
        f" ms; a per-layer wait call {'-' if wait is None else f'{wait:.1f}'} us"
        + ("" if timed is None else f" ({timed:.1f} with the StallTimer's records)")
    )
    side = att.get("beside")
    if side:  # --modes with gpu_all_copy: the same bytes copied beside gpu_all's forward

        def vs(mode: str) -> str:
            m = side[mode]
            return "/".join("-" if m[k] is None else f"{m[k]:.2f}x" for k in RATIOS)

        console.print(
            f"  vs gpu_all, launch/p50/p99: gpu_all_copy (a plain copy of the same bytes) "
            f"{vs('gpu_all_copy')}, kvoffload {vs('kvoffload')} ({side['requests']} requests)"
        )
    grown = att.get("growth_ms_p50")
    if grown:  # results written before 2026-11-27 have none
        host = ", ".join(
            f"{k[5:]} {v:+.2f}" for k, v in grown.items() if k.startswith("host:") and v
        )
        console.print(
            f"  TTFT {_plus(grown['ttft'])} ms vs gpu_all; host steps: {host}; the forward's "
            f"device time {_plus(grown['device_prefill'])} (GPU waited "
            f"{_plus(grown['gpu_wait'])}; a plain copy beside gpu_all: "
            f"{_plus(grown.get('copy_device_prefill'))})"
        )
    growth = att.get("layer_launch_growth_ms_p50")
    if growth:  # eager and piecewise: where in the forward the launch grew
        step = max(1, len(growth) // 4)
        at = ", ".join(f"layer {i} {growth[i]:+.2f}" for i in range(0, len(growth), step))
        console.print(f"  launched later than in gpu_all, ms from the prefill's start: {at}")
        console.print(
            f"  host ms in the layer waits (call and timing): {att['wait_host_ms_p50']:.3f}"
        )
    if "load_runs_p50" in att:  # results written before 2026-11-26 have none
        submit = att["host_ms_p50"].get("load_submit")
        console.print(
            f"  load_submit {ms(submit)} ms; host slot runs per load {att['load_runs_p50']:.0f} "
            f"(most {att['load_runs_max']})"
        )


def _plus(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def _plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        console.print("no plot: matplotlib is not installed (pip install matplotlib)")
        return
    from kvoffload.bench.e2e.runner.plot import plot

    console.print(f"plot: {plot(result, path)}")
