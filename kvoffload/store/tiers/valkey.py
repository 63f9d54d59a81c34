"""The shared tier on Valkey (or Redis), one server or a cluster: a binary value per block.

Key: ``kvoffload:<namespace>:v<format>:<fingerprint hex>:{<xxh3-64 hex of the block key>}`` then
the block key. The namespace (tenant) comes first so an ACL can confine a tenant's user to
``~kvoffload:<namespace>:*``; the format version keeps two kvoffload versions from reading (and
deleting) each other's values; the braces are a per-block cluster hash tag, so the binary bytes of
a key never form an accidental tag that would pin many blocks to one slot. Value: the block's
header, key and payload (``payload.py``), so a value read back is checked against the
fingerprint, the key and the payload checksum before a byte of it reaches a host slot. Values
expire after ``ttl_s`` (a hit refreshes the TTL with ``GETEX``); values over ``max_value_bytes``
are not stored. The servers' own ``maxmemory`` and ``maxmemory-policy`` bound the total
(``docs/tiers.md`` says why kvoffload cannot count a tenant's bytes across nodes).

Reads and writes go in pipelines of up to ``PIPELINE_BYTES``, sent and read by the tier itself
(``valkey_wire.py``): values land in their host slots and leave from them without copies. A batch
costs one round trip per server (per primary it touches on a cluster, the primaries served at
once), whatever its length. Replies that redirect (MOVED/ASK/TRYAGAIN) or say the cluster is down
are redone through the client, which follows them and refreshes its slot map (also after a
connection error: a failover); with its retries off, a failure is reported at once as a miss.
``timeout_s`` bounds connecting and every socket read; ``pool_size`` connections per server (per
node on a cluster) are shared by the mover's threads.

Start-up: the constructor connects once. Credentials or a TLS handshake the server refuses, or a
URL of the wrong kind for the server (cluster or not), raise ``TierStartupError``: no retry fixes
them. A server that does not answer only logs a warning: the tier starts *down* and comes up when
it answers.

Down, slow or failing over: a connection error, a timeout or CLUSTERDOWN marks the tier *down*:
every call returns a miss immediately (counted ``put_skipped`` / ``errors``) instead of waiting
for another timeout, and one background thread checks the server (every 0.5 s, backing off to
5 s; on a cluster it refreshes the slot map and pings every primary) until it answers, then marks
the tier up again (``reconnects``). After a primary dies, the tier is down until its replica has
taken over (about ``cluster-node-timeout`` plus an election).

Values that cannot be blocks: an absent key (never stored, expired, evicted by the server) is
``misses``. A key under our prefix that holds something else (another type, a string of the wrong
length, a failed header or checksum) is ours to delete: it is counted ``corrupt``, deleted, and
remembered as absent. A key the server refuses to this user (an ACL, NOPERM) is ``refused`` and
remembered as absent. Neither is asked for again before ``KNOWN_BAD_S``.

``contains`` answers from a small in-process memory of what this process wrote, probed or read
(held: 30 s, absent: 1 s, so a block another instance stores becomes visible within a second);
unknown keys are None, for the caller to ``probe`` (one pipelined ``STRLEN``, which also tells a
value of the right size from anything else). While the tier is down, ``contains`` says False for
every key: nothing is probed or read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash

from kvoffload.store.keys import BlockKey
from kvoffload.store.tiers import resp
from kvoffload.store.tiers.base import RateLimitedLog, Tier, TierStartupError
from kvoffload.store.tiers.endpoint import (
    Credentials,
    TlsFiles,
    check_namespace,
    parse_valkey_url,
    redact_url,
)
from kvoffload.store.tiers.payload import (
    FORMAT_VERSION,
    HEADER_BYTES,
    CorruptBlock,
    check_payload,
    fingerprint_bytes,
    pack_header,
    parse_header,
)
from kvoffload.store.tiers.valkey_connect import (
    PIPELINE_BYTES,
    batches,
    import_redis,
    open_client,
    refusal,
)
from kvoffload.store.tiers.valkey_wire import Wire

log = logging.getLogger(__name__)

KNOWN_PRESENT_S = 30.0  # how long a "held" answer is trusted (a later GET may still miss)
KNOWN_ABSENT_S = 1.0  # how long a "not held" answer is trusted (another instance may store it)
KNOWN_BAD_S = 30.0  # how long a key that held no block, or was refused, is not asked for again
RECONNECT_FIRST_S, RECONNECT_MAX_S = 0.5, 5.0
MAX_TIMEOUT_S = 86400.0  # a socket timeout must fit the OS (inf or 1e12 overflow); a day is plenty
_Cmd = tuple[str, tuple[Any, ...], dict[str, Any]]


class ValkeyTier(Tier):
    """The shared tier. ``url`` is one of ``endpoint.URL_FORMS``; the keyword arguments are the
    ``OffloadConfig`` options of the same name without the ``valkey_`` prefix (``build_tiers``
    passes them on). Raises ValueError for bad arguments, ``TierStartupError`` when the server
    refuses the credentials or the TLS handshake."""

    name = "valkey"

    def __init__(
        self,
        url: str,
        fingerprint: str,
        block_bytes: int,
        ttl_s: int = 3600,
        max_value_bytes: int = 64 << 20,
        timeout_s: float = 0.5,
        pool_size: int = 8,
        *,
        namespace: str = "default",
        password_env: str | None = None,
        password_file: str | None = None,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
    ) -> None:
        super().__init__(fingerprint, block_bytes)
        redis = import_redis()
        if (
            ttl_s < 0
            or max_value_bytes <= 0
            or pool_size <= 0
            or not 0 < timeout_s <= MAX_TIMEOUT_S
        ):
            raise ValueError(
                f"expected ttl_s >= 0, max_value_bytes > 0, 0 < timeout_s <= {MAX_TIMEOUT_S} and "
                f"pool_size > 0, got {ttl_s}, {max_value_bytes}, {timeout_s}, {pool_size}"
            )
        self.endpoint = parse_valkey_url(url)
        self.namespace = check_namespace(namespace)
        self._tls = TlsFiles(tls_ca_file, tls_cert_file, tls_key_file)
        self._tls.check(self.endpoint.tls)
        self._tls.check_readable()
        self._credentials = Credentials(self.endpoint.username, password_env, password_file)
        self._credentials.check()
        if self._credentials.has_password:
            self._credentials.read_password()  # ValueError now, not at the first connection
        self.url = redact_url(url)  # for messages; parse_valkey_url refused any password
        self.ttl_s = ttl_s
        self.max_value_bytes = max_value_bytes
        self.timeout_s = timeout_s
        self.pool_size = pool_size
        self._fp = fingerprint_bytes(fingerprint)
        self._prefix = f"kvoffload:{namespace}:v{FORMAT_VERSION}:{self._fp.hex()}:".encode()
        self._errors: tuple[type[BaseException], ...] = (
            redis.ConnectionError,
            redis.TimeoutError,
            redis.exceptions.ClusterDownError,
            redis.exceptions.RedisClusterException,
            OSError,
        )
        # Replies the client redoes itself (as it did every command before the tier sent its
        # own): a slot moving between nodes (it follows the node named and updates its slot
        # map), a cluster briefly down (it refreshes the map and retries before giving up).
        self._redirects = (
            redis.exceptions.MovedError,
            redis.exceptions.AskError,
            redis.exceptions.TryAgainError,
            redis.exceptions.ClusterDownError,
        )
        # What connecting may meet: the errors above or a refusal (_refusal says which; a
        # refusal at start-up raises, the reconnect thread retries: the operator may fix it).
        self._connect_errors = (*self._errors, redis.RedisError)
        self._warn = RateLimitedLog(log)
        self._known: dict[BlockKey, tuple[bool, float]] = {}
        self._up = threading.Event()
        self._closed = threading.Event()
        self._reconnecting = threading.Lock()
        self._client: Any = None
        # A cluster's nodes' replies are read at once, on these threads (valkey_wire.py).
        self._readers = (
            ThreadPoolExecutor(8, thread_name_prefix="kvoffload-valkey-read")
            if self.endpoint.cluster
            else None
        )
        try:
            self._client = self._open()
        except self._connect_errors as e:
            reason = refusal(e)
            if reason is not None:
                raise TierStartupError(f"valkey tier: {self.url} {reason}") from None
            self._warn.warn(
                "down",
                "valkey tier: %s unreachable at start-up (%s); misses until it answers "
                "(a TLS-only port resets plain-text connections: use rediss://)",
                self.url,
                e,
            )
            self._mark_down()
        else:
            self._up.set()

    # -- the contract -------------------------------------------------------------------------

    def put(self, keys: Sequence[BlockKey], payloads: Sequence[memoryview]) -> list[bool]:
        self._check_sizes(keys, payloads)
        ok = [False] * len(keys)
        todo = []
        for i, (key, payload) in enumerate(zip(keys, payloads, strict=True)):
            head = pack_header(self._fp, key, payload)
            if len(head) + len(payload) > self.max_value_bytes:
                self.stats.add(put_skipped=1)
                continue
            todo.append((i, head))
        ex = self.ttl_s
        ex_kw = {"ex": ex or None}
        for batch in batches(todo, lambda item: len(item[1]) + self.block_bytes):
            names = [self.key_name(keys[i]) for i, _ in batch]
            replies = self._send(
                "put",
                names,
                [
                    resp.set_pieces(name, h, payloads[i], ex)
                    for name, (i, h) in zip(names, batch, strict=True)
                ],
            )
            if replies is None:
                continue
            redo = [j for j, reply in enumerate(replies) if isinstance(reply, self._redirects)]
            if redo:  # a slot moving: the client follows the redirection
                again = self._pipeline(
                    [
                        ("set", (names[j], b"".join((batch[j][1], payloads[batch[j][0]]))), ex_kw)
                        for j in redo
                    ],
                    "put",
                )
                for j, reply in zip(redo, again or [None] * len(redo), strict=True):
                    replies[j] = reply if again is not None else False
            for (i, _), reply in zip(batch, replies, strict=True):
                if reply is True:
                    ok[i] = True
                    self._remember(keys[i], True)
                    self.stats.add(puts=1, put_bytes=self.block_bytes)
                elif reply is not False:  # False: the redo found the tier down (counted)
                    self.stats.add(put_failures=1)
                    self._failed_reply(keys[i], reply, "SET", read=False)
        return ok

    def get(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> list[bool]:
        self._check_sizes(keys, outs)
        ok = [False] * len(keys)
        per_batch = max(1, PIPELINE_BYTES // self.block_bytes)
        for start in range(0, len(keys), per_batch):
            batch = keys[start : start + per_batch]
            bouts = outs[start : start + per_batch]
            names = [self.key_name(k) for k in batch]
            heads = [memoryview(bytearray(HEADER_BYTES + len(k))) for k in batch]
            replies = self._send(
                "get",
                names,
                [(self._get_command(name),) for name in names],
                list(zip(heads, bouts, strict=True)),
            )
            if replies is None:
                continue
            redo = [j for j, reply in enumerate(replies) if isinstance(reply, self._redirects)]
            if redo:  # through the client, which follows them; values come back as bytes
                again = self._pipeline([self._get_cmd(names[j]) for j in redo], "get")
                for j, value in zip(redo, again or [False] * len(redo), strict=True):
                    replies[j] = value  # False: the tier went down (counted)
            for j, (key, reply) in enumerate(zip(batch, replies, strict=True)):
                if reply is True:
                    ok[start + j] = self._check(key, heads[j], bouts[j])
                elif reply is False:
                    continue
                elif isinstance(reply, int):
                    self._unusable(key, f"a value of {reply} bytes, not {self._value_bytes(key)}")
                else:
                    ok[start + j] = self._accept(key, reply, bouts[j])
        return ok

    def contains(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        if not self._up.is_set():
            return [False] * len(keys)  # down: every read would be a miss anyway
        now = time.monotonic()
        known = self._known
        out: list[bool | None] = []
        for key in keys:
            entry = known.get(key)
            out.append(entry[0] if entry is not None and entry[1] > now else None)
        return out

    def probe(self, keys: Sequence[BlockKey]) -> list[bool]:
        replies = self._pipeline([("strlen", (self.key_name(k),), {}) for k in keys], "probe")
        held = [False] * len(keys)
        for i, key in enumerate(keys):
            reply = None if replies is None else replies[i]
            if reply == self._value_bytes(key):
                held[i] = True
                self._remember(key, True)
            elif reply is None or reply == 0:  # no answer, or no such key
                self._remember(key, False)
            elif isinstance(reply, int):
                self._unusable(key, f"a value of {reply} bytes, not {self._value_bytes(key)}")
            else:
                self._failed_reply(key, reply, "STRLEN", read=False)
        return held

    def discard(self, keys: Sequence[BlockKey]) -> None:
        if keys:
            self._pipeline([("delete", (self.key_name(k),), {}) for k in keys], "discard")
            for key in keys:
                self._remember(key, False)

    def close(self) -> None:
        self._closed.set()
        if self._readers is not None:
            self._readers.shutdown(wait=False)
        if self._client is not None:
            self._client.close()
            if not self.endpoint.cluster:
                self._client.connection_pool.disconnect()

    @property
    def up(self) -> bool:
        return self._up.is_set()

    def key_name(self, key: BlockKey) -> bytes:
        """The server-side name of ``key``'s value (what an ACL key pattern matches)."""
        return b"%s{%s}%s" % (self._prefix, xxhash.xxh3_64_hexdigest(key).encode(), key)

    # -- connecting ---------------------------------------------------------------------------

    def _open(self) -> Any:
        """A client that has answered once (a cluster's every primary); raises what it met."""
        return open_client(
            self.endpoint, self.url, self.timeout_s, self.pool_size, self._credentials, self._tls
        )

    def _check_up(self) -> None:
        if self._client is None:
            self._client = self._open()
        elif self.endpoint.cluster:
            self._client.nodes_manager.initialize()  # the slot map as the cluster has it now
            self._client.ping(target_nodes=self._client.PRIMARIES)
        else:
            self._client.ping()

    # -- replies ------------------------------------------------------------------------------

    def _value_bytes(self, key: BlockKey) -> int:
        return HEADER_BYTES + len(key) + self.block_bytes

    def _remember(self, key: BlockKey, held: bool, for_s: float | None = None) -> None:
        if len(self._known) > 1 << 20:  # bound the memory; stale answers only cost a probe
            self._known.clear()
        if for_s is None:
            for_s = KNOWN_PRESENT_S if held else KNOWN_ABSENT_S
        self._known[key] = (held, time.monotonic() + for_s)

    def _get_command(self, name: bytes) -> bytes:
        if self.ttl_s:  # a hit refreshes the TTL
            return resp.pack(b"GETEX", name, b"EX", self.ttl_s)
        return resp.pack(b"GET", name)

    def _check(self, key: BlockKey, head: memoryview, out: memoryview) -> bool:
        """A value read into ``head`` and ``out`` (its host slot): a block only if it checks."""
        try:
            check_payload(parse_header(head, self._fp, key), out)
        except CorruptBlock as e:
            self._unusable(key, str(e))
            return False
        self._remember(key, True)
        self.stats.add(gets=1, get_bytes=len(out))
        return True

    def _get_cmd(self, name: bytes) -> _Cmd:  # _get_command, for the client's pipeline
        return ("getex", (name,), {"ex": self.ttl_s}) if self.ttl_s else ("get", (name,), {})

    def _send(
        self,
        what: str,
        names: list[bytes],
        commands: list[Any],
        into: list[tuple[memoryview, memoryview]] | None = None,
    ) -> list[Any] | None:
        """``Wire.run`` with the accounting of ``_pipeline``: None (counted) when the tier is
        down or the batch failed on a connection."""
        n = len(names)
        if not self._up.is_set():
            self.stats.add(**{"put_skipped" if what == "put" else "errors": n})
            return None
        try:
            wire = Wire(self._client, self.endpoint.cluster, self._readers)
            return wire.run(names, commands, into)
        except self._errors as e:
            self.stats.add(**{"put_failures" if what == "put" else "errors": n})
            self._warn.warn(
                "down", "valkey tier: %s unreachable (%s); misses until it is back", self.url, e
            )
            self._mark_down()
            return None

    def _accept(self, key: BlockKey, value: Any, out: memoryview) -> bool:
        if value is None:
            self.stats.add(misses=1)
            self._remember(key, False)
            return False
        if isinstance(value, Exception):  # this command failed on the server
            self._failed_reply(key, value, "GET", read=True)
            return False
        try:
            header = parse_header(value, self._fp, key)
            payload = memoryview(value)[header.nbytes :]
            check_payload(header, payload)
        except CorruptBlock as e:
            self._unusable(key, str(e))
            return False
        np.frombuffer(out, dtype=np.uint8)[:] = np.frombuffer(payload, dtype=np.uint8)
        self._remember(key, True)
        self.stats.add(gets=1, get_bytes=len(payload))
        return True

    def _unusable(self, key: BlockKey, why: str) -> None:
        """A value under our prefix that is no block of ours: delete it, do not ask again."""
        self.stats.add(corrupt=1)
        self._warn.warn("corrupt", "valkey tier: value unusable (%s), deleted; a miss", why)
        self.discard([key])
        self._remember(key, False, KNOWN_BAD_S)

    def _failed_reply(self, key: BlockKey, reply: Any, command: str, read: bool) -> None:
        """One command's error reply (or a non-OK reply to SET); a failed ``read`` counts as
        ``errors`` unless the value was unusable or refused."""
        text = str(reply)
        if isinstance(reply, import_redis().exceptions.NoPermissionError):
            self.stats.add(refused=1)
            self._warn.warn("refused", "valkey tier: %s refused (%s); a miss", command, text)
            self._remember(key, False, KNOWN_BAD_S)
            return
        if text.startswith("WRONGTYPE"):
            self._unusable(key, "a value of another type")
            return
        self.stats.add(errors=int(read))
        if isinstance(reply, self._errors):  # a node went away mid-batch, or a failover
            self._warn.warn("down", "valkey tier: %s unreachable (%s); misses", self.url, text)
            self._mark_down()
        else:
            self._warn.warn(command, "valkey tier: %s failed: %s", command, text)
            self._remember(key, False)

    def _pipeline(self, cmds: list[_Cmd], what: str) -> list[Any] | None:
        """Run ``(method, args, kwargs)`` commands in one round trip per server; None (counted)
        when the tier is down or the round trip failed. A command that failed on the server
        comes back as its exception in the list."""
        n = len(cmds)
        if not self._up.is_set():
            if what == "put":
                self.stats.add(put_skipped=n)
            elif what == "get":
                self.stats.add(errors=n)
            return None
        try:
            pipe = self._client.pipeline(transaction=False)
            for method, args, kwargs in cmds:
                getattr(pipe, method)(*args, **kwargs)
            replies: list[Any] = pipe.execute(raise_on_error=False)
        except self._errors as e:
            if what == "put":
                self.stats.add(put_failures=n)
            elif what == "get":
                self.stats.add(errors=n)
            self._warn.warn(
                "down", "valkey tier: %s unreachable (%s); misses until it is back", self.url, e
            )
            self._mark_down()
            return None
        return replies

    def _mark_down(self) -> None:
        self._up.clear()
        if self._reconnecting.acquire(blocking=False):
            threading.Thread(
                target=self._reconnect, name="kvoffload-valkey-reconnect", daemon=True
            ).start()

    def _reconnect(self) -> None:
        try:
            delay = RECONNECT_FIRST_S
            while not self._closed.wait(delay):
                try:
                    self._check_up()
                except (*self._connect_errors, ValueError, TierStartupError) as e:
                    reason = refusal(e)
                    if reason is not None:
                        self._warn.warn("refused", "valkey tier: %s %s", self.url, reason)
                    delay = min(RECONNECT_MAX_S, delay * 2)
                    continue
                self.stats.add(reconnects=1)
                log.info("valkey tier: %s is back", self.url)
                self._up.set()
                return
        finally:
            self._reconnecting.release()
