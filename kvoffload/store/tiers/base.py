"""The lower-tier contract: whole blocks as checksummed bytes below host RAM (torch-free).

Where a lower tier sits (the one place the flow is written down)::

    engine (GPU) <--TransferWorker--> host slot <--TierMover threads--> disk tier, Valkey tier

- A tier holds *whole host slots* (one block of every layer of a group) as opaque bytes keyed by
  block key, under one layout fingerprint: a tier built for one fingerprint never returns a block
  written under another (the fingerprint is in the disk path / Valkey key *and* in each header).
- Blocks go down by **write-behind**: when a store into a host slot completes, the scheduler pins
  the block (``BlockIndex.pin``: a reader that is not a load, so the slot cannot be evicted or
  reused) and the mover copies the slot into each tier on a background thread; the pin is released
  when the write finishes, successfully or not. Host eviction therefore never waits for a tier and
  never copies: the bytes already left, or (when the tiers fell behind) the block is simply lost
  from the lower tiers, which is a later miss. ``kvoffload.offload.lower`` says why, with numbers.
- Blocks come up by **promotion**: a lookup that finds the next keys in a tier reserves host slots
  for them (``prepare_store``: WRITING, so they are *pending*, not readable), the mover reads the
  tier's bytes into those slots and verifies them, and the store completes (READABLE, the normal
  load path follows) or rolls back (a miss). A slot is never readable before its checksum matched.

Threading and blocking: ``put``/``get``/``probe``/``discard`` may block (disk I/O, a network round
trip) and are only called on the mover's background threads, from any number of them at once;
``contains`` answers from memory and never blocks, so the scheduler may call it.

Failure is a miss, never an exception and never wrong bytes: an I/O error, a full or read-only
disk, a server that is down or slow, an evicted or expired key, a truncated or corrupt value all
make ``get`` return False (the slot's contents are then garbage and the caller rolls it back) and
``put`` return False; the tier logs a rate-limited warning and counts it in ``stats``. Only a
caller bug (a buffer of the wrong size) raises ValueError.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from kvoffload.store.keys import BlockKey


@dataclass
class TierStats:
    puts: int = 0  # blocks written
    put_bytes: int = 0  # payload bytes written
    put_failures: int = 0  # writes that failed (I/O error, full disk, server down or slow)
    put_skipped: int = 0  # writes not attempted (already held, too large, tier read-only/down)
    gets: int = 0  # blocks read and verified
    get_bytes: int = 0  # payload bytes read
    misses: int = 0  # reads of a block the tier did not have (never written, evicted, expired)
    corrupt: int = 0  # reads whose header or checksum did not match (the block is deleted)
    errors: int = 0  # reads that failed on I/O, a timeout or a connection error
    evictions: int = 0  # blocks the tier dropped to stay under its capacity
    reconnects: int = 0  # times the tier came back after being down
    refused: int = 0  # commands the server refused to this user (an ACL): misses, not retried
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        """Thread-safe ``+=`` of the named counters."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}


class TierStartupError(RuntimeError):
    """A tier's server refused this configuration at start-up (credentials, TLS, the kind of
    server): no retry fixes it, the configuration must change."""


class RateLimitedLog:
    """Log a message per kind at most once every ``every_s`` seconds, with a count of the rest.

    ``error`` (for a caught exception) gives the traceback with the first message of its kind
    only; later ones carry the count.
    """

    def __init__(self, log: logging.Logger, every_s: float = 10.0) -> None:
        self.log = log
        self.every_s = every_s
        self._last: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def warn(self, kind: str, msg: str, *args: object) -> None:
        self._emit(logging.WARNING, kind, msg, args)

    def error(self, kind: str, msg: str, *args: object) -> None:
        self._emit(logging.ERROR, kind, msg, args, traceback=True)

    def _emit(
        self, level: int, kind: str, msg: str, args: tuple[object, ...], traceback: bool = False
    ) -> None:
        now = time.monotonic()
        with self._lock:
            first = kind not in self._last
            last, quiet = self._last.get(kind, (-1e18, 0))
            if now - last < self.every_s:
                self._last[kind] = (last, quiet + 1)
                return
            self._last[kind] = (now, 0)
        suffix = f" ({quiet} more like it not logged)" if quiet else ""
        self.log.log(level, msg + suffix, *args, exc_info=traceback and first, stacklevel=3)


class Tier(ABC):
    """One lower tier for blocks of ``block_bytes`` under layout ``fingerprint``."""

    name: str = ""

    def __init__(self, fingerprint: str, block_bytes: int) -> None:
        if block_bytes <= 0:
            raise ValueError(f"expected block_bytes > 0, got {block_bytes}")
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self.stats = TierStats()

    @abstractmethod
    def put(self, keys: Sequence[BlockKey], payloads: Sequence[memoryview]) -> list[bool]:
        """Write each payload (``block_bytes`` each) under its key; True where it was stored or
        was already held. Blocking; never raises for I/O, network or data errors."""

    @abstractmethod
    def get(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> list[bool]:
        """Fill each ``out`` (writable, ``block_bytes``) with its key's verified payload; True
        where it did. Where False, ``out`` holds garbage the caller must not use. Blocking."""

    @abstractmethod
    def contains(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        """What the tier knows from memory, without blocking: True held (as far as it knows),
        False not held, None unknown (ask ``probe``)."""

    def probe(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Ask the tier itself (blocking) whether it holds ``keys``; False where it cannot say."""
        return [bool(c) for c in self.contains(keys)]

    @abstractmethod
    def discard(self, keys: Sequence[BlockKey]) -> None:
        """Drop ``keys`` if held. Blocking; never raises for I/O or network errors."""

    def close(self) -> None:
        return

    def _check_sizes(self, keys: Sequence[BlockKey], bufs: Sequence[memoryview]) -> None:
        if len(keys) != len(bufs):
            raise ValueError(f"expected one buffer per key ({len(keys)}), got {len(bufs)}")
        bad = [len(b) for b in bufs if len(b) != self.block_bytes]
        if bad:
            raise ValueError(
                f"expected buffers of {self.block_bytes} bytes for tier {self.name!r}, got {bad[0]}"
            )
