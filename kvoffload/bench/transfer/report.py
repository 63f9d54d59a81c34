"""The printed summary of a ``kvoffload bench transfer`` GPU result (torch-free: it reads the
JSON-ready dict ``run_gpu`` returns, so it is tested on synthetic results)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from kvoffload.bench.transfer.targets import link_limit
from kvoffload.console import console


def print_gpu(result: dict[str, Any]) -> None:
    """Every section of ``result`` that the run measured, then the targets."""
    _link(result)
    _rows(result)
    for b in result.get("store_and_load", []):
        console.print(
            f"store+load at once {b['model']} {b['layout']} bs{b['block_size']} x{b['blocks']} "
            f"{b['method']}: {b['GBps']:.1f} GB/s"
        )
    if result.get("gemm"):
        g = result["gemm"]
        console.print(
            f"GEMM slowdown (baseline noise {g['baseline_noise']:.1%}): "
            + ", ".join(f"{m} {v:+.1%}" for m, v in g["slowdown"].items())
        )
    for m, st in (result.get("launch_stall") or {}).items():
        console.print(
            f"launch-bound Python thread, {m} transfers every step: {st['slowdown']:+.1%} per step "
            f"(noise {st['noise']:.1%}), host CPU {st['host_cpu_us_per_transfer']:.0f} us per "
            "transfer"
        )
    if "host_time" in result:
        print_host_time(result["host_time"])
    for m, p in (result.get("paths") or {}).items():
        why = f" ({p['path_reason']})" if p["path_reason"] else ""
        console.print(f"{m} ran its {p['path']} path{why}")
    for m, why in (result.get("method_notes") or {}).items():
        console.print(f"{m}: {why}")
    for f in result.get("failures", []):
        console.print(
            f"FAILED {f['method']} ({f['during']}, {f['model']} {f['layout']}): {f['error']}"
        )
    if result.get("skipped_cases"):
        console.print(f"skipped (time budget): {', '.join(result['skipped_cases'])}")
    if "binding_host_us" in result:
        console.print(f"binding host us: {result['binding_host_us']}")
    print_targets(result)


def _link(result: dict[str, Any]) -> None:
    for key, label in (("link", "start"), ("link_after", "end")):
        if key in result:
            console.print(
                f"link at the {label} (1 GiB, median [min-max] of {result[key]['GBps']['h2d']['n']}"
                "): "
                + ", ".join(
                    f"{k} {v['median']:.1f} [{v['min']:.1f}-{v['max']:.1f}]"
                    for k, v in result[key]["GBps"].items()
                )
            )


def _rows(result: dict[str, Any]) -> None:
    table = Table(
        title=f"GPU transfers on {result['device']}: share of the link, copies alone / end to "
        "end; p50 / p99 us of transfers of <= 16 blocks"
    )
    cols = ("model", "layout", "bs", "blocks", "piece", "slot", "method", "store", "load")
    for col in (*cols, "store us", "load us"):
        table.add_column(col, justify="left" if col in ("model", "layout", "method") else "right")
    limit = link_limit(result)
    d2h, h2d = limit["d2h"], limit["h2d"]
    for r in result["rows"]:
        lat = ["", ""]
        if "store_p50_us" in r and r["blocks"] <= 16:
            lat = [f"{r[f'{d}_p50_us']:.0f} / {r[f'{d}_p99_us']:.0f}" for d in ("store", "load")]
        table.add_row(
            r["model"],
            r["layout"],
            str(r["block_size"]),
            str(r["blocks"]),
            f"{r['piece_bytes'] / 1024:g} KiB",
            f"{r['slot_bytes'] // 1024} KiB",
            r["method"],
            f"{r['store_gpu_GBps'] / d2h:.0%} / {r['store_GBps'] / d2h:.0%}",
            f"{r['load_gpu_GBps'] / h2d:.0%} / {r['load_GBps'] / h2d:.0%}",
            *lat,
        )
    console.print(table)


def print_host_time(host: dict[str, Any]) -> None:
    """The host section's ``table`` (rows of dicts or of cells), or why it was skipped."""
    if "skipped" in host:
        console.print(f"host time: {host['skipped']}")
        return
    rows = host.get("table") or []
    if not rows:
        console.print("host time: no table in the result")
        return
    table = Table(title="host time: GIL held per submit, eager engine step beside transfers")
    if isinstance(rows[0], dict):
        cols = list(dict.fromkeys(k for r in rows for k in r))
        cells = [[r.get(c, "") for c in cols] for r in rows]
    else:
        cols, cells = [str(c) for c in rows[0]], [list(r) for r in rows[1:]]
    for col in cols:
        table.add_column(str(col))
    for r in cells:
        table.add_row(*(f"{c:.3g}" if isinstance(c, float) else str(c) for c in r))
    console.print(table)


def print_targets(result: dict[str, Any]) -> None:
    table = Table(title=f"issue 21's targets (bench transfer, {result.get('wall_s', 0):.0f} s)")
    for col in ("line", "target", "measured", "reached", "the machine allowed"):
        table.add_column(col)
    for t in result.get("targets", []):
        mark = {True: "yes", False: "NO", None: "-"}[t["reached"]]
        table.add_row(t["line"], t["target"], t["measured"], mark, t["allowed"] or "")
    console.print(table)
