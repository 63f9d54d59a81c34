"""``benchmarks/api_gpu.py``'s fits, on rows made up here (the benchmark itself needs a GPU; this
reads the source tree, so the wheel job leaves it out): with the driver's times in the rows, the
API's line without the driver is the API's line less the driver's, judged against the same
targets; ``--refit`` recomputes a results file's fits."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import api_gpu


def rows(driver: bool) -> list[dict[str, Any]]:
    out = []
    for blocks in (1, 37, 1000):
        phases = {"schedule": 5.0, "submit": 8.0 + 0.5 * blocks, "complete": 4.0}
        phases["api"] = phases["schedule"] + phases["submit"] + phases["complete"]
        if driver:
            phases["submit_driver"] = 6.0 + 0.45 * blocks
        out.append(
            {
                "backend": "staged",
                "model": "m",
                "layout": "page",
                "keys": "list",
                "direction": "store",
                "wait": "block",
                "blocks": blocks,
                "phases_us": phases,
            }
        )
    return out


def test_the_api_line_without_the_driver_is_the_api_line_less_the_drivers() -> None:
    (fit,) = api_gpu.fits(rows(driver=True))
    assert fit["api"]["per_call_us"] == pytest.approx(17.0)
    assert fit["api"]["per_block_us"] == pytest.approx(0.5)
    assert fit["api"]["met"] is False  # 17 us > 15
    assert fit["driver"]["per_call_us"] == pytest.approx(6.0)
    assert fit["api_less_driver"]["per_call_us"] == pytest.approx(11.0)
    assert fit["api_less_driver"]["per_block_us"] == pytest.approx(0.05)
    assert fit["api_less_driver"]["met"] is True  # 11 us + 0.05 per block: within 15 + 0.1
    (plain,) = api_gpu.fits(rows(driver=False))
    assert "driver" not in plain and "api_less_driver" not in plain


def test_refit_recomputes_a_results_files_fits_without_a_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    given = tmp_path / "in.json"
    given.write_text(json.dumps({"benchmark": "api_gpu", "fits": [], "rows": rows(driver=True)}))
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["api_gpu.py", str(out), "--refit", str(given)])
    assert api_gpu.main() == 0
    data = json.loads(out.read_text())
    assert data["rows"] == rows(driver=True)
    assert data["fits"][0]["api_less_driver"]["per_call_us"] == pytest.approx(11.0)
