"""``kvoffload bench e2e`` end to end at micro shapes, and its guards."""

import json
import subprocess
import sys

import pytest

from kvoffload.cli import main


def test_bench_e2e_writes_json_and_plot(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "e2e.json"
    argv = ["bench", "e2e", "--model", "micro", "--device", "cpu", "--out", str(out)]
    assert main([*argv, "--zero-reuse-rounds", "1", "--zero-reuse-turns", "4"]) == 0
    result = json.loads(out.read_text())
    assert result["device"]["name"].startswith("cpu")
    assert result["results"]["graphs"] == ["eager"] and result["config"]["graphs"] == ["eager"]
    eager = result["results"]["runs"]["eager"]
    assert eager["graph"] == "eager" and eager["workloads"]["chat"]["graph"] == "eager"
    modes = eager["workloads"]["chat"]["modes"]
    assert list(modes) == ["recompute", "gpu", "gpu_all", "kvoffload"]
    for run in modes.values():
        assert run["turns"] == 4 * 3 and len(run["records"]) == 12
        assert run["ttft_ms"]["p50"] > 0 and run["turns_per_s"] > 0
        ratios = run["hit_ratio"]
        assert ratios["gpu"] + ratios["host"] + ratios["computed"] == pytest.approx(1.0)
    assert modes["recompute"]["hit_ratio"]["computed"] == 1.0
    assert modes["kvoffload"]["hit_ratio"]["host"] > 0
    assert modes["kvoffload"]["host"]["loaded_bytes"] > 0
    assert modes["kvoffload"]["host"]["stored_bytes"] > 0
    assert all(r["graph"] == "eager" for m in modes.values() for r in m["records"])
    # attribution: per restored request, kvoffload's calls summed, launch against gpu_all
    restored = [r for r in modes["kvoffload"]["records"] if r["host_hit_tokens"]]
    for r in restored:
        calls = {n: ms for n, ms in r["kvo_ms"].items() if not n.startswith("probe:")}
        assert r["kvo_ms_total"] == pytest.approx(sum(calls.values()))
        assert 0 < r["kvo_ms_in_ttft"] <= r["kvo_ms_total"]
        assert r["kvo_calls"]["worker.layer_waiter(layer)"] == len(r["layer_wait_ms"])
        assert r["wait_call_us"] > 0 and r["launch_ms"] > 0 and r["load_bytes"] > 0
        # the host backend's waits are timed by the host's clock: no event record to keep apart
        assert r["stall_timer_ms"] == 0.0 and r["wait_call_us_timed"] == r["wait_call_us"]
    att = eager["workloads"]["chat"]["attribution"]
    assert att["requests"] == len(restored) and att["kvo_ms_total_p50"] > 0
    assert att["launch_vs_gpu_all"] > 0 and len(att["gpu_wait_ms_per_layer_p50"]) == 2
    assert {"launch", "store_ahead", "token", "first_token"} <= set(att["gpu_all_host_ms_p50"])
    grown = att["growth_ms_p50"]  # against the same requests in gpu_all, per request
    ttft = sorted(r["ttft_ms"] - g["ttft_ms"] for r, g in _paired(restored, modes["gpu_all"]))
    assert min(ttft) <= grown["ttft"] <= max(ttft)
    assert {"host:load_submit", "host:token", "device_prefill", "gpu_wait"} <= set(grown)
    assert grown["host:load_submit"] > 0  # gpu_all loads nothing
    assert grown["copy_device_prefill"] is None  # no gpu_all_copy here
    targets = {t["name"]: t for t in eager["targets"]}
    assert targets["chat: kvoffload calls per restore"]["measured"] == att["kvo_ms_total_p50"]
    assert targets["chat: restored p50 / gpu_all"]["bound"] is not None
    zero = eager["zero_reuse"]
    assert zero["runs"]["kvoffload"][0]["hit_ratio"]["host"] == 0.0
    assert zero["runs"]["kvoffload"][0]["host"]["stored_blocks"] == 0  # nothing admitted
    assert zero["runs"]["kvoffload_store_all"][0]["host"]["stored_blocks"] > 0
    assert set(zero["overhead_turns_per_s"]) == {"kvoffload", "kvoffload_store_all"}
    assert [c["ok"] for c in eager["verify"]] == [True, True]
    assert [c["graph"] for c in eager["verify"]] == ["eager", "eager"]
    assert result["results"]["link"]["GBps"] > 0
    text = capsys.readouterr().out
    assert "chat, eager graphs: TTFT ms" in text and "zero reuse" in text
    assert "targets (eager):" in text and "chat, eager: " in text
    assert "ms vs gpu_all; host steps: " in text and "the forward's device time" in text
    if _has_matplotlib():
        assert out.with_suffix(".png").stat().st_size > 10_000
        from kvoffload.bench.e2e.runner.plot import plot

        # a row per graph mode and workload
        result["results"]["runs"]["full"] = {**eager, "graph": "full"}
        assert plot(result, tmp_path / "two.png").stat().st_size > 10_000


def _paired(restored, gpu_all):
    from kvoffload.bench.e2e.runner.results import request_key

    ideal = {request_key(g): g for g in gpu_all["records"]}
    return [(r, ideal[request_key(r)]) for r in restored if request_key(r) in ideal]


def test_every_workload_runs_and_reports_its_targets(tmp_path, monkeypatch, capsys):
    """All four workloads at micro shapes, the JSON written to a new file under
    ./kvoffload-results (no --out), each printed line whole (the output is not a terminal)."""
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "e2e", "--model", "micro", "--device", "cpu", "--no-plot"]
    assert main([*argv, "--workloads", "chat,fits,docs,mixed", "--zero-reuse-rounds", "0"]) == 0
    (out,) = (tmp_path / "kvoffload-results").glob("e2e_micro_cpu-*.json")
    result = json.loads(out.read_text())
    workloads = result["results"]["runs"]["eager"]["workloads"]
    assert list(workloads) == ["chat", "fits", "docs", "mixed"]
    assert [w["kind"] for w in result["config"]["workloads"]] == list(workloads)
    fits = workloads["fits"]["modes"]
    assert list(fits) == ["gpu", "kvoffload"] and len(fits["gpu"]["turns_per_s_rounds"]) == 3
    assert fits["kvoffload"]["hit_ratio"]["host"] == 0.0  # the pool holds everything
    assert fits["kvoffload"]["host"]["stored_blocks"] == 0  # and nothing is stored
    docs = workloads["docs"]["modes"]["kvoffload"]["records"]
    assert len(docs) == 12 and any(r["turn"] >= 2 for r in docs)
    mixed = workloads["mixed"]["modes"]["gpu"]["records"]
    assert sum(r["conversation"] == -1 for r in mixed) == 4  # a quarter unique
    names = [t["name"] for t in result["results"]["runs"]["eager"]["targets"]]
    assert "chat: restored p50 / gpu_all" in names and "fits: turns/s cost" in names
    assert "docs: recompute / kvoffload p99" in names
    text = capsys.readouterr().out
    assert "…" not in text
    assert f"JSON: {out}" in text.splitlines()  # the path on the line that names it
    assert "fits: turns/s cost:" in text


