"""The ``kvoffload`` command: ``doctor``, ``calibrate`` and ``bench <what>``.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
this file only routes. A command module must not import torch, Triton or CUDA at module level
(``--help`` imports every command module); ``run`` imports what it needs. A command's ``--help``
shows its module docstring's first paragraph, and every option's help with its default.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence
from typing import Any

# command path -> (module, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("doctor",): (
        "kvoffload.doctor",
        "GPU, driver, cuMemcpyBatchAsync, Triton, calibration table, measured link GB/s",
    ),
    ("calibrate",): (
        "kvoffload.calibrate",
        "measure the copy backends on this GPU and cache the planner's table",
    ),
    ("bench", "transfer"): (
        "kvoffload.bench.transfer",
        "copy GB/s per model shape and layout (host backend on CPU; GPU backends on a GPU)",
    ),
    ("bench", "store"): (
        "kvoffload.bench.store",
        "control-plane cost: lookup, store and eviction at 10^4 and 10^6 resident blocks",
    ),
    ("bench", "tiers"): (
        "kvoffload.bench.tiers",
        "disk and Valkey tier MB/s and per-block latency; file-per-block vs slab; write policy",
    ),
    ("bench", "multi-gpu"): (
        "kvoffload.bench.multi_gpu",
        "N processes (one per GPU) storing and loading at once, vs each link and host memory",
    ),
    ("bench", "e2e"): (
        "kvoffload.bench.e2e",
        "multi-turn chat TTFT: recompute vs GPU prefix cache vs kvoffload, on a model runner",
    ),
}


def register(path: tuple[str, ...], module: str, help_text: str) -> None:
    COMMANDS[path] = (module, help_text)


def plain(text: str) -> str:
    """Docstring markup as a terminal shows it: ``code`` without its backticks."""
    return re.sub(r"``(.+?)``", r"\1", text, flags=re.S)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their paragraphs; option help is plain text and ends with the default
    (unless the help already says it, or there is none to show: None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = plain(action.help or "").replace("%", "%%")
        default = action.default
        if not action.option_strings or default in (None, False, argparse.SUPPRESS):
            return text
        if "default" in text:
            return text
        if isinstance(default, (list, tuple)):
            default = ",".join(str(d) for d in default)
        return f"{text} (default: {str(default).replace('%', '%%')})"


def describe(module: Any) -> str:
    """A command module's docstring, first paragraph, as plain text."""
    doc = (module.__doc__ or "").strip().split("\n\n")[0]
    return plain(" ".join(line.strip() for line in doc.splitlines()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvoffload", description=plain(__doc__.splitlines()[0]), formatter_class=HelpFormatter
    )
    tops = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]] = {}
    for path, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        kw: dict[str, Any] = {"help": help_text, "description": describe(module)}
        kw["formatter_class"] = HelpFormatter
        if len(path) == 1:
            sub = tops.add_parser(path[0], **kw)
        else:
            if path[0] not in groups:
                group = tops.add_parser(
                    path[0], help=f"{path[0]} subcommands", formatter_class=HelpFormatter
                )
                groups[path[0]] = group.add_subparsers(dest="subcommand", required=True)
            sub = groups[path[0]].add_parser(path[1], **kw)
        sub.set_defaults(_module=module_name)
        module.add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = importlib.import_module(args._module).run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
