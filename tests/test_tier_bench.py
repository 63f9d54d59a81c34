"""``kvoffload bench tiers`` runs end to end on a tiny size and writes every section."""

from __future__ import annotations

import json

from kvoffload.cli import main
from tests.tiers_support import require_server


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
