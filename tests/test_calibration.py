"""The calibration table: JSON round trip, the per-GPU cache path, malformed files."""

from __future__ import annotations

import json

import pytest

from kvoffload.transfer import calibration as cal


def table() -> cal.CalibrationTable:
    return cal.CalibrationTable(
        "NVIDIA H100 80GB HBM3",
        13000,
        (
            cal.Measurement("staged", "store", 4096, 10240, 51.5),
            cal.Measurement("dma", "store", 4096, 10240, 4.7),
        ),
        link={"h2d": 54.6, "d2h": 55.0},
    )


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVOFFLOAD_CACHE_DIR", str(tmp_path / "a"))
    assert cal.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("KVOFFLOAD_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cal.cache_dir() == tmp_path / "x" / "kvoffload"


def test_one_file_per_gpu_model_and_driver(tmp_path, monkeypatch):
    monkeypatch.setenv("KVOFFLOAD_CACHE_DIR", str(tmp_path))
    a = cal.table_path("NVIDIA H100 80GB HBM3", 13000)
    assert a.parent == tmp_path and "h100" in a.name and "13000" in a.name
    assert a != cal.table_path("NVIDIA H100 80GB HBM3", 12080)
    assert a != cal.table_path("NVIDIA H200", 13000)


def test_save_then_load_cached_round_trips(tmp_path, monkeypatch):
    monkeypatch.setenv("KVOFFLOAD_CACHE_DIR", str(tmp_path))
    assert cal.load_cached("NVIDIA H100 80GB HBM3", 13000) is None
    path = cal.save(table())
    got = cal.load_cached("NVIDIA H100 80GB HBM3", 13000)
    assert got is not None and path.exists()
    assert got.entries == table().entries and got.link == table().link
    assert got.date  # stamped when saved
    assert cal.load_cached("NVIDIA H100 80GB HBM3", 12080) is None  # another driver: none


@pytest.mark.parametrize(
    "content",
    ["not json", json.dumps({"format": 99, "entries": []}), json.dumps({"format": 1})],
)
def test_a_malformed_table_raises_value_error_naming_the_file(tmp_path, content):
    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"t\.json"):
        cal.load(path)
