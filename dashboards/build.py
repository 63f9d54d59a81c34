"""Writes the two Grafana dashboards of this folder from one list of panels per metric form.

``kvoffload.json``: the metrics of kvoffload's own exporter (``LocalOffload.serve_metrics``,
``kvoffload_*``). ``kvoffload-vllm.json``: kvoffload inside vLLM (``vllm:kvoffload_*`` beside
vLLM's own ``vllm:kv_offload_*``). ``python dashboards/build.py`` rewrites both;
``tests/test_prometheus.py`` evaluates every query of the first through a real Prometheus and
checks the committed files equal what this script writes. Importing: docs/operations.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RATE = "$__rate_interval"
SEL = 'instance=~"$instance"'


def q(expr: str, legend: str) -> dict[str, str]:
    return {"expr": expr, "legend": legend}


def quantiles(metric: str, by: str, sel: str = SEL) -> list[dict[str, str]]:
    """p50 and p99 of a histogram, per ``by`` label (empty: one series)."""
    labels = f"le, {by}" if by else "le"
    out = []
    for p in ("0.5", "0.99"):
        rate = f"rate({metric}_bucket{{{sel}}}[{RATE}])"
        expr = f"histogram_quantile({p}, sum by ({labels}) ({rate}))"
        legend = f"p{round(float(p) * 100)}" + (f" {{{{{by}}}}}" if by else "")
        out.append(q(expr, legend))
    return out


# (title, unit, queries). Units are Grafana's: percentunit, decbytes, Bps, s, short.
OURS: list[tuple[str, str, list[dict[str, str]]]] = [
    (
        "Hit ratio per tier (blocks found / asked)",
        "percentunit",
        [
            q(
                f"sum by (tier) (rate(kvoffload_hit_blocks_total{{{SEL}}}[{RATE}])) / "
                f"(sum by (tier) (rate(kvoffload_hit_blocks_total{{{SEL}}}[{RATE}])) + "
                f"sum by (tier) (rate(kvoffload_miss_blocks_total{{{SEL}}}[{RATE}])))",
                "{{tier}}",
            )
        ],
    ),
    (
        "Bytes per second per direction",
        "Bps",
        [
            q(
                f"sum by (direction) (rate(kvoffload_transfer_bytes_total{{{SEL}}}[{RATE}]))",
                "{{direction}}",
            )
        ],
    ),
    (
        "Copy GB/s while copying (bytes / job seconds)",
        "short",
        [
            q(
                f"sum by (direction) (rate(kvoffload_transfer_bytes_total{{{SEL}}}[{RATE}])) / "
                f"sum by (direction) (rate(kvoffload_transfer_seconds_total{{{SEL}}}[{RATE}])) "
                "/ 1e9",
                "{{direction}}",
            )
        ],
    ),
    (
        "Transfer latency (submit to completion)",
        "s",
        quantiles("kvoffload_transfer_duration_seconds", "direction"),
    ),
    ("Layer wait (wait_on per layer)", "s", quantiles("kvoffload_layer_wait_seconds", "")),
    ("Lower-tier read latency (per op)", "s", quantiles("kvoffload_tier_read_seconds", "tier")),
    (
        "Jobs failed, cancelled, timed out (per second)",
        "short",
        [
            q(
                f"sum by (direction, outcome) "
                f'(rate(kvoffload_transfer_jobs_total{{{SEL}, outcome!="ok"}}[{RATE}]))',
                "{{direction}} {{outcome}}",
            )
        ],
    ),
    (
        "Host slots by state",
        "short",
        [
            q(f"sum by (state) (kvoffload_host_slots{{{SEL}}})", "{{state}}"),
            q(f"sum(kvoffload_pinned_slots{{{SEL}}})", "pinned (readable, being read)"),
        ],
    ),
    (
        "Lower tiers: up (1) or down (0)",
        "short",
        [q(f"min by (tier) (kvoffload_tier_up{{{SEL}}})", "{{tier}}")],
    ),
    (
        "Lower tiers: errors, corrupt reads, failed writes, reconnects (per second)",
        "short",
        [
            q(
                f"sum by (tier, counter) (rate(kvoffload_tier_total{{{SEL}, "
                f'counter=~"errors|corrupt|put_failures|reconnects"}}[{RATE}]))',
                "{{tier}} {{counter}}",
            )
        ],
    ),
    (
        "Prefill tokens saved (per second)",
        "short",
        [
            q(
                f"sum(rate(kvoffload_prefill_tokens_saved_total{{{SEL}}}[{RATE}]))",
                "tokens loaded, not recomputed",
            )
        ],
    ),
    (
        "Jobs running, in flight, late loads",
        "short",
        [
            q(f"sum(kvoffload_queue_depth{{{SEL}}})", "running in the worker"),
            q(f"sum(kvoffload_jobs_in_flight{{{SEL}}})", "handed out, not completed"),
            q(f"sum(kvoffload_late_loads{{{SEL}}})", "timed out, copy not ended"),
        ],
    ),
]

VSEL = 'model_name=~"$model_name"'
VLLM: list[tuple[str, str, list[dict[str, str]]]] = [
    (
        "Hit ratio per tier (chunks found / asked; vLLM's tiering counters)",
        "percentunit",
        [
            q(
                f"sum by (tier) (rate(vllm:kv_offload_tiering_chunk_hits_total{{{VSEL}}}[{RATE}])) "
                f"/ sum by (tier) "
                f"(rate(vllm:kv_offload_tiering_chunk_queries_total{{{VSEL}}}[{RATE}]))",
                "{{tier}}",
            )
        ],
    ),
    (
        "Bytes per second, GPU to and from host",
        "Bps",
        [
            q(f"sum(rate(vllm:kv_offload_load_bytes_total{{{VSEL}}}[{RATE}]))", "load"),
            q(f"sum(rate(vllm:kv_offload_store_bytes_total{{{VSEL}}}[{RATE}]))", "store"),
        ],
    ),
    (
        "Copy GB/s while copying (bytes / transfer seconds)",
        "short",
        [
            q(
                f"sum(rate(vllm:kv_offload_load_bytes_total{{{VSEL}}}[{RATE}])) / "
                f"sum(rate(vllm:kv_offload_load_time_total{{{VSEL}}}[{RATE}])) / 1e9",
                "load",
            ),
            q(
                f"sum(rate(vllm:kv_offload_store_bytes_total{{{VSEL}}}[{RATE}])) / "
                f"sum(rate(vllm:kv_offload_store_time_total{{{VSEL}}}[{RATE}])) / 1e9",
                "store",
            ),
        ],
    ),
    (
        "Lower-tier read latency (per op of up to 16 chunks)",
        "s",
        quantiles("vllm:kvoffload_disk_read_seconds", "", VSEL)
        + quantiles("vllm:kvoffload_valkey_read_seconds", "", VSEL),
    ),
    (
        "Promotion latency (vLLM's tiering)",
        "s",
        quantiles("vllm:kv_offload_tiering_promotion_latency_seconds", "tier", VSEL),
    ),
    (
        "Host tier: usage and failed chunks",
        "short",
        [
            q(f"max(vllm:kvoffload_host_usage_perc{{{VSEL}}})", "host usage (0-1)"),
            q(
                f"sum(rate(vllm:kvoffload_host_store_failed_chunks_total{{{VSEL}}}[{RATE}]))",
                "store failed (per second)",
            ),
            q(
                f"sum(rate(vllm:kvoffload_host_load_failed_chunks_total{{{VSEL}}}[{RATE}]))",
                "load failed (per second)",
            ),
        ],
    ),
    (
        "Lower tiers: Valkey up, errors, corrupt reads, reconnects",
        "short",
        [
            q(f"min(vllm:kvoffload_valkey_up{{{VSEL}}})", "valkey up (1) / down (0)"),
            q(
                f"sum(rate(vllm:kvoffload_disk_errors_total{{{VSEL}}}[{RATE}])) + "
                f"sum(rate(vllm:kvoffload_disk_corrupt_total{{{VSEL}}}[{RATE}]))",
                "disk errors + corrupt (per second)",
            ),
            q(
                f"sum(rate(vllm:kvoffload_valkey_errors_total{{{VSEL}}}[{RATE}])) + "
                f"sum(rate(vllm:kvoffload_valkey_corrupt_total{{{VSEL}}}[{RATE}]))",
                "valkey errors + corrupt (per second)",
            ),
            q(
                f"sum(increase(vllm:kvoffload_valkey_reconnects_total{{{VSEL}}}[{RATE}]))",
                "valkey reconnects",
            ),
        ],
    ),
]


def dashboard(
    title: str, uid: str, panels: list[tuple[str, str, list[dict[str, str]]]], var: str, of: str
) -> dict[str, Any]:
    out = []
    for i, (name, unit, queries) in enumerate(panels):
        targets = [
            {
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "expr": t["expr"],
                "legendFormat": t["legend"],
                "refId": chr(ord("A") + j),
            }
            for j, t in enumerate(queries)
        ]
        out.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": name,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": targets,
            }
        )
    variables = [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
        {
            "name": var,
            "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": f"label_values({of}, {var})",
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
            "current": {"text": "All", "value": "$__all"},
            "refresh": 2,
        },
    ]
    return {
        "title": title,
        "uid": uid,
        "tags": ["kvoffload"],
        "schemaVersion": 39,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {"list": variables},
        "panels": out,
    }


def dashboards() -> dict[str, dict[str, Any]]:
    return {
        "kvoffload.json": dashboard(
            "kvoffload", "kvoffload", OURS, "instance", "kvoffload_host_slots"
        ),
        "kvoffload-vllm.json": dashboard(
            "kvoffload in vLLM",
            "kvoffload-vllm",
            VLLM,
            "model_name",
            "vllm:kv_offload_tiering_chunk_queries_total",
        ),
    }


def render(board: dict[str, Any]) -> str:
    return json.dumps(board, indent=2) + "\n"


def main() -> int:
    for name, board in dashboards().items():
        (HERE / name).write_text(render(board))
        print(f"wrote dashboards/{name}: {len(board['panels'])} panels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
