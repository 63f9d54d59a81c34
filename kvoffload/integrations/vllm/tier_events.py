"""What one lower tier has told vLLM it holds: its KV events (``BlockStored`` / ``BlockRemoved``).

vLLM turns each ``OffloadingEvent`` a tier returns from ``take_events()`` into its public KV events
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py``), which KV-cache-aware
routers read to send a request to the instance that can restore its prefix. ``Residency`` keeps
the set of keys this process announced as stored, so every key is announced once when it becomes
held and once when it is known gone, in the tier's own terms:

- ``stored``: a write the tier confirmed, or a read that verified the value (a block another
  process wrote, or one found on disk after a restart, is announced when this process first reads
  it or finds it already held).
- ``removed``: a key found gone (a read that missed, a checksum that failed, an eviction the
  caller detected), or a key not seen for ``expire_s`` (the Valkey TTL: the server has dropped
  it by then unless another instance used it), or the oldest key once ``max_keys`` are held.

Events carry ``ownership`` (the tier type, so a router can tell our disk tier from our Valkey tier,
both ``STORAGE``) and ``removal_expected=True``: vLLM's self-describing event tracker then keeps a
key's token metadata until our removal. Imports no torch; vLLM's event type only.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Iterable
from itertools import islice
from typing import Any

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

# OffloadingEvent fields differ between vLLM 0.32 and 0.33 (locality, ownership, removal_expected
# were added): only those this vLLM has are set.
_FIELDS = {f.name for f in dataclasses.fields(OffloadingEvent)}
MAX_KEYS = 1 << 20  # keys remembered as announced; past it the oldest is announced removed


class Residency:
    def __init__(
        self,
        medium: Medium,
        locality: Locality | None,
        ownership: str,
        expire_s: float | None = None,
        max_keys: int = MAX_KEYS,
    ) -> None:
        self.medium = medium
        self.extra: dict[str, Any] = {
            k: v
            for k, v in (
                ("locality", locality),
                ("ownership", ownership),
                ("removal_expected", True),
            )
            if k in _FIELDS
        }
        self.expire_s = expire_s
        self.max_keys = max_keys
        self.held: OrderedDict[OffloadKey, float] = OrderedDict()  # key -> last seen, oldest first
        self._events: list[OffloadingEvent] = []

    def stored(self, keys: Iterable[OffloadKey]) -> None:
        """``keys`` are held: announce those not announced yet, make all the newest."""
        now = time.monotonic()
        held = self.held
        new = []
        for key in keys:
            if key not in held:
                new.append(key)
            held[key] = now
            held.move_to_end(key)
        self._emit(new, removed=False)
        if len(held) > self.max_keys:
            self.removed(self.oldest(len(held) - self.max_keys))

    def seen(self, keys: Iterable[OffloadKey]) -> None:
        """``keys`` were used (read, touched): the newest again, where announced."""
        now = time.monotonic()
        held = self.held
        for key in keys:
            if key in held:
                held[key] = now
                held.move_to_end(key)

    def removed(self, keys: Iterable[OffloadKey]) -> None:
        gone = [k for k in keys if self.held.pop(k, None) is not None]
        self._emit(gone, removed=True)

    def oldest(self, count: int) -> list[OffloadKey]:
        return list(islice(self.held, count))

    def expire(self) -> None:
        """Announce removed the keys not seen for ``expire_s``."""
        if self.expire_s is None:
            return
        cutoff = time.monotonic() - self.expire_s
        old = []
        for key, seen in self.held.items():
            if seen > cutoff:
                break
            old.append(key)
        self.removed(old)

    def take(self) -> list[OffloadingEvent]:
        self.expire()
        events, self._events = self._events, []
        return events

    def _emit(self, keys: list[OffloadKey], removed: bool) -> None:
        if keys:
            self._events.append(
                OffloadingEvent(keys=keys, medium=self.medium, removed=removed, **self.extra)
            )
