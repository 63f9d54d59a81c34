"""Prometheus metrics of the engine-neutral API: scraped over HTTP, values checked."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvoffload import KVLayout, OffloadConfig, build_local, prefix_block_keys
from kvoffload.metrics import METRICS, PREFIX

BS = 16


def test_importing_kvoffload_never_imports_prometheus():
    code = "import sys, kvoffload, kvoffload.metrics; print('prometheus_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_metrics_and_the_local_offload_import_each_other_one_way():
    """metrics.py and offload/local.py imported each other (type-only on one side): a reader had
    to hold both files at once. Now local imports metrics, and metrics neither local nor anything
    that imports it (at run time or for types)."""
    import ast

    import kvoffload.metrics as metrics
    import kvoffload.offload.local as local

    def imported(module: object) -> set[str]:
        tree = ast.parse(Path(str(getattr(module, "__file__", ""))).read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    assert "kvoffload.metrics" in imported(local)
    assert not {"kvoffload.offload.local", "kvoffload.offload", "kvoffload"} & imported(metrics)


def test_without_prometheus_client_the_call_names_the_extra(monkeypatch):
    kv = [np.zeros((8, BS, 4), np.float32)]
    local = build_local(KVLayout.from_tensors(kv, BS), OffloadConfig(host_capacity_blocks=2))
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    try:
        hint = r"pip install prometheus-client .*pip install -e '\.\[metrics\]'"
        with pytest.raises(ImportError, match=hint):
            local.serve_metrics(0)
    finally:
        local.close()


def test_every_metric_is_documented():
    doc = (Path(__file__).parents[1] / "docs" / "api.md").read_text()
    for name, (kind, _labels, _meaning) in METRICS.items():
        shown = PREFIX + name + ("_total" if kind == "counter" else "")
        assert f"`{shown}`" in doc, shown


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    parser = pytest.importorskip("prometheus_client.parser")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(PREFIX) and not s.name.endswith("_created"):
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_metrics_over_http(tmp_path):
    pytest.importorskip("prometheus_client")
    rng = np.random.default_rng(0)
    kv = [rng.integers(0, 2**16, (2, 16, BS, 4), dtype=np.uint16)]
    layout = KVLayout.from_tensors(kv, BS, block_dim=1)
    config = OffloadConfig(host_capacity_blocks=4, disk_path=str(tmp_path), model_id="m")
    local = build_local(layout, config)
    off, worker = local.offloader, local.worker
    try:
        server = local.serve_metrics(0, "127.0.0.1")
        keys = prefix_block_keys(np.arange(3 * BS), BS)

        def run(job):
            worker.submit(job)
            assert worker.wait([job.job_id], 30) == set()
            off.complete(worker.get_finished())

        run(off.schedule_store("a", keys, [0, 1, 2]))
        assert off.lookup([*keys, b"missing"]) == 3
        run(off.schedule_load("b", keys[:2], [5, 6]))
        cancelled = off.schedule_store("c", prefix_block_keys(np.arange(900, 916), BS), [7])
        assert cancelled is not None
        assert worker.cancel(off.abort("c")) == [cancelled.job_id]  # never submitted
        off.complete(worker.get_finished())
        assert off.drain_tiers(30)
        m = scrape(server.port)
        slot = layout.slot_bytes

        def value(name: str, **labels: str) -> float:
            return m[(PREFIX + name, tuple(sorted(labels.items())))]

        assert value("hit_blocks_total", tier="host") == 3
        assert value("miss_blocks_total", tier="host") == 1
        assert value("transfer_bytes_total", direction="store") == 3 * slot
        assert value("transfer_bytes_total", direction="load") == 2 * slot
        assert value("transfer_jobs_total", direction="store", outcome="ok") == 1
        assert value("transfer_jobs_total", direction="store", outcome="cancelled") == 1
        assert value("transfer_jobs_total", direction="load", outcome="ok") == 1
        assert value("transfer_jobs_total", direction="load", outcome="timed_out") == 0
        assert value("transfer_seconds_total", direction="load") > 0
        assert value("prefill_tokens_saved_total") == 2 * BS
        assert value("queue_depth") == value("jobs_in_flight") == value("late_loads") == 0
        assert value("host_slots", state="readable") == 3
        assert value("host_slots", state="free") == 1
        assert value("pinned_slots") == 0
        assert value("tier_total", tier="disk", counter="puts") == 3  # written down behind
        assert value("tier_flow_total", counter="written") == 3
        assert value("hit_blocks_total", tier="disk") == 0
        assert value("tier_up", tier="disk") == 1
        # one store and one load job, both successful: one observation each, in a finite bucket
        for direction in ("store", "load"):
            count = value("transfer_duration_seconds_count", direction=direction)
            finite = value("transfer_duration_seconds_bucket", direction=direction, le="10.0")
            assert count == finite == 1
            assert value("transfer_duration_seconds_sum", direction=direction) > 0
            assert value("transfer_duration_seconds_bucket", direction=direction, le="+Inf") == 1
        assert value("layer_wait_seconds_count") == 0  # nothing waited on a layer here
        assert value("tier_read_seconds_count", tier="disk") == 0  # nothing read back up
        names = {name for name, _ in m}
        suffix = {"counter": "_total", "gauge": "", "histogram": "_count"}
        for name, (kind, _labels, _meaning) in METRICS.items():
            assert PREFIX + name + suffix[kind] in names
    finally:
        local.close()
    with pytest.raises(OSError):
        scrape(server.port)  # close stopped the server


def test_bad_port_is_a_value_error():
    pytest.importorskip("prometheus_client")
    kv = [np.zeros((8, BS, 4), np.float32)]
    local = build_local(KVLayout.from_tensors(kv, BS), OffloadConfig(host_capacity_blocks=2))
    try:
        with pytest.raises(ValueError, match=re.escape("TCP port in [0, 65535], got 70000")):
            local.serve_metrics(70000)
    finally:
        local.close()


def test_histogram_counts_each_observation_in_the_first_bucket_that_holds_it():
    from kvoffload.offload.latency import Histogram

    h = Histogram((1e-3, 1e-2))
    for seconds in (5e-4, 1e-3, 2e-3, 1e-2, 3.0):  # a bound itself belongs to its bucket (le)
        h.observe(seconds)
    snap = h.snapshot()
    assert snap["counts"] == [2, 2, 1] and snap["count"] == 5
    assert snap["sum"] == pytest.approx(5e-4 + 1e-3 + 2e-3 + 1e-2 + 3.0)
    for bad in ((), (1.0, 0.5), (0.0, 1.0), (1.0, 1.0)):
        with pytest.raises(ValueError, match="expected increasing positive bucket bounds"):
            Histogram(bad)


def test_layer_waits_are_observed():
    """A load waited on layer by layer (CPU: the host blocks) lands in the layer-wait histogram;
    the store and the load in the transfer histograms."""
    rng = np.random.default_rng(1)
    kv = [rng.integers(0, 2**16, (2, 8, BS, 4), dtype=np.uint16) for _ in range(2)]
    layout = KVLayout.from_tensors(kv, BS, block_dim=1)
    local = build_local(layout, OffloadConfig(host_capacity_blocks=4))
    off, worker = local.offloader, local.worker
    try:
        keys = prefix_block_keys(np.arange(2 * BS), BS)
        job = off.schedule_store("a", keys, [0, 1])
        assert job is not None
        worker.submit(job)
        worker.wait([job.job_id], 30)
        off.complete(worker.get_finished())
        load = off.schedule_load("b", keys, [2, 3])
        worker.submit(load)
        for layer in (0, 1):
            worker.wait_on(load.job_id, layer=layer)
        worker.wait([load.job_id], 30)
        off.complete(worker.get_finished())
        snap = worker.snapshot()["latency"]
        assert snap["load"]["count"] == snap["store"]["count"] == 1
        # the load was not reported finished (get_finished) before both waits: two observations
        assert snap["layer_wait"]["count"] == 2
    finally:
        local.close()
