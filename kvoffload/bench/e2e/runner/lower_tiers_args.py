"""The options of ``kvoffload bench e2e --lower-tiers`` (``lower_tiers.py``); torch-free, so the
CLI's parser is built without importing the model runner."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("lower tiers (kvoffload/bench/e2e/runner/lower_tiers.py)")
    g.add_argument(
        "--lower-tiers",
        default=None,
        metavar="LIST",
        help="only restored prefixes from lower tiers, comma separated from "
        "valkey,valkey-cluster,disk (--documents, --document-tokens size them)",
    )
    g.add_argument(
        "--valkey-url", default=None, help="--lower-tiers valkey: the server (default: start one)"
    )
    g.add_argument(
        "--valkey-cluster-url",
        default=None,
        help="--lower-tiers valkey-cluster: redis+cluster://host:port,... (default: start 3 "
        "primaries + 3 replicas on loopback)",
    )
    g.add_argument(
        "--tier-threads",
        type=int,
        default=None,
        help="OffloadConfig.tier_threads of both engine processes (default: the config's)",
    )
