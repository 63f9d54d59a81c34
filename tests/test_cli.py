import json

from kvoffload.cli import main


def test_bench_transfer_on_cpu_writes_its_table(tmp_path, capsys):
    out = tmp_path / "t.json"
    argv = ["bench", "transfer", "--models", "qwen2.5-7b", "--layouts", "kv_split,page"]
    assert main([*argv, "--blocks", "3,8", "--reps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["backend"] == "host" and len(result["rows"]) == 4
    for row in result["rows"]:
        assert row["round_trip_exact"] and row["store_GBps"] > 0 and row["load_GBps"] > 0
        assert row["slot_bytes"] == 28 * 2 * 16 * 4 * 128 * 2
    assert "GB/s" in capsys.readouterr().out


def test_bench_store_reports_costs(tmp_path):
    out = tmp_path / "s.json"
    assert main(["bench", "store", "--resident", "3000", "--reps", "3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["policy"] for r in rows} == {"lru", "arc"}
    for r in rows:
        assert r["resident"] == 3000 and r["lookup_2048_us"] > 0 and r["bytes_per_block"] > 0


def test_bad_arguments_exit_with_a_message(capsys):
    import pytest

    with pytest.raises(SystemExit, match="--models: expected names"):
        main(["bench", "transfer", "--models", "gpt-5"])