def test_modes_left_out_read_not_measured_never_nan(tmp_path, capsys):
    """``--modes gpu,kvoffload`` has no recompute or gpu_all to compare with: the targets that
    need them say so (the summary once printed "p50 nanx")."""
    pytest.importorskip("torch")
    argv = ["bench", "e2e", "--model", "micro", "--device", "cpu", "--no-plot"]
    argv += ["--modes", "gpu,kvoffload", "--zero-reuse-rounds", "0", "--verify", "0"]
    assert main([*argv, "--out", str(tmp_path / "e.json")]) == 0
    text = capsys.readouterr().out
    assert "nan" not in text.lower()
    assert (
        "chat: recompute / kvoffload p50: - (target >= 6x): not measured "
        "(chat in --workloads, recompute and kvoffload in --modes)"
    ) in text
    assert (
        "chat: launch / gpu_all: - (target <= 1.03x): not measured "
        "(chat in --workloads, kvoffload and gpu_all in --modes)"
    ) in text


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_bad_workload_exits_with_a_message():
    with pytest.raises(SystemExit, match="expected turns > 0"):
        main(["bench", "e2e", "--model", "micro", "--device", "cpu", "--turns", "0"])
    with pytest.raises(SystemExit, match="GPU pool of at least"):
        main(["bench", "e2e", "--model", "micro", "--device", "cpu", "--gpu-blocks", "3"])
    with pytest.raises(SystemExit, match="--modes: expected distinct names"):
        main(["bench", "e2e", "--model", "micro", "--device", "cpu", "--modes", "disk"])
    with pytest.raises(SystemExit, match="--graph: expected distinct names"):
        main(["bench", "e2e", "--model", "micro", "--device", "cpu", "--graph", "eager,lazy"])


