"""The options of ``kvoffload bench e2e`` and the run they build: the workload shapes per model
scale, ``add_arguments`` (the command's arguments) and ``build_config`` (a ``BenchConfig`` from
them; ``_workload_run`` builds one workload's run, as ``runner/variants.py`` also does). Imports
no torch: the runner's modules are imported inside the functions that build the config.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvoffload.bench.e2e.runner.config import GPU_MODELS
from kvoffload.store.policies import MAX_WINDOW

WORKLOADS = ("chat", "fits", "docs", "mixed")
MODES = ("recompute", "gpu", "gpu_all", "kvoffload")  # the default
# gpu_all_copy (opt-in): gpu_all with the bytes of kvoffload's restore copied beside its forward
ALL_MODES = ("recompute", "gpu", "gpu_all", "gpu_all_copy", "kvoffload")
GRAPHS = ("eager", "piecewise", "full")  # kvoffload.bench.e2e.runner.graphs.GRAPHS, without torch
CHAT_KNOBS = ("conversations", "turns", "system_tokens", "user_tokens", "answer_tokens")
DOC_KNOBS = (
    "documents",
    "document_tokens",
    "requests",
    "system_tokens",
    "question_tokens",
    "answer_tokens",
)

# Workload shapes per model scale. chat: the GPU pool holds a quarter of all histories (each
# counted with its own copy of the system prompt), so a conversation's history is evicted before
# it returns. fits: a long shared system prompt and many short conversations, all of it in the
# GPU pool twice over. docs: a quarter of the documents fit the pool. mixed: chat with a quarter
# of the requests unique prompts. The host tier holds 1.25x the same count.


def _chat(*values: int) -> dict[str, int]:
    return dict(zip(CHAT_KNOBS, values, strict=True))


def _docs(*values: int) -> dict[str, int]:
    return dict(zip(DOC_KNOBS, values, strict=True))


_GPU = {  # conversations, turns, system, user, answer; documents, tokens, requests, system, ...
    "chat": _chat(16, 8, 2048, 512, 256),
    "fits": _chat(32, 4, 4096, 64, 128),
    "docs": _docs(32, 4096, 128, 256, 128, 128),
}
_TINY = {
    "chat": _chat(8, 8, 256, 64, 64),
    "fits": _chat(16, 4, 512, 16, 32),
    "docs": _docs(16, 512, 64, 64, 32, 32),
}
_MICRO = {
    "chat": _chat(4, 3, 32, 32, 16),
    "fits": _chat(6, 3, 64, 16, 16),
    "docs": _docs(6, 64, 12, 16, 16, 16),
}
SHAPES = {**dict.fromkeys(GPU_MODELS, _GPU), "tiny": _TINY, "micro": _MICRO}
CHUNK = {**dict.fromkeys(GPU_MODELS, 2048), "tiny": 512, "micro": 64}
UNIQUE_SHARE = 0.25  # mixed: the share of unique prompts
FITS_ROUNDS = 3  # fits compares gpu and kvoffload to 1%: several rounds, alternating
FITS_POOL = 2.0  # fits: the GPU pool holds this many times the workload's distinct blocks
OVERFLOW_POOL = 0.25  # chat, docs, mixed: the pool holds this share of all histories
HOST_SHARE = 1.25  # the host tier holds this many times the same count


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="auto",
        choices=("auto", *SHAPES),
        help="model shapes (auto: llama3-8b on a GPU, tiny on a CPU)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32"),
        help="compute and KV dtype (auto: bfloat16 on a GPU and on CPUs with bf16 arithmetic, "
        "else float32)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU: torch threads (default: cores - 1, leaving one to kvoffload's copy thread)",
    )
    w = p.add_argument_group("workloads (shape defaults depend on --model and the workload)")
    w.add_argument(
        "--workloads",
        default="chat",
        help=f"comma-separated, from {','.join(WORKLOADS)}: multi-turn chat; chat that fits the "
        "GPU pool; a shared-document pool; chat mixed with unique prompts",
    )
    w.add_argument(
        "--conversations",
        type=int,
        default=None,
        help="chat: clients, interleaved" + _preset("conversations"),
    )
    w.add_argument(
        "--turns", type=int, default=None, help="chat: turns per conversation" + _preset("turns")
    )
    w.add_argument(
        "--system-tokens",
        type=int,
        default=None,
        help="shared system prompt" + _preset("system_tokens"),
    )
    w.add_argument(
        "--user-tokens",
        type=int,
        default=None,
        help="chat: tokens per user turn" + _preset("user_tokens"),
    )
    w.add_argument(
        "--answer-tokens",
        type=int,
        default=None,
        help="tokens per answer" + _preset("answer_tokens"),
    )
    w.add_argument(
        "--documents",
        type=int,
        default=None,
        help="docs: documents in the pool" + _preset("documents"),
    )
    w.add_argument(
        "--document-tokens",
        type=int,
        default=None,
        help="docs: tokens per document" + _preset("document_tokens"),
    )
    w.add_argument(
        "--requests", type=int, default=None, help="docs: requests" + _preset("requests")
    )
    w.add_argument(
        "--question-tokens",
        type=int,
        default=None,
        help="docs: tokens per question" + _preset("question_tokens"),
    )
    w.add_argument(
        "--unique-share", type=float, default=UNIQUE_SHARE, help="mixed: share of unique prompts"
    )
    e = p.add_argument_group("engine")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    e.add_argument("--chunk-tokens", type=int, default=None, help="prefill chunk (tokens)")
    e.add_argument(
        "--gpu-blocks",
        type=int,
        default=None,
        help="GPU pool capacity (default: a quarter of all histories; fits: twice its blocks)",
    )
    e.add_argument(
        "--host-blocks",
        type=int,
        default=None,
        help="kvoffload host capacity (default: 1.25x all histories; fits: 1.25x its blocks)",
    )
    k = p.add_argument_group("kvoffload")
    k.add_argument(
        "--backend",
        default="auto",
        help="copy backend (auto: the planner's choice); staged-FLAG-...: the native engine with "
        "variants.py's settings, e.g. staged-lp64 (64 scatter programs per load)",
    )
    k.add_argument(
        "--admission",
        default="reuse",
        choices=("reuse", "all", "none"),
        help="which requests' blocks go to host: those that reused a prefix, all, or none",
    )
    k.add_argument(
        "--store",
        default="evict",
        choices=("evict", "behind"),
        help="when: shortly before the GPU pool would evict them, or right after compute",
    )
    k.add_argument(
        "--store-lead",
        type=float,
        default=2.0,
        help="evict: store blocks this many times the largest request's blocks ahead of eviction",
    )
    k.add_argument(
        "--load",
        default="layered",
        choices=("layered", "blocking"),
        help="restore layer by layer under prefill, or wait for the whole load first",
    )
    k.add_argument(
        "--store-handover",
        default="background",
        choices=("background", "inline"),
        help="evict: the stores handed over after a forward's launch, before its token is read: "
        "enqueued by kvoffload's thread while the engine waits (TransferWorker.step(jobs, "
        "background=True)) or by the engine's thread inside the call",
    )
    k.add_argument(
        "--eviction-window",
        type=int,
        default=1,
        help="OffloadConfig.eviction_window of the host tier: a store that must evict n blocks "
        "picks them among the policy's first n x this many by runs of host slots, the oldest "
        "first (1: the policy's exact order)",
    )
    k.add_argument(
        "--load-handover",
        default="inline",
        choices=("inline", "background"),
        help="layered: a restore's load handed over before the forward's launch: its copies "
        "enqueued by the engine's thread inside the call, or by kvoffload's thread while the "
        "engine launches (a layer's wait waits on the host for that layer's slice)",
    )
    k.add_argument(
        "--untimed-waits",
        action="store_true",
        help="diagnostic: the per-layer waits without their CUDA-event timing (two events per "
        "layer; full graphs are captured without them), so neither the launch phase nor a full "
        "graph's replay carries the benchmark's own cost; the GPU wait per layer is then not "
        "measured (load_exposed_ms reads the whole load)",
    )
    r = p.add_argument_group("run")
    r.add_argument(
        "--graph",
        default="eager",
        help=f"comma-separated engine graph modes, each a whole run, from {','.join(GRAPHS)}: "
        "eager launches; piecewise: dense parts as CUDA graphs, attention and waits eager; "
        "full: one graph per forward, restore waits inside (CUDA only)",
    )
    r.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated, from {','.join(ALL_MODES)} (default: {','.join(MODES)}; fits: "
        "gpu,kvoffload); gpu_all_copy: gpu_all with a plain copy of each kvoffload restore's bytes "
        "beside its forward (the machine's share of a restore's cost; needs kvoffload)",
    )
    r.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"runs of each workload per mode, alternating (default: 1; fits: {FITS_ROUNDS})",
    )
    r.add_argument(
        "--zero-reuse-rounds", type=int, default=2, help="gpu/kvoffload rounds on unique prompts"
    )
    r.add_argument(
        "--zero-reuse-turns",
        type=int,
        default=None,
        help="requests per round (default: the first workload's conversations, docs: 16)",
    )
    r.add_argument("--verify", type=int, default=2, help="sampled turns checked bit for bit")
    r.add_argument(
        "--profile",
        type=int,
        default=0,
        help="trace the last N requests of each workload in gpu_all and kvoffload (CUDA): "
        "device time per kernel, kvoffload's copies beside the model's (for attribution: "
        "tracing slows those requests)",
    )
    r.add_argument(
        "--driver-times",
        action="store_true",
        help="time the native core's CUDA driver calls in the engine's thread "
        "(KVOFFLOAD_DRIVER_TIMES=1): each kvoffload call's driver share as driver:<call> in "
        "kvo_ms (for attribution: the timing adds ~2 us to each call)",
    )
    r.add_argument("--seed", type=int, default=0, help="seed of the workloads and the weights")
    r.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path, the PNG next to it (default: a new file in ./kvoffload-results/)",
    )
    r.add_argument("--no-plot", action="store_true", help="skip the PNG")
    from kvoffload.bench.e2e.runner.lower_tiers_args import add_arguments as lower_tier_arguments

    lower_tier_arguments(p)


def _preset(knob: str) -> str:
    """``(default: ...)`` for a workload knob: its value per workload, GPU models and tiny."""
    parts = []
    for scale, shapes in (("GPU models", _GPU), ("tiny", _TINY)):
        values = [f"{kind} {shape[knob]}" for kind, shape in shapes.items() if knob in shape]
        parts.append(f"{', '.join(values)} ({scale})")
    return f" (default: {'; '.join(parts)})"


def _list(text: str, allowed: tuple[str, ...], option: str) -> tuple[str, ...]:
    names = tuple(n for n in text.split(",") if n)
    bad = [n for n in names if n not in allowed]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(
            f"{option}: expected distinct names from {','.join(allowed)}, got {text!r}"
        )
    return names


def build_config(args: argparse.Namespace, cuda: bool, dtype: str) -> Any:
    from kvoffload.bench.e2e.runner.bench_config import BenchConfig
    from kvoffload.bench.e2e.runner.offload_mode import Offload

    model = args.model if args.model != "auto" else ("llama3-8b" if cuda else "tiny")
    try:
        if args.backend.startswith("staged-"):  # the native engine with variant flags
            from kvoffload.bench.e2e.runner.core_flags import configured

            configured("staged", args.backend.split("-")[1:])
        if args.block_size <= 0:
            raise ValueError(f"expected --block-size > 0, got {args.block_size}")
        if not 1 <= args.eviction_window <= MAX_WINDOW:
            raise ValueError(
                f"expected --eviction-window of 1 to {MAX_WINDOW}, got {args.eviction_window}"
            )
        runs = tuple(
            _workload_run(args, model, kind)
            for kind in _list(args.workloads, WORKLOADS, "--workloads")
        )
        return BenchConfig(
            model=model,
            device=args.device if args.device != "auto" else ("cuda" if cuda else "cpu"),
            workloads=runs,
            dtype=dtype,
            block_size=args.block_size,
            chunk_tokens=args.chunk_tokens or CHUNK[model],
            offload=Offload(
                admission=args.admission,
                store=args.store,
                store_lead=args.store_lead,
                load=args.load,
                time_waits=not args.untimed_waits,
                store_handover=args.store_handover,
                load_handover=args.load_handover,
            ),
            backend=args.backend,
            eviction_window=args.eviction_window,
            zero_reuse_rounds=args.zero_reuse_rounds,
            zero_reuse_turns=_zero_reuse_turns(args, runs[0].workload),
            verify=args.verify,
            seed=args.seed,
            graphs=_list(args.graph, GRAPHS, "--graph"),
            profile=args.profile,
        )
    except ValueError as err:
        raise SystemExit(f"kvoffload bench e2e: {err}") from None


def _zero_reuse_turns(args: argparse.Namespace, first: Any) -> int:
    if args.zero_reuse_turns is not None:
        return int(args.zero_reuse_turns)
    return first.chat.conversations if first.chat is not None else 16


def _workload_run(args: argparse.Namespace, model: str, kind: str) -> Any:
    from kvoffload.bench.e2e.runner.bench_config import WorkloadRun
    from kvoffload.bench.e2e.runner.workload import ChatShape, DocShape, Workload

    shape = SHAPES[model]["docs" if kind == "docs" else ("fits" if kind == "fits" else "chat")]

    def knob(name: str) -> int:
        value = getattr(args, name)
        return int(shape[name] if value is None else value)

    if kind == "docs":
        workload = Workload(kind, docs=DocShape(*(knob(n) for n in DOC_KNOBS)))
    else:
        share = args.unique_share if kind == "mixed" else 0.0
        workload = Workload(
            kind, chat=ChatShape(*(knob(n) for n in CHAT_KNOBS)), unique_share=share
        )
    bs = args.block_size
    distinct = workload.distinct_blocks(bs)
    floor = 2 * workload.longest_request_blocks(bs)
    if kind == "fits":
        pool, host = int(FITS_POOL * distinct), int(HOST_SHARE * distinct)
    else:
        history = workload.history_blocks(bs)
        pool, host = int(OVERFLOW_POOL * history), int(HOST_SHARE * history)
    modes = ("gpu", "kvoffload") if kind == "fits" else MODES
    return WorkloadRun(
        workload,
        _list(args.modes, ALL_MODES, "--modes") if args.modes else modes,
        args.rounds if args.rounds is not None else (FITS_ROUNDS if kind == "fits" else 1),
        args.gpu_blocks if args.gpu_blocks is not None else max(pool, floor),
        args.host_blocks if args.host_blocks is not None else host,
    )
