"""Fills the measured figures of README.md and docs/*.md from the committed result files.

A figure is a block of markdown between two markers, written by a function of ``FIGURES`` from
files under ``benchmarks/results/``::

    <!-- figure:e2e_h100_final -->
    | mode | p50 | ...
    <!-- /figure:e2e_h100_final -->

``python benchmarks/figures.py`` rewrites every block in place; ``--check`` rewrites nothing and
exits 1 naming each block that no longer matches its files (``tests/test_figures.py`` runs it, so a
figure typed by hand, or a result file changed without its figure, fails the tests).
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(
    r"(<!-- figure:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figure:(?P=name) -->)", re.S
)

H100 = "nvidia-h100-80gb-hbm3"
FINAL = [f"e2e_llama3-8b_{H100}_2026-11-23_final{i}.json" for i in (1, 2)]
FINAL_QWEN = [f"e2e_qwen2.5-7b_{H100}_2026-11-23_final{i}.json" for i in (1, 2)]
NATIVE = [f"e2e_{m}_{H100}_2026-11-25_native.json" for m in ("llama3-8b", "qwen2.5-7b")]
COMMANDS = "readme_commands_cpu-amd-epyc_2026-11-25.json"
COSTS = {
    "fits: turns/s cost": "`fits` turns/s",
    "fits: p99 cost": "`fits` TTFT p99",
    "zero reuse: turns/s cost": "zero-reuse turns/s",
}
MODEL_NAMES = {"llama3-8b": "Llama-3-8B", "qwen2.5-7b": "Qwen2.5-7B"}


@cache
def result(name: str) -> dict[str, Any]:
    """A result file by its name; large ones are kept gzipped (``name.gz``)."""
    path = RESULTS / name
    if not path.exists() and (RESULTS / f"{name}.gz").exists():
        data: dict[str, Any] = json.loads(gzip.decompress((RESULTS / f"{name}.gz").read_bytes()))
    else:
        data = json.loads(path.read_text())
    return data


def _both(values: list[float], fmt: str = ".1f") -> str:
    return " / ".join(f"{v:{fmt}}" for v in values)


def _chat_modes(name: str) -> dict[str, Any]:
    modes: dict[str, Any] = result(name)["results"]["workloads"]["chat"]["modes"]
    return modes


def readme_e2e_h100() -> str:
    """The README's TTFT table of the two final H100 runs, and the ratios under it."""
    runs = [_chat_modes(f) for f in FINAL]
    labels = {
        "recompute": "recompute (no prefix cache)",
        "gpu": "gpu (the GPU prefix cache alone)",
        "gpu_all": "gpu_all (a GPU pool big enough for every history: the ideal)",
        "kvoffload": "**kvoffload** (GPU cache + host tier)",
    }
    lines = ["| mode | p50 | p90 | p99 | turns/s |", "|---|---|---|---|---|"]
    for mode, label in labels.items():
        cells = [_both([r[mode]["ttft_ms_returning"][q] for r in runs]) for q in ("p50", "p90")]
        cells.append(_both([r[mode]["ttft_ms_returning"]["p99"] for r in runs]))
        if mode == "kvoffload":
            cells = [f"**{c}**" for c in cells]
        cells.append(_both([r[mode]["turns_per_s"] for r in runs], ".2f"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    def ratio(num: str, den: str, q: str) -> str:
        vals = [r[num]["ttft_ms_returning"][q] / r[den]["ttft_ms_returning"][q] for r in runs]
        return " / ".join(f"{v:.1f}x" for v in vals)

    lines += [
        "",
        f"- Against recompute: {ratio('recompute', 'kvoffload', 'p50')} at p50, "
        f"{ratio('recompute', 'kvoffload', 'p99')} at p99. Against the GPU cache alone: "
        f"{ratio('gpu', 'kvoffload', 'p50')} at p50.",
    ]
    return "\n".join(lines)


def _span(values: list[float], fmt: str = ".1f") -> str:
    low, high = f"{min(values):{fmt}}", f"{max(values):{fmt}}"
    return low if low == high else f"{low}-{high}"


def readme_e2e_h100_notes() -> str:
    """The README's bullets under the table: the ideal, Qwen, fits, zero reuse, bit-exactness."""
    res = [result(f)["results"] for f in FINAL]
    qwen = [result(f)["results"]["workloads"]["chat"]["modes"] for f in FINAL_QWEN]
    target = [{t["name"]: t["value"] for t in r["targets"]} for r in res]
    overlap = [r["workloads"]["chat"]["modes"]["kvoffload"]["overlap"] for r in res]
    fits = [r["workloads"]["fits"]["modes"] for r in res]
    fits_gpu_hit = fits[0]["kvoffload"]["hit_ratio"]["gpu"]
    fits_run = res[0]["workloads"]["fits"]
    fits_load = fits_run["workload"]
    checks = [len(r["verify"]) for r in res] + [
        len(result(f)["results"]["verify"]) for f in FINAL_QWEN
    ]
    ok = all(c["ok"] for f in FINAL + FINAL_QWEN for c in result(f)["results"]["verify"])

    def q(mode: str) -> str:
        return _both([m[mode]["ttft_ms_returning"]["p50"] for m in qwen])

    p50s = [
        (m["recompute"]["ttft_ms_returning"]["p50"], m["kvoffload"]["ttft_ms_returning"]["p50"])
        for m in qwen
    ]
    qwen_ratio = " / ".join(f"{a / b:.1f}x" for a, b in p50s)
    return "\n".join(
        [
            "- Against the ideal: a turn restored from host took "
            + " / ".join(f"{t['chat: restored p50 / gpu_all']:.2f}x" for t in target)
            + " the TTFT of the same turn in `gpu_all` at p50. The load is restored layer by "
            f"layer under the prefill ({_span([100 * o['hidden_share'] for o in overlap], '.0f')}% "
            "of the load's time hidden; attention waited "
            f"{_span([o['median_per_request_ms']['exposed'] for o in overlap])} ms per request for "
            "it), but the prefill itself runs slower beside the copy; see "
            "[docs/e2e.md](docs/e2e.md).",
            f"- Qwen2.5-7B shapes with 32-token blocks, same workload: p50 {q('kvoffload')} ms "
            f"against `gpu_all` {q('gpu_all')} and recompute {q('recompute')} ({qwen_ratio}).",
            "- When the GPU cache is already enough (workload `fits`: "
            f"{fits_load['conversations']} conversations sharing a "
            f"{fits_load['system_tokens']}-token system prompt, {100 * fits_gpu_hit:.0f}% of "
            "prompt tokens GPU hits), "
            "kvoffload on changed turns/s by "
            + " / ".join(f"{-100 * t['fits: turns/s cost']:+.1f}%" for t in target)
            + " and TTFT p99 by "
            + " / ".join(f"{100 * t['fits: p99 cost']:+.1f}%" for t in target)
            + f" against `gpu` ({fits_run['rounds']} rounds, modes interleaved).",
            "- With no reuse at all (every prompt unique): "
            + " / ".join(f"{-100 * t['zero reuse: turns/s cost']:+.1f}%" for t in target)
            + " turns/s against `gpu`.",
            f"- Sampled restored turns ({' / '.join(map(str, checks))} per run, Llama then Qwen) "
            + ("were all" if ok else "were NOT all")
            + " bit-identical to the same turn computed on the GPU: the restored KV, the first "
            "token's logits and 16 greedy tokens.",
        ]
    )


def e2e_h100_final() -> str:
    """docs/e2e.md: the same runs with the hit ratios."""
    runs = [_chat_modes(f) for f in FINAL]
    lines = [
        "| mode | p50 | p90 | p99 | turns/s | GPU hit | host hit |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in ("recompute", "gpu", "gpu_all", "kvoffload"):
        t = [r[mode]["ttft_ms_returning"] for r in runs]
        cells = [_both([x[q] for x in t]) for q in ("p50", "p90", "p99")]
        if mode == "kvoffload":
            cells[:2] = [f"**{c}**" for c in cells[:2]]
        cells.append(_both([r[mode]["turns_per_s"] for r in runs], ".2f"))
        hits = runs[0][mode]["hit_ratio"]
        cells += [f"{100 * hits['gpu']:.0f}%", f"{100 * hits['host']:.0f}%"]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _judged(
    values: list[float | None], limit: float, at_most: bool, fmt: Callable[[float], str]
) -> str:
    """``a, b: reached`` when every run agrees, else ``a reached, b not``; ``-`` unmeasured."""
    shown = [v for v in values if v is not None]
    if not shown:
        return ""
    states = [(v <= limit) if at_most else (v >= limit) for v in shown]
    if all(states) or not any(states):
        return ", ".join(fmt(v) for v in shown) + (": reached" if states[0] else ": not reached")
    first = f"{fmt(shown[0])} {'reached' if states[0] else 'not'}"
    return first + "".join(
        f", {fmt(v)} {'reached' if ok else 'not'}"
        for v, ok in zip(shown[1:], states[1:], strict=True)
    )


def e2e_h100_final_targets() -> str:
    """docs/e2e.md: the targets of the two final runs per model, as the summary line judges them."""
    models = {"Llama-3-8B, 16-token blocks": FINAL, "Qwen2.5-7B, 32-token blocks": FINAL_QWEN}
    runs = {label: [result(f)["results"] for f in files] for label, files in models.items()}
    lines = [
        "| target (summary line) | " + " | ".join(models) + " |",
        "|---|" + "---|" * len(models),
    ]

    def ratio(v: float) -> str:
        return f"{v:.2f}x"

    def pct(v: float) -> str:
        return f"{100 * v:+.1f}%".replace("+-", "-")

    def target(r: dict[str, Any], name: str) -> Any:
        return next(t for t in r["targets"] if t["name"] == name)

    for name, label in (
        ("chat: restored p50 / gpu_all", "restored p50 / gpu_all (<= {limit:g}x)"),
        ("chat: restored p99 / gpu_all", "restored p99 / gpu_all (<= {limit:g}x)"),
        ("chat: recompute / kvoffload p50", "recompute / kvoffload p50 (>= {limit:g}x)"),
        ("chat: recompute / kvoffload p99", "recompute / kvoffload p99 (>= {limit:g}x)"),
    ):
        first = target(runs[next(iter(models))][0], name)
        cells = []
        for rs in runs.values():
            ts = [target(r, name) for r in rs]
            cells.append(_judged([t["value"] for t in ts], first["limit"], first["at_most"], ratio))
        lines.append(f"| {label.format(limit=first['limit'])} | " + " | ".join(cells) + " |")
    llama = runs[next(iter(models))]
    fits = [r["workloads"]["fits"]["modes"] for r in llama]
    for name, label, detail in (
        (
            "fits: turns/s cost",
            "`fits`: turns/s cost (<= {limit:.0f}%)",
            [
                f"gpu {m['gpu']['turns_per_s']:.2f}, kvoffload {m['kvoffload']['turns_per_s']:.2f}"
                for m in fits
            ],
        ),
        (
            "fits: p99 cost",
            "`fits`: p99 cost (<= {limit:.0f}%)",
            [
                f"{m['gpu']['ttft_ms']['p99']:.1f} vs {m['kvoffload']['ttft_ms']['p99']:.1f} ms"
                for m in fits
            ],
        ),
    ):
        ts = [target(r, name) for r in llama]
        values = [t["value"] for t in ts]
        states = _judged(values, ts[0]["limit"], ts[0]["at_most"], pct)
        shown = ", ".join(f"{pct(v)} ({d})" for v, d in zip(values, detail, strict=True))
        verdict = states[states.rfind(":") :]
        lines.append(f"| {label.format(limit=100 * ts[0]['limit'])} | {shown}{verdict} | |")
    ts = [target(r, "zero reuse: turns/s cost") for r in llama]
    store_all = [r["zero_reuse"]["overhead_turns_per_s"]["kvoffload_store_all"] for r in llama]
    zero = _judged([t["value"] for t in ts], ts[0]["limit"], ts[0]["at_most"], pct)
    lines.append(
        f"| zero reuse: turns/s cost (<= {100 * ts[0]['limit']:.0f}%) | {zero} (storing "
        f"everything: {', '.join(pct(v) for v in store_all)}) | |"
    )
    exact = []
    for rs in runs.values():
        exact.append(
            ", ".join(f"{sum(c['ok'] for c in r['verify'])}/{len(r['verify'])}" for r in rs)
        )
    lines.append("| bit-exact sampled turns | " + " | ".join(exact) + " |")
    return "\n".join(lines)


def e2e_h100_native() -> str:
    """The native engine's H100 runs: per model and workload, TTFT and the targets' ratios."""
    lines = [
        "| model, workload | recompute p50 / p99 | gpu_all p50 / p99 | kvoffload p50 / p99 | "
        "restored p50 / gpu_all | recompute / kvoffload p50, p99 | attention waited, load hidden |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in NATIVE:
        data = result(name)
        res = data["results"]
        target = {t["name"]: t["value"] for t in res["targets"]}
        for kind in ("chat", "docs"):
            modes = res["workloads"][kind]["modes"]
            ttft = [
                _both([modes[m]["ttft_ms_returning"][q] for q in ("p50", "p99")])
                for m in ("recompute", "gpu_all", "kvoffload")
            ]
            ov = modes["kvoffload"]["overlap"]
            lines.append(
                f"| {MODEL_NAMES[data['config']['model']]}, {kind} | "
                + " | ".join(ttft)
                + f" | {target[f'{kind}: restored p50 / gpu_all']:.2f}x"
                + f" | {target[f'{kind}: recompute / kvoffload p50']:.2f}x, "
                f"{target[f'{kind}: recompute / kvoffload p99']:.2f}x"
                + f" | {ov['median_per_request_ms']['exposed']:.1f} ms, "
                f"{100 * ov['hidden_share']:.0f}% |"
            )
    return "\n".join(lines)


def e2e_h100_native_checks() -> str:
    """The same runs' bit-exact checks and cost targets, one line."""
    parts, costs = [], []
    for name in NATIVE:
        data = result(name)
        model = MODEL_NAMES[data["config"]["model"]]
        target = {t["name"]: t for t in data["results"]["targets"]}
        exact = target["bit-exact sampled turns"]
        parts.append(f"{model} {exact['value']:.0f}/{exact['limit']:.0f}")
        for key, label in COSTS.items():
            if target[key]["value"] is not None:
                costs.append(f"{model} {label} {100 * target[key]['value']:+.1f}%")
    return (
        f"Bit-exact sampled turns (KV, first-token logits, 16 greedy tokens): {', '.join(parts)}. "
        f"Cost of kvoffload against `gpu` (negative: kvoffload faster): {', '.join(costs)}."
    )


TRANSFER_NATIVE = [f"transfer_{H100}_2026-11-25_native{i}.json" for i in (0, 1, 2)]
TRANSFER_METHODS = ("staged", "staged-python", "dma", "vllm-triton")
# (label, model, blocks per transfer, layout or None for every layout), block size 16
TRANSFER_CASES = [
    ("16 blocks of 2 MiB, store / load", "llama3-8b", 16, "page"),
    ("16 blocks fp8 TP8 (2 KiB pieces)", "llama3-70b-tp8-fp8", 16, "kv_split"),
    ("1,000 blocks fp8 TP8", "llama3-70b-tp8-fp8", 1000, "kv_split"),
    ("1,000 blocks MLA (K-only latent)", "deepseek-v2-lite-mla", 1000, None),
]


def _transfer_rows(method: str, model: str, blocks: int, layout: str | None) -> list[Any]:
    """(row, the run's link GB/s) of every run's rows of that case, block size 16."""
    out = []
    for name in TRANSFER_NATIVE:
        data = result(name)
        for row in data["rows"]:
            if (row["method"], row["model"], row["blocks"], row["block_size"]) == (
                method,
                model,
                blocks,
                16,
            ) and layout in (None, row["layout"]):
                out.append((row, data["link"]["GBps"]))
    return out


def transfer_h100_native() -> str:
    """The native engine against its Python path and vLLM's copies, three H100 runs: 1-block
    latency (p50 of store and of load), then GB/s as a share of the link measured in the same run
    (store: device to host, load: host to device), min-max over runs (and layouts)."""
    lines = [
        "| case | native engine | Python path | vLLM's `dma` | vLLM's Triton kernel |",
        "|---|---|---|---|---|",
    ]
    cells = []
    for method in TRANSFER_METHODS:
        rows = _transfer_rows(method, "llama3-8b", 1, "page")
        us = [r[k] for r, _ in rows for k in ("store_p50_us", "load_p50_us")]
        cells.append(f"{_span(us, '.0f')} µs")
    lines.append("| 1 block of 2 MiB (Llama-3-8B), p50 | " + " | ".join(cells) + " |")
    for label, model, blocks, layout in TRANSFER_CASES:
        cells = []
        for method in TRANSFER_METHODS:
            rows = _transfer_rows(method, model, blocks, layout)
            if not rows:
                cells.append("-")
                continue
            store = [r["store_GBps"] / link["d2h"]["median"] for r, link in rows]
            load = [r["load_GBps"] / link["h2d"]["median"] for r, link in rows]
            cells.append(f"{_span(store, '.2f')} / {_span(load, '.2f')}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


TRANSFER_FINAL = [f"transfer_{H100}_2026-11-23_final{i}.json" for i in (1, 2)]
SHAPES = {
    "llama3-8b": "Llama-3-8B (16-64 KiB pieces)",
    "qwen2.5-7b": "Qwen2.5-7B",
    "llama3-70b-tp8": "Llama-3-70B TP8, bf16",
    "llama3-70b-tp8-fp8": "Llama-3-70B TP8, fp8 (2-4 KiB pieces)",
    "deepseek-v2-lite-mla": "DeepSeek-V2-Lite MLA (K-only latent)",
}


def transfer_h100_link() -> str:
    """The link of the two final H100 runs, as the README's data-plane paragraph states it."""
    links = [result(f)["link"] for f in TRANSFER_FINAL]
    gib = links[0]["bytes"] / (1 << 30)
    n = links[0]["GBps"]["h2d"]["n"]

    def both(key: str) -> str:
        return _both([link["GBps"][key]["median"] for link in links])

    return (
        f"The link, {gib:g} GiB pinned copies after a warm-up, medians of {n}: {both('h2d')} GB/s "
        f"host-to-device, {both('d2h')} device-to-host, {both('both')} both at once."
    )


def transfer_h100_final() -> str:
    """``staged`` (Python path) in the two final H100 runs: share of the link measured in the same
    run, per shape; the median over layouts and block sizes of transfers of 256-2,048 blocks per
    run, and [the range over both runs]."""
    lines = ["| shape | store | load |", "|---|---|---|"]
    for model, label in SHAPES.items():
        cells = []
        for direction, link_key in (("store", "d2h"), ("load", "h2d")):
            medians, every = [], []
            for name in TRANSFER_FINAL:
                data = result(name)
                link = data["link"]["GBps"][link_key]["median"]
                shares = [
                    r[f"{direction}_GBps"] / link
                    for r in data["rows"]
                    if r["model"] == model
                    and r["method"] == "staged"
                    and 256 <= r["blocks"] <= 2048
                ]
                medians.append(statistics.median(shares))
                every += shares
            cells.append(f"{_both(medians, '.2f')} [{min(every):.2f}-{max(every):.2f}]")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def readme_cpu() -> str:
    """The README's CPU line: the host backend and the control plane on the CI machine type."""
    t, st = result("transfer_cpu_2026-11-22.json"), result("store_cpu_2026-11-22.json")
    gbps = [r[k] for r in t["rows"] for k in ("store_GBps", "load_GBps")]
    share = [100 * r[k] for r in t["rows"] for k in ("store_of_memcpy", "load_of_memcpy")]
    lookup = [r["lookup_2048_us"] / 2048 for r in st["rows"]]
    store = [r["store_512_us"] / 1e3 for r in st["rows"]]
    memory = [r["bytes_per_block"] for r in st["rows"]]
    return (
        f"CPU (`host` backend, the CI machine type, {t['date'][:10]}): {_span(gbps)} GB/s across "
        f"shapes and layouts, {_span(share, '.0f')}% of one contiguous 512 MiB memcpy "
        f"({t['memcpy_GBps']:.1f} GB/s) in the same run. Control plane (`kvoffload bench store`, "
        f"same CPU): a lookup costs {_span(lookup, '.2f')} µs per block at "
        f"{' and '.join(f'{r:,}' for r in sorted({r['resident'] for r in st['rows']}))} resident "
        f"blocks, storing 512 new blocks {_span(store)} ms, {_span(memory, '.0f')} bytes of "
        "Python memory per block (`benchmarks/results/transfer_cpu_2026-11-22.json`, "
        "`store_cpu_2026-11-22.json`)."
    )


def readme_commands() -> str:
    """The README's two commands as measured on the CI machine type (``COMMANDS``)."""
    m = result(COMMANDS)
    install, main, tests = m["install"], m["main_job"], m["tests"]
    runs = "; ".join(
        f"{r['wall_s']:.0f} s at a load average of {r['load_average']} (`{r['result']}`)"
        for r in main["runs"]
    )
    return (
        f"Measured {m['date']} on a {m['machine']['cores']}-core {m['machine']['cpu']} VM of this "
        f"project's CI type, in {m['how']} (`benchmarks/results/{COMMANDS}`); none of these is an "
        "idle-machine time:\n\n"
        f"- the install took {install['wall_s']:.0f} s ({install['what']}).\n"
        f"- the main job ({main['what']}; the model ran in {main['dtype']}: {main['note']}) took "
        f"{runs}.\n"
        f"- the test command collects {tests['collected']:,} tests ({tests['how']}); "
        f"{tests['modules_skipped_at_import']} of {tests['note']}"
    )


FIGURES: dict[str, Callable[[], str]] = {
    "readme_e2e_h100": readme_e2e_h100,
    "readme_e2e_h100_notes": readme_e2e_h100_notes,
    "e2e_h100_final": e2e_h100_final,
    "e2e_h100_final_targets": e2e_h100_final_targets,
    "e2e_h100_native": e2e_h100_native,
    "e2e_h100_native_checks": e2e_h100_native_checks,
    "readme_commands": readme_commands,
    "transfer_h100_native": transfer_h100_native,
    "transfer_h100_final": transfer_h100_final,
    "transfer_h100_link": transfer_h100_link,
    "readme_cpu": readme_cpu,
}


def fill(text: str) -> tuple[str, list[str]]:
    """``text`` with every figure block rewritten, and the names of those that changed."""
    changed: list[str] = []

    def one(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in FIGURES:
            raise ValueError(f"expected a figure in {sorted(FIGURES)}, got {name!r}")
        body = FIGURES[name]() + "\n"
        if body != match["body"]:
            changed.append(name)
        return match[1] + body + match[4]

    return BLOCK.sub(one, text), changed


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print("usage: python benchmarks/figures.py [--check]", file=sys.stderr)
        return 2
    stale = []
    for path in DOCS:
        text = path.read_text()
        new, changed = fill(text)
        rel = path.relative_to(ROOT)
        stale += [f"{rel}: figure {name}" for name in changed]
        if changed and not check:
            path.write_text(new)
            print(f"rewrote {rel}: {', '.join(changed)}")
    if check and stale:
        listed = "\n  ".join(stale)
        print(f"stale figures (python benchmarks/figures.py rewrites them):\n  {listed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