def test_graph_modes_refuse_a_cpu_loudly():
    pytest.importorskip("torch")
    argv = ["bench", "e2e", "--model", "micro", "--device", "cpu", "--graph", "eager,piecewise"]
    with pytest.raises(SystemExit, match="other than eager only on a CUDA device"):
        main(argv)


def test_the_model_runner_ships_in_the_package():
    """``pip install .`` (not editable) installs the runner: it is a package under the installed
    kvoffload (CI runs this against the wheel, .ci/wheel.sh)."""
    import importlib.util
    from pathlib import Path

    import kvoffload

    spec = importlib.util.find_spec("kvoffload.bench.e2e.runner")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve().is_relative_to(Path(kvoffload.__file__).resolve().parent)


def test_the_command_module_does_not_import_torch():
    code = "import sys, kvoffload.bench.e2e.command; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_gpu_scripts_e2e_step_builds_its_runs():
    """benchmarks/gpu_run.sh's e2e arguments make a valid run for both models on a GPU: chat and
    docs, three graph modes, the targets' three modes, and every request within the graphs'
    longest context."""
    import argparse
    import re
    import shlex
    from pathlib import Path

    from kvoffload.bench.e2e import args as e2e

    script = (Path(__file__).parents[1] / "benchmarks" / "gpu_run.sh").read_text()
    found = re.search(r"E2E_TRIM=\((.*?)\)", script, re.S)
    assert found is not None
    trim = shlex.split(found.group(1))
    for extra in ([], ["--model", "qwen2.5-7b", "--block-size", "32"]):
        parser = argparse.ArgumentParser()
        e2e.add_arguments(parser)
        cfg = e2e.build_config(parser.parse_args([*trim, *extra]), True, "bfloat16")
        assert cfg.graphs == ("eager", "piecewise", "full") and cfg.device == "cuda"
        assert [r.workload.kind for r in cfg.workloads] == ["chat", "docs"]
        assert all(r.modes == ("recompute", "gpu_all", "kvoffload") for r in cfg.workloads)
        pytest.importorskip("torch")
        from kvoffload.bench.e2e.runner.bench import max_context

        bs = cfg.block_size
        longest = max(r.workload.longest_request_blocks(bs) for r in cfg.workloads)
        assert max_context(cfg) >= longest * bs


@pytest.mark.parametrize("name", ["llama3.2-1b", "qwen2.5-1.5b", "qwen2.5-14b"])
def test_the_sweeps_gpu_models_build_the_standard_run(name):
    """The sweep's other GPU shapes (docs/e2e.md, "Models") take the GPU workloads and the
    standard command's arguments, and their published shapes give the KV block the docs state."""
    import argparse

    from kvoffload.bench.e2e import args as e2e
    from kvoffload.bench.e2e.runner.config import GPU_MODELS, model_config

    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    argv = ["--model", name, "--workloads", "chat,docs", "--graph", "eager,piecewise,full"]
    cfg = e2e.build_config(parser.parse_args(argv), True, "bfloat16")
    assert name in GPU_MODELS and cfg.model == name
    assert [r.workload.kind for r in cfg.workloads] == ["chat", "docs"]
    assert cfg.chunk_tokens == e2e.CHUNK["llama3-8b"]
    m = model_config(name)
    block = 2 * m.layers * m.kv_heads * m.head_size * 16 * 2  # K and V, 16 tokens, bf16
    assert block == {"llama3.2-1b": 512, "qwen2.5-1.5b": 448, "qwen2.5-14b": 3072}[name] << 10
