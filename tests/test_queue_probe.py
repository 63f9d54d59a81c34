"""benchmarks/queue_probe.py refuses what it cannot run, saying what it expected (it runs on a GPU
only; docs/transfer.md, "nineteenth round", says what it is for)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    not (ROOT / "benchmarks" / "queue_probe.py").exists(),
    reason="runs the source tree's benchmarks/ (the wheel job copies only tests and docs)",
)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "benchmarks.queue_probe", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_it_wants_one_output_path() -> None:
    done = run()
    assert done.returncode != 0
    assert "expected one argument, OUT.json, got []" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_without_cuda_it_says_so(tmp_path) -> None:
    out = tmp_path / "q.json"
    done = run(str(out))
    assert done.returncode != 0
    assert "expected a CUDA device, got none" in done.stderr
    assert not out.exists()
