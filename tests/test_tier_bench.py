"""``kvoffload bench tiers`` runs end to end on a tiny size and writes every section."""

from __future__ import annotations

import json

from kvoffload.cli import main
from tests.tiers_support import require_cluster, require_server


def test_bench_tiers_writes_every_section(tmp_path):
    require_server()
    out = tmp_path / "tiers.json"
    args = ["bench", "tiers", "--mib", "1", "--rounds", "1", "--dir", str(tmp_path)]
    assert main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for label in ("slot_2MiB", "page_64KiB"):
        assert set(result["format"][label]) == {"file_per_block", "slab"}
        assert result["disk"][label]["get_MBps"] > 0
        assert result["valkey"][label]["put_MBps"] > 0
        policy = result["policy"][label]
        assert policy["demote_on_evict"]["blocks_stored"] == policy["write_behind"]["blocks"]
    assert result["dir_fs"]["fstype"]
    assert not list(tmp_path.glob("kvoffload-bench-tiers-*"))  # it cleans up after itself


def test_bench_tiers_cluster_shares_prefixes_between_processes(tmp_path):
    require_cluster()
    out = tmp_path / "sharing.json"
    args = ["bench", "tiers", "--cluster", "--mib", "1", "--rounds", "1", "--processes", "2"]
    assert main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for label in ("slot_2MiB", "page_64KiB"):
        for target in ("one_server", "cluster"):
            row = result["sharing"][label][target]
            assert row["wrong_blocks"] == 0 and row["tier_errors"] == 0
            # 2 processes x 2 rounds over the same prefixes: only first visits miss
            assert 0.5 <= row["hit_rate"] < 1.0 and row["get_MBps"] > 0
            assert row["get_per_block"]["p99_ms"] >= row["get_per_block"]["p50_ms"] > 0
    assert "3 primaries + 3 replicas" in result["valkey_cluster"]
