"""When a lower-tier hit is worth loading: only when it is expected to beat recomputing it.

A block a lower tier holds saves ``block_tokens`` tokens of prefill, but it first has to come up
from disk or Valkey. The rule, per lookup, for the blocks it would read up from each tier::

    load_s      = sum over tiers of blocks[tier] * block_bytes / read_rate[tier]
    recompute_s = sum of blocks * block_tokens / prefill_tokens_per_s
    take the load  iff  load_s < recompute_s

``read_rate`` is measured while running: every promotion (one lookup's reads from one tier) is
timed from its submit to its last block read and checked, on the mover's threads, so queueing
behind other reads and the round trips are in it; the rate is an exponentially weighted mean
(``EWMA``) of bytes over those seconds. ``prefill_tokens_per_s`` is what the engine reports
(``Offloader.report_prefill``, an EWMA too), starting from ``OffloadConfig.prefill_tokens_per_s``.
Without both figures (a tier never read yet, an engine that reports no prefill rate) the load is
taken: that is how a tier gets measured at all.

Every block costs ``block_bytes`` and saves ``block_tokens``, so for one tier the verdict does not
depend on the count: ``too_slow(tier)`` says it before any block is looked up. ``lower.py``
leaves such a tier out of lookups entirely (no tier I/O for a request that recomputes) and
re-measures it in the background at a bounded pace, so a tier that got faster is taken again.
"""

from __future__ import annotations

from collections.abc import Mapping

EWMA = 0.3  # weight of the newest measurement


class LoadRule:
    def __init__(
        self, block_bytes: int, block_tokens: int | None, prefill_tokens_per_s: float = 0.0
    ) -> None:
        if block_bytes <= 0 or prefill_tokens_per_s < 0:
            raise ValueError(
                f"expected block_bytes > 0 and prefill_tokens_per_s >= 0, got {block_bytes}, "
                f"{prefill_tokens_per_s}"
            )
        self.block_bytes = block_bytes
        self.block_tokens = block_tokens
        self.prefill_tokens_per_s = float(prefill_tokens_per_s)
        self.read_bytes_per_s: dict[str, float] = {}

    def prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` of prefill in ``seconds``."""
        if tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s = _mix(self.prefill_tokens_per_s, tokens / seconds)

    def read(self, tier: str, blocks: int, seconds: float) -> None:
        """``blocks`` came up from ``tier`` in ``seconds`` (submit to the last one checked)."""
        if blocks > 0 and seconds > 0:
            rate = blocks * self.block_bytes / seconds
            self.read_bytes_per_s[tier] = _mix(self.read_bytes_per_s.get(tier, 0.0), rate)

    def load_seconds(self, blocks: Mapping[str, int]) -> float | None:
        """Expected seconds to bring ``blocks[tier]`` up from each tier; None if unmeasured."""
        total = 0.0
        for tier, n in blocks.items():
            rate = self.read_bytes_per_s.get(tier, 0.0)
            if rate <= 0:
                return None
            total += n * self.block_bytes / rate
        return total

    def recompute_seconds(self, blocks: int) -> float | None:
        if not self.block_tokens or self.prefill_tokens_per_s <= 0:
            return None
        return blocks * self.block_tokens / self.prefill_tokens_per_s

    def worth(self, blocks: Mapping[str, int]) -> bool | None:
        """True: load them; False: recompute them; None: no figures yet (load, and measure)."""
        load = self.load_seconds(blocks)
        recompute = self.recompute_seconds(sum(blocks.values()))
        if load is None or recompute is None:
            return None
        return load < recompute

    def too_slow(self, tier: str) -> bool:
        """Whether no load from ``tier`` can beat recomputing: every block costs the same bytes
        and saves the same tokens, so this holds for any count (False while unmeasured)."""
        return self.worth({tier: 1}) is False

    def snapshot(self) -> dict[str, float]:
        out = {"prefill_tokens_per_s": self.prefill_tokens_per_s}
        for tier, rate in self.read_bytes_per_s.items():
            out[f"{tier}_read_MBps"] = rate / 1e6
        return out


def _mix(old: float, new: float) -> float:
    return new if old <= 0 else (1 - EWMA) * old + EWMA * new
