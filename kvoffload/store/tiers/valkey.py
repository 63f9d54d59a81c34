"""The shared tier on Valkey (or Redis): one binary value per block, for many engine instances.

Key: ``b"kvoffload:" + 16-byte layout fingerprint + block key``; value: the block's header, key
and payload (``payload.py``), so a value read back is checked against the fingerprint, the key and
the payload checksum before a byte of it reaches a host slot. Values expire after ``ttl_s`` (a
hit refreshes the TTL with ``GETEX``); values over ``max_value_bytes`` are not stored. The server's
own ``maxmemory`` and ``maxmemory-policy allkeys-lru`` bound the total (see ``docs/tiers.md``).

Reads and writes go in pipelines of up to ``PIPELINE_BYTES`` (one round trip per batch), over a
blocking pool of at most ``pool_size`` connections shared by the mover's threads, with
``timeout_s`` on connect and on every socket read. redis-py's own retries are turned off: a
failure is reported at once as a miss.

Down, slow or evicted: a connection error or a timeout marks the tier *down*: every call returns
a miss immediately (counted ``put_skipped`` / ``errors``) instead of waiting for another timeout,
and one background thread pings the server (every 0.5 s, backing off to 5 s) until it answers,
then marks the tier up again (``reconnects``). An absent key (never stored, expired, evicted by
the server) is ``misses``; a value that fails its checks is ``corrupt`` and is deleted.

``contains`` answers from a small in-process memory of what this process wrote, probed or read
(positive answers kept 30 s, negative 1 s, so a block another instance stores becomes visible
within a second); unknown keys are None, for the caller to ``probe`` (one pipelined ``EXISTS``).
While the tier is down, ``contains`` says False for every key: nothing is probed or read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from kvoffload.store.keys import BlockKey
from kvoffload.store.tiers.base import RateLimitedLog, Tier
from kvoffload.store.tiers.payload import (
    CorruptBlock,
    check_payload,
    fingerprint_bytes,
    pack_header,
    parse_header,
)

log = logging.getLogger(__name__)

PIPELINE_BYTES = 64 << 20  # per round trip; bounds the client's buffers
KNOWN_PRESENT_S = 30.0  # how long a "held" answer is trusted (a later GET may still miss)
KNOWN_ABSENT_S = 1.0  # how long a "not held" answer is trusted (another instance may store it)
RECONNECT_FIRST_S, RECONNECT_MAX_S = 0.5, 5.0
T = TypeVar("T")
_Cmd = tuple[str, tuple[Any, ...], dict[str, Any]]


class ValkeyTier(Tier):
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
    ) -> None:
        super().__init__(fingerprint, block_bytes)
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ImportError(
                "the Valkey tier needs the redis client: pip install 'kvoffload[tiers]'"
            ) from None
        if ttl_s < 0 or max_value_bytes <= 0 or timeout_s <= 0 or pool_size <= 0:
            raise ValueError(
                "expected ttl_s >= 0, max_value_bytes > 0, timeout_s > 0 and pool_size > 0, got "
                f"{ttl_s}, {max_value_bytes}, {timeout_s}, {pool_size}"
            )
        self.url = url
        self.ttl_s = ttl_s
        self.max_value_bytes = max_value_bytes
        self._fp = fingerprint_bytes(fingerprint)
        self._prefix = b"kvoffload:" + self._fp
        self._errors: tuple[type[BaseException], ...] = (
            redis.ConnectionError,
            redis.TimeoutError,
            OSError,
        )
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=pool_size,
            timeout=timeout_s,  # waiting for a free connection
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._client = redis.Redis(connection_pool=pool)
        self._warn = RateLimitedLog(log)
        self._known: dict[BlockKey, tuple[bool, float]] = {}
        self._up = threading.Event()
        self._up.set()
        self._closed = threading.Event()
        self._reconnecting = threading.Lock()

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
            todo.append((i, b"".join((head, payload))))
        ex = self.ttl_s or None
        for batch in _batches(todo, lambda item: len(item[1])):
            replies = self._pipeline(
                [("set", (self._name(keys[i]), v), {"ex": ex}) for i, v in batch], "put"
            )
            if replies is None:
                continue
            for (i, _), reply in zip(batch, replies, strict=True):
                if reply is True:
                    ok[i] = True
                    self._remember(keys[i], True)
                    self.stats.add(puts=1, put_bytes=self.block_bytes)
                else:
                    self.stats.add(put_failures=1)
                    self._warn.warn("put", "valkey tier: SET failed: %s", reply)
        return ok

    def get(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> list[bool]:
        self._check_sizes(keys, outs)
        ok = [False] * len(keys)
        per_batch = max(1, PIPELINE_BYTES // self.block_bytes)
        for start in range(0, len(keys), per_batch):
            batch = keys[start : start + per_batch]
            if self.ttl_s:  # a hit refreshes the TTL
                cmds = [("getex", (self._name(k),), {"ex": self.ttl_s}) for k in batch]
            else:
                cmds = [("get", (self._name(k),), {}) for k in batch]
            replies = self._pipeline(cmds, "get")
            if replies is None:
                continue
            for j, (key, value) in enumerate(zip(batch, replies, strict=True)):
                ok[start + j] = self._accept(key, value, outs[start + j])
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
        replies = self._pipeline([("exists", (self._name(k),), {}) for k in keys], "probe")
        # No answer counts as "not held": not asked again for KNOWN_ABSENT_S.
        held = [False] * len(keys) if replies is None else [r == 1 for r in replies]
        for key, h in zip(keys, held, strict=True):
            self._remember(key, h)
        return held

    def discard(self, keys: Sequence[BlockKey]) -> None:
        if keys:
            self._pipeline([("delete", (self._name(k),), {}) for k in keys], "discard")
            for key in keys:
                self._remember(key, False)

    def close(self) -> None:
        self._closed.set()
        self._client.close()
        self._client.connection_pool.disconnect()

    @property
    def up(self) -> bool:
        return self._up.is_set()

    # -- helpers ------------------------------------------------------------------------------

    def _name(self, key: BlockKey) -> bytes:
        return self._prefix + key

    def _remember(self, key: BlockKey, held: bool) -> None:
        if len(self._known) > 1 << 20:  # bound the memory; stale answers only cost a probe
            self._known.clear()
        self._known[key] = (held, time.monotonic() + (KNOWN_PRESENT_S if held else KNOWN_ABSENT_S))

    def _accept(self, key: BlockKey, value: Any, out: memoryview) -> bool:
        if value is None:
            self.stats.add(misses=1)
            self._remember(key, False)
            return False
        if isinstance(value, Exception):  # this command failed on the server (raise_on_error=False)
            self.stats.add(errors=1)
            self._warn.warn("get", "valkey tier: GET failed: %s", value)
            return False
        try:
            header = parse_header(value, self._fp, key)
            payload = memoryview(value)[header.nbytes :]
            check_payload(header, payload)
        except CorruptBlock as e:
            self.stats.add(corrupt=1)
            self._warn.warn("corrupt", "valkey tier: value unusable (%s), treated as a miss", e)
            self.discard([key])
            return False
        np.frombuffer(out, dtype=np.uint8)[:] = np.frombuffer(payload, dtype=np.uint8)
        self._remember(key, True)
        self.stats.add(gets=1, get_bytes=len(payload))
        return True

    def _pipeline(self, cmds: list[_Cmd], what: str) -> list[Any] | None:
        """Run ``(method, args, kwargs)`` commands in one round trip; None (counted) when the tier
        is down or the round trip failed. A command that failed on the server comes back as its
        exception in the list."""
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
                    self._client.ping()
                except self._errors:
                    delay = min(RECONNECT_MAX_S, delay * 2)
                    continue
                self.stats.add(reconnects=1)
                log.info("valkey tier: %s is back", self.url)
                self._up.set()
                return
        finally:
            self._reconnecting.release()


def _batches(items: list[T], size: Callable[[T], int]) -> list[list[T]]:
    out: list[list[T]] = []
    acc = 0
    for item in items:
        if not out or acc + size(item) > PIPELINE_BYTES:
            out.append([])
            acc = 0
        out[-1].append(item)
        acc += size(item)
    return out
