"""``kvoffload bench e2e --lower-tiers`` at micro shapes: a second engine process restores its
prefixes from the first one's disk tier (and a Valkey cluster's), bit for bit, and reports TTFT
per mode, in an order drawn per document, and each document's difference against recompute."""

import json
from collections import Counter

import pytest

from kvoffload.bench.e2e.runner.lower_tiers_report import median_ci, paired, request_orders
from kvoffload.cli import main
from tests.tiers_support import require_cluster


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
    # the order of recompute and lower per document, as request_orders draws it for the seed
    assert [tuple(r["order"]) for r in disk["requests"]] == request_orders(2, 0)
    assert [r["document"] for r in disk["requests"]] == [1, 2]
    pair = disk["paired_ms"]["lower"]
    want = [r["lower"]["ttft_ms"] - r["recompute"]["ttft_ms"] for r in disk["requests"]]
    assert pair["per_document_ms"] == want and pair["n"] == 2
    assert disk["target"]["paired_median_ms"] == pair["median_ms"]
    assert disk["warmup_recompute_ms"] > 0
    assert "1 of 1 restored turns bit-exact" in capsys.readouterr().out


def test_a_cluster_restores_bit_exact(tmp_path):
    """``valkey-cluster``: the first process's blocks written to 3 primaries + 3 replicas started
    by the benchmark, restored in the second process bit for bit."""
    pytest.importorskip("torch")
    require_cluster()
    out = tmp_path / "lower.json"
    argv = ["bench", "e2e", "--lower-tiers", "valkey-cluster", "--model", "micro"]
    argv += ["--device", "cpu", "--documents", "3", "--document-tokens", "64", "--verify", "1"]
    assert main([*argv, "--tier-threads", "3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "3 primaries + 3 replicas" in result["valkey_cluster"] and result["tier_threads"] == 3
    cluster = result["valkey-cluster"]
    assert [c["ok"] for c in cluster["verify"]] == [True]
    assert cluster["verify"][0]["restored_tokens"] == 64
    assert cluster["tier_stats"]["flow"]["promoted"] >= 4
    assert cluster["tier_stats"]["tiers"]["valkey"]["corrupt"] == 0


def test_orders_are_balanced_seeded_and_shuffled():
    orders = request_orders(11, seed=0)
    assert Counter(o[0] for o in orders) == {"recompute": 6, "lower": 5}
    assert all(sorted(o) == ["lower", "recompute"] for o in orders)
    assert orders == request_orders(11, seed=0)
    draws = {tuple(request_orders(11, seed)) for seed in range(5)}
    assert len(draws) > 1  # not one fixed pattern


def test_the_median_interval_is_the_sign_tests():
    # n = 10: the 2nd and 9th values bound the median with coverage 1 - 2 * 11 / 1024
    low, high, coverage = median_ci([float(v) for v in range(10, 0, -1)])
    assert (low, high) == (2.0, 9.0) and coverage == pytest.approx(1 - 22 / 1024)
    low, high, coverage = median_ci([3.0, 1.0, 2.0])  # too few for 95%: min and max
    assert (low, high) == (1.0, 3.0) and coverage == pytest.approx(0.75)


def test_paired_differences_and_the_order_effect():
    """lower minus recompute per document; coming second saves 1 ms here, which the two orders'
    medians show (their half difference)."""
    requests = []
    for i, first in enumerate(["recompute", "lower"] * 3):
        second_saves = 1.0
        rec = 100.0 + i - (second_saves if first == "lower" else 0.0)
        low = 100.5 + i - (second_saves if first == "recompute" else 0.0)
        requests.append(
            {
                "order": [first, "lower" if first == "recompute" else "recompute"],
                "recompute": {"ttft_ms": rec},
                "lower": {"ttft_ms": low},
            }
        )
    pair = paired(requests, "lower")
    assert pair["per_document_ms"] == pytest.approx([-0.5, 1.5] * 3)
    assert pair["median_ms"] == pytest.approx(0.5) and pair["above_zero"] == 3
    assert pair["median_ms_lower_second"] == pytest.approx(-0.5)
    assert pair["median_ms_lower_first"] == pytest.approx(1.5)
    assert pair["second_faster_ms"] == pytest.approx(1.0)
    assert pair["median_ci_ms"] == pytest.approx([-0.5, 1.5]) and pair["ci_holds_zero"]


def test_an_unknown_lower_tier_exits_with_a_message():
    want = "expected --lower-tiers from valkey,valkey-cluster,disk, got 'tape'"
    with pytest.raises(SystemExit, match=want):
        main(["bench", "e2e", "--lower-tiers", "tape", "--model", "micro", "--device", "cpu"])


def test_bad_tier_threads_exit_with_a_message():
    argv = ["bench", "e2e", "--lower-tiers", "disk", "--model", "micro", "--device", "cpu"]
    with pytest.raises(SystemExit, match="expected --tier-threads > 0, got 0"):
        main([*argv, "--tier-threads", "0"])
