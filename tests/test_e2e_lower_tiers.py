"""``kvoffload bench e2e --lower-tiers`` at micro shapes: a second engine process restores its
prefixes from the first one's disk tier, bit for bit, and reports TTFT per mode."""

import json

import pytest

from kvoffload.cli import main


def test_disk_restores_are_bit_exact_and_timed(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "lower.json"
    argv = ["bench", "e2e", "--lower-tiers", "disk", "--model", "micro", "--device", "cpu"]
    argv += ["--documents", "3", "--document-tokens", "64", "--verify", "1", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    disk = result["disk"]
    assert disk["first_engine"]["ok"]
    assert [c["ok"] for c in disk["verify"]] == [True]  # restored, logits and tokens equal
    assert disk["verify"][0]["restored_tokens"] == 64
    assert set(disk["ttft_ms"]) == {"recompute", "lower", "host"}
    assert all(t["n"] == 2 for t in disk["ttft_ms"].values())
    flow = disk["tier_stats"]["flow"]
    assert flow["promoted"] >= 4 and flow["promote_failures"] == 0
    taken = flow["loads_taken"] + flow["loads_unmeasured"]
    assert taken >= 8 or flow["declined_without_lookup"] >= 8  # blocks, or keys not asked
    # per timed request, where its time went (the lower tiers' attribution)
    assert len(disk["requests"]) == 2
    lower = disk["requests"][0]["lower"]
    assert lower["ttft_ms"] > 0 and "lookup" in lower["host_ms"]
    assert "offloader.lookup_tiers" in lower["kvo_ttft_calls"]
    assert set(disk["attribution_ms"]) >= {"lower_minus_recompute", "lower_tier_wait"}
    assert "1 of 1 restored turns bit-exact" in capsys.readouterr().out


def test_an_unknown_lower_tier_exits_with_a_message():
    with pytest.raises(SystemExit, match="expected --lower-tiers from valkey,disk, got 'tape'"):
        main(["bench", "e2e", "--lower-tiers", "tape", "--model", "micro", "--device", "cpu"])
