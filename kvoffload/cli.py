"""The ``kvoffload`` command: ``doctor``, ``calibrate`` and ``bench <what>``.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
this file only routes. A command module must not import torch, Triton or CUDA at module level
(``--help`` imports every command module); ``run`` imports what it needs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

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
    ("bench", "e2e"): (
        "kvoffload.bench.e2e",
        "multi-turn chat TTFT: recompute vs GPU prefix cache vs kvoffload, on a model runner",
    ),
}


def register(path: tuple[str, ...], module: str, help_text: str) -> None:
    COMMANDS[path] = (module, help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvoffload", description=__doc__.splitlines()[0])
    tops = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]] = {}
    for path, (module, help_text) in COMMANDS.items():
        if len(path) == 1:
            sub = tops.add_parser(path[0], help=help_text)
        else:
            if path[0] not in groups:
                group = tops.add_parser(path[0], help=f"{path[0]} subcommands")
                groups[path[0]] = group.add_subparsers(dest="subcommand", required=True)
            sub = groups[path[0]].add_parser(path[1], help=help_text)
        sub.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = importlib.import_module(args._module).run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
