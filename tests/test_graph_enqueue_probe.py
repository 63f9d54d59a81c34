"""benchmarks/graph_enqueue_probe.py refuses what it cannot run, saying what it expected, before
it builds or touches anything (it runs on a GPU only; docs/transfer.md, "twentieth round")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    not (ROOT / "benchmarks" / "graph_enqueue_probe.py").exists(),
    reason="runs the source tree's benchmarks/ (the wheel job copies only tests and docs)",
)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "benchmarks.graph_enqueue_probe", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ("--configs", "8by4"),
            "expected --configs as SxR pairs of ints >= 1 (8x4), got '8by4'",
        ),
        (
            ("--configs", "8x0"),
            "expected --configs as SxR pairs of ints >= 1 (8x4), got '8x0'",
        ),
        (
            ("--configs", "8x4,"),
            "expected --configs as SxR pairs of ints >= 1 (8x4), got '8x4,'",
        ),
        (("--configs", "64x64"), "expected slices x runs <= 1,360 per config, got '64x64'"),
        (("--iters", "3"), "expected --iters >= 10, got 3"),
        (("--copy-kib", "0"), "expected --copy-kib >= 1, got 0"),
    ],
)
def test_bad_arguments_are_refused_with_what_was_expected(tmp_path, args, said) -> None:
    out = tmp_path / "g.json"
    done = run(str(out), *args)
    assert done.returncode != 0
    assert said in done.stderr
    assert not out.exists()


def test_it_wants_an_output_path() -> None:
    done = run()
    assert done.returncode != 0
    assert "out" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_without_cuda_it_says_so(tmp_path) -> None:
    out = tmp_path / "g.json"
    done = run(str(out))
    assert done.returncode != 0
    assert "expected a CUDA device, got none" in done.stderr
    assert not out.exists()
