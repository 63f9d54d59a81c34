"""The GPU-only probes of issue 25 (``benchmarks/queue_probe.py``,
``benchmarks/graph_enqueue_probe.py``, ``benchmarks/access_width_probe.py``) refuse what they
cannot run, saying what they expected, before they build or touch anything (docs/transfer.md,
"nineteenth round", "twentieth round" and "Access width", say what each is for)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PROBES = ("queue_probe", "graph_enqueue_probe", "access_width_probe")
pytestmark = pytest.mark.skipif(
    not all((ROOT / "benchmarks" / f"{p}.py").exists() for p in PROBES),
    reason="runs the source tree's benchmarks/ (the wheel job copies only tests and docs)",
)


def run(probe: str, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", f"benchmarks.{probe}", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize(
    ("probe", "said"),
    [
        ("queue_probe", "expected one argument, OUT.json, got []"),
        ("graph_enqueue_probe", "the following arguments are required: out"),
        ("access_width_probe", "expected one argument, OUT.json, got []"),
    ],
)
def test_it_wants_an_output_path(probe, said) -> None:
    done = run(probe)
    assert done.returncode != 0
    assert said in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
@pytest.mark.parametrize("probe", PROBES)
def test_without_cuda_it_says_so(tmp_path, probe) -> None:
    out = tmp_path / "probe.json"
    done = run(probe, str(out))
    assert done.returncode != 0
    assert "expected a CUDA device, got none" in done.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--configs", "8by4"), "expected --configs as SxR pairs of ints >= 1 (8x4), got '8by4'"),
        (("--configs", "8x0"), "expected --configs as SxR pairs of ints >= 1 (8x4), got '8x0'"),
        (("--configs", "8x4,"), "expected --configs as SxR pairs of ints >= 1 (8x4), got '8x4,'"),
        (("--configs", "64x64"), "expected slices x runs <= 1,360 per config, got '64x64'"),
        (("--iters", "3"), "expected --iters >= 10, got 3"),
        (("--copy-kib", "0"), "expected --copy-kib >= 1, got 0"),
    ],
)
def test_the_graph_probe_refuses_bad_arguments(tmp_path, args, said) -> None:
    out = tmp_path / "g.json"
    done = run("graph_enqueue_probe", str(out), *args)
    assert done.returncode != 0
    assert said in done.stderr
    assert not out.exists()
