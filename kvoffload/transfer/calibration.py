"""The calibration table: measured GB/s per copy method on this machine, cached per GPU + driver.

``kvoffload calibrate`` fills it (``kvoffload.calibrate``) and writes it as JSON under
the cache directory: ``$KVOFFLOAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvoffload``, else
``~/.cache/kvoffload``; one file per GPU model and driver version, so a driver update or another
GPU model starts from the default until calibrated again. This module is torch-free.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FORMAT = 1


@dataclass(frozen=True)
class Measurement:
    method: str  # "staged", "dma", "sm"
    direction: str  # "store", "load", or "both" (a store and a load at once, GB/s summed)
    piece_bytes: int  # bytes of one (block, region) piece
    pieces: int  # pieces per transfer (blocks x regions)
    gbps: float  # median GB/s (1e9 bytes/s) of whole transfers


@dataclass(frozen=True)
class CalibrationTable:
    device: str  # GPU model, e.g. "NVIDIA H100 80GB HBM3"
    driver: int  # CUDA driver version, e.g. 13000
    entries: tuple[Measurement, ...]
    date: str = ""
    link: dict[str, float] | None = None  # contiguous GB/s: h2d, d2h

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "device": self.device,
            "driver": self.driver,
            "date": self.date or dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "link": self.link,
            "entries": [asdict(e) for e in self.entries],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CalibrationTable:
        if data.get("format") != FORMAT:
            raise ValueError(
                f"expected a calibration table of format {FORMAT}, got {data.get('format')!r}"
            )
        try:
            entries = tuple(
                Measurement(
                    str(e["method"]),
                    str(e["direction"]),
                    int(e["piece_bytes"]),
                    int(e["pieces"]),
                    float(e["gbps"]),
                )
                for e in data["entries"]
            )
            return cls(
                str(data["device"]),
                int(data["driver"]),
                entries,
                str(data.get("date", "")),
                data.get("link"),
            )
        except (KeyError, TypeError) as err:
            raise ValueError(f"expected a calibration table, got a malformed one ({err})") from None


def cache_dir() -> Path:
    explicit = os.environ.get("KVOFFLOAD_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvoffload"


def table_path(device: str, driver: int) -> Path:
    slug = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
    return cache_dir() / f"calibration-{slug}-driver{driver}.json"


def save(table: CalibrationTable, path: Path | None = None) -> Path:
    path = path or table_path(table.device, table.driver)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table.to_json(), indent=1) + "\n")
    tmp.replace(path)
    return path


def load(path: Path) -> CalibrationTable:
    """Read a table; ValueError naming ``path`` if it is not one."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"expected a JSON calibration table in {path}, got: {err}") from None
    try:
        return CalibrationTable.from_json(data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def load_cached(device: str, driver: int) -> CalibrationTable | None:
    """This GPU model's and driver's table, or None where none was measured."""
    path = table_path(device, driver)
    return load(path) if path.exists() else None
