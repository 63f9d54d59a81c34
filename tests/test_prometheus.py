"""The Grafana dashboards against a real Prometheus (``tests/prometheus_support.py``).

A Prometheus from the OS packages scrapes kvoffload's exporter every second while a CPU workload
runs; every query of every panel of ``dashboards/kvoffload.json`` is then evaluated through
Prometheus' HTTP API and must return an instant vector with at least one finite sample carrying
the labels its legend names. Without ``prometheus`` on PATH the test skips (counted in the
summary line; ``bash .ci/prometheus.sh`` installs it; CI=1 makes the skip a failure, as ``.ci/run``
installs it).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest

from tests.conftest import PROMETHEUS_SKIP
from tests.prometheus_support import (
    DASHBOARDS,
    SCRAPE_S,
    Workload,
    legend_labels,
    load_builder,
    panel_queries,
    prometheus_binary,
    query,
    running_prometheus,
)

WARMUP_S = 12  # scrapes before the queries: more than one rate window (RATE_WINDOW, 10 s)


def test_committed_dashboards_are_what_build_py_writes():
    builder = load_builder()
    for name, board in builder.dashboards().items():
        committed = (DASHBOARDS / name).read_text()
        assert committed == builder.render(board), f"run python dashboards/build.py ({name})"
        assert json.loads(committed)["panels"], name


def test_every_dashboard_query_answers_through_a_real_prometheus(tmp_path: Path):
    if prometheus_binary() is None:
        if os.environ.get("CI") == "1":
            pytest.fail(f"{PROMETHEUS_SKIP}; CI installs it (.ci/prometheus.sh)")
        pytest.skip(f"{PROMETHEUS_SKIP} (install it: bash .ci/prometheus.sh)")
    board = load_builder().dashboards()["kvoffload.json"]
    work = Workload(tmp_path / "disk")
    try:
        with running_prometheus([work.target], tmp_path / "prometheus") as url:
            work.start()
            deadline = time.monotonic() + WARMUP_S + 30
            while time.monotonic() < deadline:  # enough scrapes of a target that answers
                up = query(url, f"count_over_time(up[{WARMUP_S}s])")["result"]
                # every second's scrape, but for a late one or two
                if up and float(up[0]["value"][1]) >= WARMUP_S / SCRAPE_S - 2:
                    break
                time.sleep(1)
            assert float(query(url, "min(up)")["result"][0]["value"][1]) == 1
            failures = []
            queries = panel_queries(board)
            for title, expr, legend in queries:
                data = query(url, expr)
                samples = data["result"]
                values = [float(s["value"][1]) for s in samples]
                labels = legend_labels(legend)
                if data["resultType"] != "vector" or not samples:
                    failures.append(f"{title}: no data ({data['resultType']}) for {expr}")
                elif not all(math.isfinite(v) for v in values):
                    failures.append(f"{title}: non-finite {values} for {expr}")
                elif any(not labels <= set(s["metric"]) for s in samples):
                    failures.append(f"{title}: a series lacks {labels} for {expr}")
            assert not failures, "\n".join(failures)
            assert len(queries) >= len(board["panels"])
    finally:
        work.stop()
    assert work.rounds > 10  # the workload ran all along
