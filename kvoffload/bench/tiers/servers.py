"""The Valkey server and cluster a ``kvoffload bench tiers`` run measures: given by URL, or
started here on 127.0.0.1 (and stopped with the run); each checked once before anything is
measured, so an unreachable or refusing one ends the run with one line (``Fatal``)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
from typing import Any

from kvoffload.bench.tiers.common import FP, Fatal
from kvoffload.store.tiers.local_server import server_version


def need_client(what: str, instead: str) -> None:
    if importlib.util.find_spec("redis") is None:
        raise Fatal(
            f"the {what} section needs the redis client: pip install -e '.[tiers]' in a checkout "
            f"(or leave it out: {instead})"
        )


def servers(
    stack: contextlib.ExitStack,
    cluster: bool,
    args: argparse.Namespace,
    result: dict[str, Any],
    started: dict[str, Any] | None = None,
    node_timeout_ms: int = 1000,
) -> dict[str, str]:
    """The server (and with ``cluster``, the cluster) to measure: given, or started here (then
    put in ``started``; a cluster with ``cluster-node-timeout`` ``node_timeout_ms``) and stopped
    by ``stack``. Each is checked once: unreachable or refusing is a ``Fatal`` now."""
    import redis
    from redis.utils import HIREDIS_AVAILABLE

    from kvoffload.store.tiers.local_server import LocalCluster, LocalServer

    result["valkey_client"] = {"redis": redis.__version__, "hiredis": HIREDIS_AVAILABLE}
    urls = {"one_server": args.valkey_url}
    if cluster:
        urls["cluster"] = args.cluster_url
    for name, url in urls.items():
        if url is None:
            try:
                made = (
                    LocalCluster(node_timeout_ms=node_timeout_ms)
                    if name == "cluster"
                    else LocalServer()
                )
            except FileNotFoundError as e:
                raise Fatal(f"{e}; or give --valkey-url / --cluster-url of a running one") from None
            stack.enter_context(made)
            urls[name] = made.url
            if started is not None:
                started[name] = made
            shape = "3 primaries + 3 replicas" if name == "cluster" else "one server"
            result[f"valkey_{name}"] = f"{server_version()}, {shape} on loopback (started here)"
        else:
            result[f"valkey_{name}"] = "given by URL"
        reachable(urls[name])
    return {k: v for k, v in urls.items() if v is not None}


def reachable(url: str) -> None:
    from kvoffload.store.tiers.base import TierStartupError
    from kvoffload.store.tiers.valkey import ValkeyTier

    quiet = logging.getLogger("kvoffload.store.tiers.valkey")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the one line below says it; not the tier's warning too
    try:
        tier = ValkeyTier(url, FP, 4096, timeout_s=5.0)
    except (TierStartupError, ValueError) as e:
        raise Fatal(str(e)) from None
    finally:
        quiet.setLevel(level)
    up = tier.up
    tier.close()
    if not up:
        raise Fatal(f"valkey at {url} is unreachable; start it, or give another URL")
