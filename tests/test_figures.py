"""The measured figures of README.md and docs/ are what ``benchmarks/figures.py`` makes of the
committed result files: a figure typed by hand, or a result file changed without its figure,
fails here (``python benchmarks/figures.py`` rewrites them). Reads the source tree, so
``.ci/wheel.sh`` leaves it out."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def figures() -> Any:
    spec = importlib.util.spec_from_file_location("figures", ROOT / "benchmarks" / "figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_figure_matches_its_result_files():
    fig = figures()
    stale = []
    used = set()
    for path in fig.DOCS:
        text = path.read_text()
        used |= set(re.findall(r"<!-- figure:([\w-]+) -->", text))
        stale += [f"{path.name}: {name}" for name in fig.fill(text)[1]]
    assert stale == [], "run python benchmarks/figures.py"
    assert used == set(fig.FIGURES)  # every figure is shown somewhere, and only those
    assert "readme_e2e_h100" in re.findall(r"figure:([\w-]+)", (ROOT / "README.md").read_text())


def test_a_figure_changed_by_hand_is_found():
    fig = figures()
    text = (ROOT / "README.md").read_text()
    original = fig.FIGURES["readme_e2e_h100"]()
    assert "186.8 / 187.7" in original  # recompute p50 of the two final runs
    typed = text.replace("186.8 / 187.7", "180.0 / 187.7", 1)
    assert typed != text
    new, changed = fig.fill(typed)
    assert changed == ["readme_e2e_h100"] and new == text


def test_an_unknown_figure_name_is_refused():
    fig = figures()
    with pytest.raises(ValueError, match=r"expected a figure in .*, got 'nope'"):
        fig.fill("<!-- figure:nope -->\nx\n<!-- /figure:nope -->\n")
