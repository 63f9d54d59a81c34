"""The shared tier's data path: pipelined GETs straight into host slots and SETs straight from
them, on sockets borrowed from the redis client's pools (torch-free).

One batch is split by the node that owns each key (one group on a single server; on a cluster,
the slot map the client keeps). Each group takes a connection from its node's pool, writes all
its commands in one packed send, then reads its replies in order (``resp.Reader``): one round
trip per node. A GET's value is read with ``recv_into`` into its block's small head buffer and
then into its host slot, so the payload is copied once, by the kernel, with the GIL released. A
SET's payload is sent from the host slot as it is. On a cluster the groups run at once, on the
tier's ``readers`` threads and the caller's, so every primary sends (or takes) its share at the
same time; several mover threads run batches at once on different connections.

Errors: a reply that is a redirection (``MOVED``/``ASK``, a resharding) or ``TRYAGAIN`` comes back
as its exception for the caller to redo through the client, which follows it and updates its slot
map. Any other error reply comes back as its exception. A connection error, timeout or protocol
surprise raises (``OSError``, or the client's ``ConnectionError``/``TimeoutError``) after every
connection the batch used is dropped (its state is unknown) and returned to its pool.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

from kvoffload.store.tiers import resp

Pieces = Sequence[bytes | memoryview]  # one command, as sent


def parse_error(text: str) -> Exception:
    """The client's exception for an error reply (NOPERM, MOVED, CLUSTERDOWN, ...)."""
    from redis._parsers.base import BaseParser

    error: Exception = BaseParser.parse_error(text)  # type: ignore[no-untyped-call]
    return error


class Wire:
    """Batches on ``client`` (a ``redis.Redis`` on a pool, or a ``redis.cluster.RedisCluster``)."""

    def __init__(self, client: Any, cluster: bool, readers: Executor | None = None) -> None:
        """``readers``: threads that serve the other nodes while this thread serves the first
        (a cluster); None: one node after another."""
        self.client = client
        self.cluster = cluster
        self.readers = readers

    def _pool(self, name: bytes) -> Any:
        if not self.cluster:
            return self.client.connection_pool
        node = self.client.nodes_manager.get_node_from_slot(self.client.keyslot(name))
        return self.client.get_redis_connection(node).connection_pool

    def run(
        self,
        names: Sequence[bytes],
        commands: Sequence[Pieces],
        into: Sequence[tuple[memoryview, memoryview]] | None = None,
    ) -> list[Any]:
        """Send ``commands[i]`` (about ``names[i]``) to its node for every i, then read the
        replies, in the order of ``names``: with ``into``, each a bulk string read into
        ``into[i]`` (``Reader.bulk_into``), else small replies (``Reader.reply``)."""
        groups: dict[int, tuple[Any, list[int]]] = {}
        for i, name in enumerate(names):
            pool = self._pool(name)
            groups.setdefault(id(pool), (pool, []))[1].append(i)
        taken: list[tuple[Any, Any]] = []
        replies: list[Any] = [None] * len(names)

        def node(pool: Any, idx: list[int]) -> None:
            """One node's share: one packed write, then its replies in order."""
            conn = pool.get_connection()
            taken.append((pool, conn))
            conn.send_packed_command(
                resp.coalesce([p for i in idx for p in commands[i]]), check_health=False
            )
            sock: socket.socket | None = conn._sock
            if sock is None:
                raise resp.ProtocolError("the client's connection has no socket")
            reader = resp.Reader(sock)
            for i in idx:
                if into is None:
                    replies[i] = reader.reply(parse_error)
                else:
                    replies[i] = reader.bulk_into(*into[i], parse_error)
            if reader.buffered:
                raise resp.ProtocolError(f"{reader.buffered} bytes past the last reply")

        clean = False
        try:
            self._each(node, list(groups.values()))
            clean = True
        finally:
            for pool, conn in taken:
                if not clean:
                    conn.disconnect()
                pool.release(conn)
        return replies

    def _each(self, fn: Any, jobs: list[tuple[Any, list[int]]]) -> None:
        """``fn(*job)`` for every job: at once on the ``readers`` (and this thread) where there
        are several; every call has ended (socket timeouts bound each) before the first error
        is raised."""
        if self.readers is None or len(jobs) == 1:
            for job in jobs:
                fn(*job)
            return
        others = [self.readers.submit(fn, *job) for job in jobs[1:]]
        errors: list[BaseException] = []
        try:
            fn(*jobs[0])
        except BaseException as e:  # noqa: BLE001 (raised below, once the other calls ended)
            errors.append(e)
        for future in others:
            try:
                future.result()
            except BaseException as e:  # noqa: BLE001 (likewise)
                errors.append(e)
        if errors:
            raise errors[0]
