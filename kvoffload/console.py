"""The command line's output: one ``rich`` console whose tables fit its width, and a progress bar.

``kvoffload doctor``, ``calibrate`` and every ``bench`` command print through ``console``. It lays
out each table it prints to fit (80 columns when the output is not a terminal, e.g. a log file):
a light box, and a cell that does not fit wraps onto a second line instead of being cut to
``1234…``.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table


class BenchConsole(Console):
    """A ``Console`` whose tables fit its width (see the module docstring)."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        for obj in objects:
            if isinstance(obj, Table):
                compact(obj)
        super().print(*objects, **kwargs)


def compact(table: Table) -> Table:
    """Lay ``table`` out to fit narrow consoles: no outer edge, no padding, one space between
    columns, and a cell that does not fit wraps rather than ending in an ellipsis."""
    table.box = box.SIMPLE_HEAD
    table.show_edge = False
    table.pad_edge = False
    table.padding = (0, 0)
    for column in table.columns:
        column.overflow = "fold"
        column.no_wrap = False
    return table


console = BenchConsole()


def progress() -> Progress:
    """A progress bar with the elapsed time and an estimate of the time left."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
    )
