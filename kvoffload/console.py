"""The command line's output: one ``rich`` console whose tables fit its width, and a progress bar.

``kvoffload doctor``, ``calibrate`` and every ``bench`` command print through ``console``. On a
terminal it lays out each table it prints to fit the terminal's width: a light box, and a cell
that does not fit wraps onto a second line instead of being cut to ``1234…``. When the output is
not a terminal (piped, redirected to a log, captured by CI) nothing is wrapped: each line is as
long as it needs to be, so a path, a case name or a table row is never split across lines
(``COLUMNS`` set in the environment still fixes a width).
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console, ConsoleDimensions
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

PIPED_WIDTH = 100_000  # columns when not a terminal: in effect, no wrapping


class BenchConsole(Console):
    """A ``Console`` whose tables fit its width, and that never wraps when it is not a terminal
    (see the module docstring)."""

    @property
    def size(self) -> ConsoleDimensions:
        dims = Console.size.fget(self)  # type: ignore[attr-defined]
        if self.is_terminal or self._width is not None or "COLUMNS" in self._environ:
            return dims  # type: ignore[no-any-return]
        return ConsoleDimensions(PIPED_WIDTH, dims.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]

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
