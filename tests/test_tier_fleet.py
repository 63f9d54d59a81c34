"""``kvoffload bench tiers --fleet``: engine processes sharing a 3 + 3 cluster while one primary is
killed (every loaded byte checked, every process alive and finished, hits from the cluster again
after the failover); the oracle that checks the bytes; the phases; bad option values."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvoffload.bench.tiers.fleet import FINISH_BOUND_S, FleetParams, summarise
from kvoffload.bench.tiers.fleet_cli import fleet_problems
from kvoffload.bench.tiers.fleet_process import Engine, Oracle, shared_keys
from kvoffload.cli import main
from tests.test_tier_cli import REPO, one_line_failure
from tests.tiers_support import require_cluster


def test_fleet_survives_a_primary_killed_mid_run(tmp_path):
    require_cluster()
    out = tmp_path / "fleet.json"
    args = ["bench", "tiers", "--fleet", "3", "--fleet-seconds", "14", "--fleet-block-kib", "16"]
    assert main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["date"] and result["host"]["cores"]
    runs = result["fleet"]
    fleet = runs["fleet"]
    procs = fleet["processes"]
    assert fleet["wrong_bytes"] == 0 and fleet["lookups_bounded"] == 0
    assert procs["count"] == procs["reported"] == procs["alive_at_kill"] == 3
    assert procs["hung"] == 0 and procs["errors"] == [] and procs["exitcodes"] == [0, 0, 0]
    assert procs["last_report_after_window_s"] < FINISH_BOUND_S
    failover = fleet["failover"]
    assert failover["promoted_after_s"] is not None  # the replica took over, unasked
    phases = fleet["phases"]
    assert set(phases) == {"before", "during", "after"}
    assert phases["before"]["hit_rate"] > 0.9 and phases["before"]["promoted"] > 0
    assert phases["during"]["hit_rate"] < phases["before"]["hit_rate"]
    assert phases["after"]["promoted"] > 0  # read up from the cluster again, checked
    assert fleet["recovery"]["processes_with_cluster_hits_after_promotion"] == 3
    assert fleet["valkey"]["reconnects"] >= 3 and fleet["valkey"]["corrupt"] == 0
    for base in ("one_process_one_server", "one_process_cluster"):
        one = runs[base]
        assert (
            one["wrong_bytes"] == 0 and one["failover"] is None and set(one["phases"]) == {"before"}
        )
        assert one["phases"]["before"]["hits"] > 0 and one["processes"]["exitcodes"] == [0]
    assert runs["ratios"]["fleet_before_vs_one_process_one_server"] > 0


def test_oracle_tells_every_block_apart_and_counts_wrong_bytes():
    params = FleetParams(block_bytes=4 << 10, prefix_blocks=4)
    spec = params.spec("redis+cluster://127.0.0.1:1", 1.0)
    oracle, engine = Oracle(spec.block_bytes), Engine(spec.block_bytes, 4)
    keys = shared_keys(0, spec) + shared_keys(1, spec)
    wants = [oracle.want(k) for k in keys]
    assert len({w.tobytes() for w in wants}) == len(keys)  # no two blocks alike
    for b in range(4):
        engine.write(b, wants[b])
    assert [engine.wrong_bytes(b, wants[b]) for b in range(4)] == [0, 0, 0, 0]
    assert engine.wrong_bytes(0, wants[1]) > 0 and engine.wrong_bytes(0, wants[4]) > 0
    engine.kv[1][1, 3, 5, 0, 7] ^= 1  # one bit of one V page of block 3
    assert engine.wrong_bytes(3, wants[3]) == 1
    engine.clear(4)
    assert engine.wrong_bytes(2, wants[2]) == np.count_nonzero(wants[2])


def test_requests_are_put_in_phases_by_when_they_started():
    params = FleetParams(prefix_blocks=4, block_bytes=1000)
    # (start, end, hit, promoted, load_s): 2 before the kill at 10, 1 during, 1 after 12
    rows = [(1.0, 1.1, 4, 4, 0.1), (9.9, 10.2, 4, 0, 0.2), (10.5, 10.6, 0, 0, -1.0)]
    rows.append((12.5, 12.6, 2, 2, 0.05))
    got = [
        {
            "requests": rows,
            "lookups": [(1.0, 0.001), (12.5, 0.003)],
            "wrong_bytes": 0,
            "lookups_bounded": 0,
            "tier_stats": {"flow": {"promoted": 6}, "tiers": {"valkey": {"gets": 6}}},
        }
    ]
    failover = {"killed_at": 10.0, "promoted_at": 12.0}
    out = summarise(params, got, 0.0, 20.0, failover)
    before, during, after = (out["phases"][p] for p in ("before", "during", "after"))
    assert (before["requests"], during["requests"], after["requests"]) == (2, 1, 1)
    assert before["hit_rate"] == 1.0 and during["hit_rate"] == 0.0 and after["hit_rate"] == 0.5
    assert before["hit_GBps"] == pytest.approx(8 * 1000 / 10 / 1e9)
    assert after["promoted_GBps"] == pytest.approx(2 * 1000 / 8 / 1e9)
    assert after["lookup"]["p50_ms"] == pytest.approx(3.0)
    assert out["recovery"]["cluster_hits_again_after_kill_s"] == [None]  # no whole prefix after
    assert out["recovery"]["processes_with_cluster_hits_after_promotion"] == 1
    assert out["valkey"] == {"gets": 6} and out["flow"] == {"promoted": 6}
    assert sum(t["requests"] for t in out["timeline"]) == 4


def test_fleet_problems_name_what_must_never_happen():
    good = {
        "wrong_bytes": 0,
        "processes": {
            "count": 2,
            "reported": 2,
            "hung": 0,
            "errors": [],
            "exitcodes": [0, 0],
            "alive_at_kill": 2,
        },
    }
    assert fleet_problems(good) == []
    bad = {
        "wrong_bytes": 3,
        "processes": {
            "count": 2,
            "reported": 1,
            "hung": 1,
            "errors": ["x"],
            "exitcodes": [0, -9],
            "alive_at_kill": 1,
        },
    }
    words = " ".join(fleet_problems(bad))
    assert "3 wrong bytes" in words and "did not report" in words
    assert "exit codes [0, -9]" in words and "only 1 processes alive" in words


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--fleet", "0"], "expected --fleet between 1 and 64 processes, got 0"),
        (["--fleet", "65"], "expected --fleet between 1 and 64 processes, got 65"),
        (["--fleet", "--fleet-seconds", "0"], "expected --fleet-seconds > 0"),
        (["--fleet", "--fleet-seconds", "nan"], "expected --fleet-seconds > 0"),
        (["--fleet", "--fleet-block-kib", "0"], "expected --fleet-block-kib between 1 and"),
        (["--fleet", "--cluster"], "expected --fleet alone (it is its own run), got it with --clu"),
        (["--fleet", "--sections", "disk"], "got it with --sections disk"),
        (
            ["--fleet", "--cluster-url", "redis://127.0.0.1:7000/0"],
            "expected --cluster-url redis+c",
        ),
        (["--fleet", "--cluster-url", "http://x"], "--cluster-url: expected valkey_url like"),
    ],
)
def test_bad_fleet_options_are_refused_before_anything_starts(tmp_path, extra, words):
    out = tmp_path / "fleet.json"
    with pytest.raises(SystemExit) as refused:
        main(["bench", "tiers", *extra, "--out", str(out)])
    assert str(refused.value).startswith("kvoffload bench tiers: ")
    assert words in str(refused.value)
    assert not out.exists()


def test_a_bad_fleet_option_is_one_line_and_status_1():
    code = "import sys; from kvoffload.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(
        [sys.executable, "-c", code, "bench", "tiers", "--fleet", "-2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    one_line_failure(done, "expected --fleet between 1 and 64 processes, got -2")
