"""Mode ``gpu_all_copy`` (``runner/beside.py``): ``gpu_all`` with a plain copy of the bytes
kvoffload's restore of the same request moved, beside its forward."""

import importlib.util
import itertools
import json

import pytest

from kvoffload.cli import main

torch = pytest.importorskip("torch")


def test_gpu_all_copy_moves_each_restores_bytes_and_is_reported(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    argv = ["bench", "e2e", "--model", "micro", "--device", "cpu", "--no-plot", "--out", str(out)]
    argv += ["--modes", "gpu_all,gpu_all_copy,kvoffload", "--zero-reuse-rounds", "0"]
    assert main([*argv, "--verify", "0"]) == 0
    chat = json.loads(out.read_text())["results"]["runs"]["eager"]["workloads"]["chat"]
    modes = chat["modes"]
    assert list(modes) == ["gpu_all", "gpu_all_copy", "kvoffload"]
    kvo = {(r["round"], r["conversation"], r["turn"]): r for r in modes["kvoffload"]["records"]}
    ideal = {(r["round"], r["conversation"], r["turn"]): r for r in modes["gpu_all"]["records"]}
    copies = modes["gpu_all_copy"]["records"]
    assert len(copies) == len(kvo) and any(r["beside_bytes"] for r in copies)
    for r in copies:
        key = (r["round"], r["conversation"], r["turn"])
        assert r["beside_bytes"] == kvo[key]["load_bytes"]  # the same bytes, request by request
        assert r["gpu_hit_tokens"] == ideal[key]["gpu_hit_tokens"]  # gpu_all's pool: same hits
        assert r["host_hit_tokens"] == 0 and r["kvo_ms_total"] == 0
        if r["beside_bytes"]:
            assert "load_submit" in r["host_ms"]  # started where kvoffload starts its load
    side = chat["attribution"]["beside"]
    restored = [r for r in kvo.values() if r["host_hit_tokens"]]
    assert side["requests"] == len(restored) > 0 and side["same_bytes"] is True
    for mode in ("kvoffload", "gpu_all_copy"):
        assert side[mode]["launch_vs_gpu_all"] > 0 and side[mode]["p99_vs_gpu_all"] > 0
    layers = len(restored[0]["layer_launch_ms"])
    assert layers == 2 and all(len(r["layer_launch_ms"]) == layers for r in copies)
    assert all(0 < a < b for r in restored for a, b in itertools.pairwise(r["layer_launch_ms"]))
    assert len(chat["attribution"]["layer_launch_growth_ms_p50"]) == layers
    assert all(r["wait_host_ms"] > 0 for r in restored)
    assert (
        all(r["wait_host_ms"] == 0 for r in copies) and chat["attribution"]["wait_host_ms_p50"] > 0
    )
    assert "gpu_all_copy (a plain copy of the same bytes)" in capsys.readouterr().out


def test_gpu_all_copy_needs_kvoffload_and_refuses_bad_sizes():
    from kvoffload.bench.e2e.runner.beside import BesideCopy

    argv = ["bench", "e2e", "--model", "micro", "--device", "cpu", "--no-plot"]
    with pytest.raises((SystemExit, ValueError), match="expected mode kvoffload beside"):
        main([*argv, "--modes", "gpu_all,gpu_all_copy"])
    side = BesideCopy(torch.device("cpu"), 64)
    for bad in (-1, 65):
        with pytest.raises(ValueError, match=rf"expected 0 to 64 bytes, got {bad}"):
            side.start(bad)
    with pytest.raises(ValueError, match="expected capacity > 0 bytes, got 0"):
        BesideCopy(torch.device("cpu"), 0)
    side._src[:10] = torch.arange(10, dtype=torch.uint8)
    side.start(10)
    assert side.landed(10)


def test_untimed_waits_drop_the_wait_sections_and_keep_the_waits(tmp_path):
    out = tmp_path / "e2e.json"
    argv = ["bench", "e2e", "--model", "micro", "--device", "cpu", "--out", str(out)]
    argv += ["--modes", "gpu_all,kvoffload", "--zero-reuse-rounds", "0", "--untimed-waits"]
    assert main([*argv, "--verify", "1"]) == 0
    run = json.loads(out.read_text())["results"]["runs"]["eager"]
    records = run["workloads"]["chat"]["modes"]["kvoffload"]["records"]
    restored = [r for r in records if r["host_hit_tokens"]]
    assert restored and all(r["layer_wait_ms"] == [] for r in restored)
    assert all(r["load_exposed_ms"] is None for r in restored)  # not measured, not the load
    assert all(r["wait_host_ms"] > 0 for r in restored)  # the waits still ran, each layer
    assert all(c["ok"] for c in run["verify"])  # and the restored KV is still bit-exact
    if importlib.util.find_spec("matplotlib") is not None:
        assert out.with_suffix(".png").stat().st_size > 10_000  # plotted without the waits
