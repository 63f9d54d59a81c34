"""Connecting the shared tier: the redis client for one server or a cluster (checked once), the
errors that mean the server refused us, and the import of the client (torch-free)."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any, TypeVar

from kvoffload.store.tiers.base import TierStartupError
from kvoffload.store.tiers.endpoint import Credentials, TlsFiles, ValkeyEndpoint

PIPELINE_BYTES = 64 << 20  # per round trip; bounds the client's buffers
T = TypeVar("T")


def open_client(
    endpoint: ValkeyEndpoint,
    url: str,
    timeout_s: float,
    pool_size: int,
    credentials: Credentials,
    tls: TlsFiles,
) -> Any:
    """A client that has answered once (a cluster's every primary); raises what it met."""
    redis = import_redis()
    kwargs: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": redis.retry.Retry(redis.backoff.NoBackoff(), 0),
        "protocol": 2,  # RESP2: what the tier's own reader (resp.py) parses
    }
    if credentials.has_password:
        kwargs["credential_provider"] = credentials
    elif endpoint.username:
        kwargs["username"] = endpoint.username
    if endpoint.tls:  # verified: the CA (or the system's) and the host name
        kwargs.update(
            ssl_cert_reqs="required",
            ssl_check_hostname=True,
            ssl_ca_certs=tls.ca_file,
            ssl_certfile=tls.cert_file,
            ssl_keyfile=tls.key_file,
        )
    ep = endpoint
    if ep.cluster:
        cluster = redis.cluster
        client = cluster.RedisCluster(
            startup_nodes=[cluster.ClusterNode(host, port) for host, port in ep.seeds],
            require_full_coverage=True,
            max_connections=pool_size,
            ssl=ep.tls,
            **kwargs,
        )
        client.ping(target_nodes=cluster.RedisCluster.PRIMARIES)
        return client
    if ep.unix_path is not None:
        kwargs.update(connection_class=redis.UnixDomainSocketConnection, path=ep.unix_path)
    else:
        kwargs.update(
            connection_class=redis.SSLConnection if ep.tls else redis.Connection,
            host=ep.seeds[0][0],
            port=ep.seeds[0][1],
        )
    pool = redis.BlockingConnectionPool(
        max_connections=pool_size,
        timeout=timeout_s,  # waiting for a free connection
        db=ep.db,
        **kwargs,
    )
    client = redis.Redis(connection_pool=pool)
    client.ping()
    try:
        client.execute_command("CLUSTER", "MYID")
    except redis.ResponseError:  # cluster support disabled (or not ours to ask): as expected
        return client
    client.close()
    pool.disconnect()
    raise TierStartupError(
        f"valkey tier: {url} is a node of a Valkey/Redis Cluster; name its nodes with "
        "redis+cluster://host:port[,host:port...] (rediss+cluster:// for TLS)"
    )


def import_redis() -> Any:
    try:
        import redis
    except ImportError:
        raise ImportError(
            "the Valkey tier needs the redis client: pip install -e '.[tiers]' in a checkout "
            "(bash .ci/tiers.sh installs it with a server)"
        ) from None
    return redis


def refusal(error: BaseException) -> str | None:
    """Why the server turned us away, where retrying cannot help; None when it just did not
    answer (down, unreachable, timed out)."""
    exceptions = import_redis().exceptions

    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, TierStartupError):
            return str(e).removeprefix("valkey tier: ")
        if isinstance(e, ssl.SSLError):
            return (
                f"refused the TLS handshake ({e}; a server that requires a client certificate "
                "needs valkey_tls_cert_file)"
            )
        if isinstance(e, exceptions.AuthenticationError):
            return f"refused the credentials ({e})"
        if isinstance(e, exceptions.NoPermissionError):
            return f"refused a command the tier needs to this user ({e}); see docs/tiers.md"
        if "Cluster mode is not enabled" in str(e):
            return "is not a cluster node: use redis:// (rediss:// for TLS)"
        e = e.__cause__ or e.__context__
    return None


def batches(items: list[T], size: Callable[[T], int]) -> list[list[T]]:
    out: list[list[T]] = []
    acc = 0
    for item in items:
        if not out or acc + size(item) > PIPELINE_BYTES:
            out.append([])
            acc = 0
        out[-1].append(item)
        acc += size(item)
    return out
