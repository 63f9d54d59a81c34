"""The ``kvoffload`` command: ``doctor``, ``calibrate`` and ``bench <what>``.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
this file only routes. A command module must not import torch, Triton or CUDA at module level
(``--help`` imports every command module); ``run`` imports what it needs. A command's ``--help``
shows its module docstring's first paragraph, and every option's help with its default.

Every error a command line gets is one line in one form, ``kvoffload bench store --resident:
expected comma-separated integers, got 'abc'``: argparse's own messages are rewritten so
(``one_form``), and a command's ``SystemExit("--flag: expected X, got Y")`` gets the command's name
in front. ``int_list`` parses comma-separated integers in that form.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

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


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``<command> <option>: expected X, got
    Y``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, one_form(self.prog, message) + "\n")


_A = {"int": "an integer", "float": "a number"}
# argparse's messages (Python 3.10-3.13) -> "expected X, got Y"
_REWRITES: list[tuple[str, Callable[[re.Match[str]], str]]] = [
    (
        r"invalid choice: (.+?) \(choose from (.+)\)",
        lambda m: f"expected one of {m[2]}, got {m[1]}",
    ),
    (r"invalid (int|float) value: (.+)", lambda m: f"expected {_A[m[1]]}, got {m[2]}"),
    (r"invalid \S+ value: (.+)", lambda m: f"expected a valid value, got {m[1]}"),
    (r"expected one argument", lambda m: "expected a value, got none"),
    (r"the following arguments are required: (.+)", lambda m: f"expected {m[1]}, got none"),
    (r"unrecognized arguments: (.+)", lambda m: f"expected its options (--help), got {m[1]}"),
]


def one_form(prog: str, message: str) -> str:
    """``message`` (argparse's, or a command's ``SystemExit`` text) as ``prog [option]: text``."""
    if message.startswith("kvoffload"):
        return message
    where = ""
    match = re.fullmatch(r"argument (\S+?)(?:/\S+)?: (.*)", message, re.S)
    if match:
        where, message = match[1], match[2]
        if where in ("command", "subcommand"):  # the dests of the subcommand choices
            where = ""
    elif message.startswith("--"):  # a command's own "--flag: expected ..."
        return f"{prog} {message}"
    for pattern, rewrite in _REWRITES:
        found = re.fullmatch(pattern, message, re.S)
        if found:
            message = rewrite(found)
            break
    return f"{prog}{' ' + where if where else ''}: {message}"


def int_list(text: str) -> list[int]:
    """An option's ``1,16,1e6``: integers (``1e6`` allowed), comma separated."""
    try:
        return [int(float(x)) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def describe(module: Any) -> str:
    """A command module's docstring, first paragraph, as plain text."""
    doc = (module.__doc__ or "").strip().split("\n\n")[0]
    return plain(" ".join(line.strip() for line in doc.splitlines()))


def build_parser() -> argparse.ArgumentParser:
    from kvoffload import __version__

    parser = CommandParser(
        prog="kvoffload", description=plain(__doc__.splitlines()[0]), formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"kvoffload {__version__}")
    tops = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction[CommandParser]] = {}
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
        sub.set_defaults(_module=module_name, _prog=sub.prog)
        module.add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named with the command they were given to, not the top level's "kvoffload"
        message = one_form(
            getattr(args, "_prog", parser.prog), f"unrecognized arguments: {' '.join(extra)}"
        )
        parser.exit(2, message + "\n")
    try:
        code: int = importlib.import_module(args._module).run(args)
    except SystemExit as done:
        if isinstance(done.code, str):  # a command's error message: in one form
            raise SystemExit(one_form(args._prog, done.code)) from None
        raise
    return code


if __name__ == "__main__":
    sys.exit(main())
