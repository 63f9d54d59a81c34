"""The eviction policies, by name: which READABLE block to give up first.

Both live in the native index (``kvoffload/store/native/lru.c`` and ``arc.c``; the Python models
they are tested against are in ``tests/policy_model.py``):

- ``lru``: least recently used (a hit or a load is a use).
- ``arc``: Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), adapted to a store with
  pinned blocks: T1 holds blocks seen once, T2 blocks seen again, B1/B2 remember recently evicted
  keys, and the target size of T1 adapts to which ghosts come back.

A policy only orders keys; the index owns slots and reference counts and skips pinned
candidates (a block being read is never evicted).

A store into a full arena takes exactly its victims' slots, and a load moves one pitched copy per
run of consecutive host slots and layer slice, so victims taken in exact policy order hand each
new prefix the scatter of the old ones (the arena fragments as a server runs). With a window
``w`` > 1 a store that must evict ``n`` blocks picks them among the policy's first
``n + min(n * (w - 1), num_slots // WINDOW_SHARE)`` evictable ones: the oldest not yet taken with
the rest of its run of consecutive candidate slots, until enough are, a longer run giving its
older end (``kvoffload/store/native/runs.c``; the Python model is ``tests/index_model.py``'s
``choose_runs``). The oldest block always goes, and the victims are never in more runs than the
exact order's. ``evict``, ``remove`` and ``reset`` keep the exact order.
"""

POLICIES = ("arc", "lru")
MAX_WINDOW = 1024  # the native index's IX_MAX_WINDOW
WINDOW_SHARE = 16  # a window reaches at most num_slots // 16 past the exact victims (ix.h)


def check_window(window: object, name: str | None = None) -> int:
    """``window`` as an eviction window (an int of 1 to ``MAX_WINDOW``); ValueError otherwise,
    naming the option ``name`` where given."""
    if not isinstance(window, int) or isinstance(window, bool) or not 1 <= window <= MAX_WINDOW:
        what = f"{name} to be an int" if name else "an eviction window"
        raise ValueError(f"expected {what} of 1 to {MAX_WINDOW}, got {window!r}")
    return window
