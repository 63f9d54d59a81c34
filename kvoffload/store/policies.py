"""The eviction policies, by name: which READABLE block to give up first.

Both live in the native index (``kvoffload/store/native/lru.c`` and ``arc.c``; the Python models
they are tested against are in ``tests/policy_model.py``):

- ``lru``: least recently used (a hit or a load is a use).
- ``arc``: Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), adapted to a store with
  pinned blocks: T1 holds blocks seen once, T2 blocks seen again, B1/B2 remember recently evicted
  keys, and the target size of T1 adapts to which ghosts come back.

A policy only orders keys; the index owns slots and reference counts and skips pinned
candidates (a block being read is never evicted).
"""

POLICIES = ("arc", "lru")
