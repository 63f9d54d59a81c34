"""``kvoffload bench e2e``: time to first token of multi-turn chats, with and without kvoffload.

It runs the model runner of ``benchmarks/engine/`` (a Llama-architecture decoder with random
weights, a paged KV cache, a GPU block pool with prefix caching) in three modes on one workload:
``recompute`` (no prefix cache), ``gpu`` (GPU prefix cache) and ``kvoffload`` (GPU prefix cache
plus kvoffload's host tier), then a zero-reuse workload for kvoffload's overhead, then a bit-exact
check of KV restored from host. The runner lives in the source checkout, not in the installed
package: run this from a clone installed with ``pip install -e '.[torch]'``. See docs/e2e.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from kvoffload.bench.common import console, default_out, machine_info, progress, write_json

# model -> (conversations, turns, system, user, answer tokens, prefill chunk)
PRESETS: dict[str, tuple[int, int, int, int, int, int]] = {
    "llama3-8b": (16, 8, 2048, 512, 256, 2048),
    "qwen2.5-7b": (16, 8, 2048, 512, 256, 2048),
    "tiny": (8, 8, 256, 64, 64, 512),
    "micro": (4, 3, 32, 32, 16, 64),
}
MODES = ("recompute", "gpu", "kvoffload")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="auto",
        choices=("auto", *PRESETS),
        help="model shapes (auto: llama3-8b on a GPU, tiny on a CPU)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU: torch threads (default: cores - 1, leaving one to kvoffload's copy thread)",
    )
    w = p.add_argument_group("workload (defaults depend on --model)")
    w.add_argument("--conversations", type=int, default=None, help="clients, interleaved")
    w.add_argument("--turns", type=int, default=None, help="turns per conversation")
    w.add_argument("--system-tokens", type=int, default=None, help="shared system prompt")
    w.add_argument("--user-tokens", type=int, default=None, help="tokens per user turn")
    w.add_argument("--answer-tokens", type=int, default=None, help="tokens per answer")
    e = p.add_argument_group("engine")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    e.add_argument("--chunk-tokens", type=int, default=None, help="prefill chunk (tokens)")
    e.add_argument(
        "--gpu-blocks",
        type=int,
        default=None,
        help="GPU pool capacity (default: a quarter of all conversations' final histories)",
    )
    e.add_argument(
        "--host-blocks",
        type=int,
        default=None,
        help="kvoffload host capacity (default: 1.25x all conversations' final histories)",
    )
    e.add_argument("--backend", default="auto", help="kvoffload copy backend")
    e.add_argument(
        "--admission",
        default="reuse",
        choices=("reuse", "all"),
        help="which requests kvoffload stores: those that reused a prefix (reuse), or all",
    )
    r = p.add_argument_group("run")
    r.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated, from {','.join(MODES)}"
    )
    r.add_argument(
        "--zero-reuse-rounds", type=int, default=2, help="gpu/kvoffload rounds on unique prompts"
    )
    r.add_argument(
        "--zero-reuse-turns", type=int, default=None, help="requests per round (default: C)"
    )
    r.add_argument("--verify", type=int, default=2, help="sampled turns checked bit for bit")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", type=Path, default=None, help="JSON path (PNG next to it)")
    r.add_argument("--no-plot", action="store_true", help="skip the PNG")


def checkout() -> Path:
    """The source checkout holding ``benchmarks/engine``, put on ``sys.path``; SystemExit if the
    package was not installed from one (``pip install -e``)."""
    import kvoffload

    repo = Path(kvoffload.__file__).resolve().parents[1]
    if not (repo / "benchmarks" / "engine" / "engine.py").is_file():
        raise SystemExit(
            "kvoffload bench e2e runs the model runner in benchmarks/engine/ of a source checkout, "
            f"and found none next to the installed package ({repo}). Clone the repository and "
            "install it editable: pip install -e '.[torch]'"
        )
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    return repo


def build_config(args: argparse.Namespace, cuda: bool) -> Any:
    from benchmarks.engine.bench import BenchConfig
    from benchmarks.engine.workload import ChatShape

    model = args.model if args.model != "auto" else ("llama3-8b" if cuda else "tiny")
    conv, turns, system, user, answer, chunk = PRESETS[model]

    def pick(value: int | None, default: int) -> int:
        return default if value is None else value

    try:
        chat = ChatShape(
            pick(args.conversations, conv),
            pick(args.turns, turns),
            pick(args.system_tokens, system),
            pick(args.user_tokens, user),
            pick(args.answer_tokens, answer),
        )
        if args.block_size <= 0:
            raise ValueError(f"expected --block-size > 0, got {args.block_size}")
        history = -(-chat.history_tokens // args.block_size)
        total = chat.conversations * history
        return BenchConfig(
            model=model,
            device=args.device if args.device != "auto" else ("cuda" if cuda else "cpu"),
            chat=chat,
            gpu_blocks=pick(args.gpu_blocks, max(total // 4, 2 * history)),
            host_blocks=pick(args.host_blocks, total + total // 4),
            block_size=args.block_size,
            chunk_tokens=pick(args.chunk_tokens, chunk),
            modes=tuple(m for m in args.modes.split(",") if m),
            zero_reuse_rounds=args.zero_reuse_rounds,
            zero_reuse_turns=pick(args.zero_reuse_turns, chat.conversations),
            verify=args.verify,
            backend=args.backend,
            admission=args.admission,
            seed=args.seed,
        )
    except ValueError as err:
        raise SystemExit(f"kvoffload bench e2e: {err}") from None


def run(args: argparse.Namespace) -> int:
    checkout()
    try:
        import torch
    except ImportError:
        raise SystemExit("kvoffload bench e2e needs torch: pip install -e '.[torch]'") from None
    from benchmarks.engine.bench import run_bench

    cuda = bool(torch.cuda.is_available())
    if args.device.startswith("cuda") and not cuda:
        raise SystemExit(f"--device {args.device}: expected a CUDA GPU, found none")
    cfg = build_config(args, cuda and args.device != "cpu")
    if not cfg.device.startswith("cuda"):
        threads = args.threads if args.threads is not None else max(1, (os.cpu_count() or 2) - 1)
        if threads <= 0:
            raise SystemExit(f"--threads: expected a positive count, got {threads}")
        torch.set_num_threads(threads)
    device = _device(cfg.device)
    console.print(_describe(cfg))
    total = _steps(cfg)
    with progress() as bar:
        task = bar.add_task("e2e", total=total)

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
    failed = [c for c in results["verify"] if not c["ok"]]
    if failed:
        console.print(f"[red]correctness check FAILED on {len(failed)} sampled turn(s)[/red]")
        return 1
    return 0


def _steps(cfg: Any) -> int:
    turns = cfg.chat.conversations * cfg.chat.turns
    warm = len({*cfg.modes, *(("gpu", "kvoffload") if cfg.zero_reuse_rounds else ())})
    variants = 2 if cfg.admission == "all" else 3
    zero = variants * cfg.zero_reuse_rounds * cfg.zero_reuse_turns
    return int(warm + len(cfg.modes) * turns + zero + cfg.verify)


def _device(name: str) -> dict[str, Any]:
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
    chat = out.pop("chat")
    return {**chat, **out}


def _describe(cfg: Any) -> str:
    c = cfg.chat
    return (
        f"e2e: {cfg.model} on {cfg.device}; {c.conversations} conversations x {c.turns} turns "
        f"(system {c.system_tokens}, user {c.user_tokens}, answer {c.answer_tokens} tokens; "
        f"longest prompt {c.prompt_tokens(c.turns)}); GPU pool {cfg.gpu_blocks} blocks "
        f"(all histories: {cfg.total_history_blocks()}), host {cfg.host_blocks} blocks"
    )


def _print(result: dict[str, Any]) -> None:
    from rich.table import Table

    res = result["results"]
    table = Table(title="TTFT per mode, all turns (attn: share of TTFT in attention)")
    for col in ("mode", "p50 ms", "p90 ms", "p99 ms", "turns/s", "GPU hit", "host hit"):
        table.add_column(col, justify="right")
    for col in ("loaded", "GB/s", "attn"):
        table.add_column(col, justify="right")
    for mode, run in res["modes"].items():
        t, h = run["ttft_ms"], run["host"]
        gbps = h["load_GBps"]
        table.add_row(
            mode,
            f"{t['p50']:.1f}",
            f"{t['p90']:.1f}",
            f"{t['p99']:.1f}",
            f"{run['turns_per_s']:.2f}",
            f"{100 * run['hit_ratio']['gpu']:.0f}%",
            f"{100 * run['hit_ratio']['host']:.0f}%",
            f"{h['loaded_bytes'] / 1e9:.2f}GB",
            "-" if gbps is None else f"{gbps:.1f}",
            f"{100 * run['attention_share_of_ttft']:.0f}%",
        )
    console.print(table)
    sp = res["speedup"]
    if sp:
        console.print(
            "returning turns, TTFT recompute / kvoffload: "
            f"p50 {sp.get('recompute_over_kvoffload_p50', float('nan')):.1f}x, "
            f"p99 {sp.get('recompute_over_kvoffload_p99', float('nan')):.1f}x; "
            f"gpu / kvoffload: p50 {sp.get('gpu_over_kvoffload_p50', float('nan')):.1f}x, "
            f"p99 {sp.get('gpu_over_kvoffload_p99', float('nan')):.1f}x"
        )
    zero = res["zero_reuse"]
    if zero:
        tps, over = zero["turns_per_s"], zero["overhead_turns_per_s"]
        console.print(
            f"zero reuse ({zero['rounds']} rounds x {zero['turns_per_round']} unique prompts of "
            f"{zero['prompt_tokens']} tokens), turns/s: gpu {tps['gpu']:.2f}, "
            + ", ".join(
                f"{name} {tps[name]:.2f} (overhead {100 * over[name]:+.1f}%, TTFT p50 "
                f"{100 * zero['overhead_ttft_p50'][name]:+.1f}%)"
                for name in over
            )
        )
    for c in res["verify"]:
        console.print(
            f"verify turn {c['turn']} ({c['prompt_tokens']} tokens, "
            f"{c['restored_host_hit_tokens']} restored from host): logits bit-equal "
            f"{c['logits_bit_equal']}, {c['decode_steps']} greedy tokens equal "
            f"{c['greedy_tokens_equal']} -> {'ok' if c['ok'] else 'FAILED'}"
        )


def _plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        console.print("no plot: matplotlib is not installed (pip install matplotlib)")
        return
    from benchmarks.engine.plot import plot

    console.print(f"plot: {plot(result, path)}")
