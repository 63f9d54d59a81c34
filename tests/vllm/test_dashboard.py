"""Every metric ``dashboards/kvoffload-vllm.json`` queries is one vLLM registers when kvoffload runs
inside it: declared by our spec (with both of our lower tiers) or by vLLM's offloading connector.
(The exporter's dashboard is evaluated through a real Prometheus in tests/test_prometheus.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    get_connector_metric_definitions,
)

from kvoffload.integrations.vllm.spec import KVOffloadSpec
from tests.vllm.harness import VLLM_VERSION

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
