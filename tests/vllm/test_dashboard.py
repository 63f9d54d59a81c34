"""``dashboards/kvoffload-vllm.json`` against vLLM: every metric it queries is one vLLM registers
when kvoffload runs inside it (declared by our spec with both of our lower tiers, or by vLLM's
offloading connector), and every query answers through a real Prometheus scraping vLLM's own
Prometheus metrics of a running engine simulator (tests/test_prometheus.py does the same for the
exporter's dashboard)."""

from __future__ import annotations

import functools
import http.server
import json
import math
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    get_connector_metric_definitions,
)

from kvoffload.integrations.vllm.spec import KVOffloadSpec
from tests.vllm.harness import NUM_LAYERS, PAGE_BYTES, VLLM_VERSION

CHUNK_BYTES = NUM_LAYERS * PAGE_BYTES

BOARD = Path(__file__).resolve().parents[2] / "dashboards" / "kvoffload-vllm.json"
PROMETHEUS_SUFFIXES = ("_total", "_bucket", "_sum", "_count")
ONLY_033 = {"vllm:kv_offload_tiering_promotion_latency_seconds"}  # absent from vLLM 0.32


def queried(board: dict[str, object]) -> set[str]:
    names = set()
    for panel in board["panels"]:  # type: ignore[attr-defined]
        for target in panel["targets"]:
            for name in re.findall(r"vllm:[a-z_]+", target["expr"]):
                for suffix in PROMETHEUS_SUFFIXES:
                    name = name.removesuffix(suffix)
                names.add(name)
    return names


def test_every_queried_metric_is_declared(tmp_path: Path) -> None:
    extra = {
        "cpu_bytes_to_use": 1 << 30,
        "disk_path": str(tmp_path / "disk"),
        "valkey_url": "redis://127.0.0.1:1/0",
        "model_id": "m",
    }
    declared = set(KVOffloadSpec.build_metric_definitions(extra))
    declared |= set(get_connector_metric_definitions())
    names = queried(json.loads(BOARD.read_text()))
    if VLLM_VERSION < (0, 33):
        names -= ONLY_033
    assert names, "no vllm: metric in the dashboard"
    assert sorted(names - declared) == []


# Queries that a healthy run of the workload below leaves empty, and why.
EMPTY_WHEN_HEALTHY = {
    # every promotion is served by the disk tier, listed first: Valkey is never read
    "histogram_quantile(0.5, sum by (le) (rate(vllm:kvoffload_valkey_read_seconds_bucket"
    '{model_name=~".*"}[10s])))',
    "histogram_quantile(0.99, sum by (le) (rate(vllm:kvoffload_valkey_read_seconds_bucket"
    '{model_name=~".*"}[10s])))',
}


class _Exporter:
    """``registry`` over HTTP on a free loopback port (what vLLM's /metrics serves)."""

    def __init__(self, registry: Any) -> None:
        import prometheus_client

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = prometheus_client.generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", prometheus_client.CONTENT_TYPE_LATEST)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                return

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_every_vllm_dashboard_query_answers_through_a_real_prometheus(tmp_path: Path) -> None:
    """kvoffload's spec with a disk and a Valkey tier in the engine simulator; its connector
    stats go through vLLM's own Prometheus metrics (``OffloadPromMetrics``, as vLLM's frontend
    records them) into a registry that a real Prometheus scrapes every second while prefixes are
    stored, evicted from host and promoted back. Every query of ``kvoffload-vllm.json`` must then
    return finite samples, but for those ``EMPTY_WHEN_HEALTHY`` names."""
    import prometheus_client
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics,
    )

    from tests.conftest import PROMETHEUS_SKIP
    from tests.prometheus_support import (
        load_builder,
        panel_queries,
        prometheus_binary,
        query,
        running_prometheus,
    )
    from tests.tiers_support import running_server
    from tests.vllm.test_tiers import OURS_SPEC, make_sim, prompt, store_then_evict_any

    if VLLM_VERSION < (0, 33):
        pytest.skip("run on vLLM 0.33 (.ci/vllm.sh); 0.32 has no promotion-latency metric")
    if prometheus_binary() is None:
        if os.environ.get("CI") == "1":
            pytest.fail(f"{PROMETHEUS_SKIP}; CI installs it (.ci/prometheus.sh)")
        pytest.skip(f"{PROMETHEUS_SKIP} (install it: bash .ci/prometheus.sh)")
    board = load_builder().dashboards()["kvoffload-vllm.json"]
    registry = prometheus_client.CollectorRegistry()
    kinds = {k: functools.partial(k, registry=registry) for k in (Counter, Gauge, Histogram)}
    with running_server() as server:
        extra = {
            "cpu_bytes_to_use": 8 * CHUNK_BYTES,
            "disk_path": str(tmp_path / "disk"),
            "valkey_url": server.url,
        }
        sim = make_sim(tmp_path, OURS_SPEC, extra)
        metrics = OffloadPromMetrics(sim.config, kinds, ["model_name", "engine"], {0: ["m", "0"]})
        exporter = _Exporter(registry)
        seen = 0
        try:
            with running_prometheus([exporter.target], tmp_path / "prometheus") as url:
                start, rounds = time.monotonic(), 0
                while time.monotonic() - start < 16 or rounds < 3:
                    p = store_then_evict_any(sim, 100 + 3000 * rounds)
                    sim.add(p)
                    sim.run()
                    for payload in sim.stats_payloads[seen:]:
                        metrics.observe(payload, 0)
                    seen = len(sim.stats_payloads)
                    rounds += 1
                time.sleep(2)  # the last round's increments scraped
                failures = []
                for title, expr, _legend in panel_queries(board):
                    samples = query(url, expr)["result"]
                    values = [float(s["value"][1]) for s in samples]
                    if expr in EMPTY_WHEN_HEALTHY:
                        continue
                    if not samples or not all(math.isfinite(v) for v in values):
                        failures.append(f"{title}: {values} for {expr}")
                assert not failures, "\n".join(failures)
        finally:
            exporter.close()
    assert rounds >= 3 and prompt(100)  # the workload ran
