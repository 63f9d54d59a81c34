"""Which requests' blocks the runner sends to host (``Offload.admission``, ``engine.py``).

``reuse`` stores a request only if it reused something: a GPU or host hit, or a first block it
shares with an earlier request that was not stored (block keys chain from the first block, so any
shared prefix shares that key). A stream of unrelated prompts then copies nothing. The requests
not stored are remembered by their first key (the latest ``GHOSTS``), and the blocks of the latest
ones (at most a pool's worth), so that once a request sharing that first key is admitted, those of
the earlier request's blocks the GPU still caches go to host too: a document's first reader is
not stored (it shares nothing yet), and its second reader may arrive after the document has left
the GPU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.bench.e2e.runner.block_pool import BlockKey

GHOSTS = 1 << 16  # first-block keys remembered of requests not stored

Pairs = list[tuple[int, BlockKey]]  # (GPU block, the key it caches)


class Admission:
    def __init__(self, policy: str, pool_blocks: int) -> None:
        self.policy = policy
        self._pool_blocks = pool_blocks
        self._ghosts: OrderedDict[BlockKey, None] = OrderedDict()
        self._blocks: OrderedDict[BlockKey, Pairs] = OrderedDict()  # of the latest ghosts
        self._count = 0  # pairs in _blocks

    def admit(self, keys: Sequence[BlockKey], reused: int) -> tuple[bool, Pairs]:
        """Whether a request with these keys goes to host, and the blocks of an earlier request
        not stored that it admits with it (to store where the GPU still caches them)."""
        if self.policy == "none":
            return False, []
        if not keys:
            return True, []
        if self.policy == "all" or reused or keys[0] in self._ghosts:
            pairs = self._blocks.pop(keys[0], [])
            self._count -= len(pairs)
            return True, pairs
        self._ghosts[keys[0]] = None
        if len(self._ghosts) > GHOSTS:
            self._ghosts.popitem(last=False)
        return False, []

    def remember(self, first: BlockKey, pairs: Pairs) -> None:
        """A request not stored: its blocks, in case a later one shares ``first`` while they are
        still cached. Only the latest are kept, at most a pool's worth: older ones are
        overwritten by then."""
        if self.policy != "reuse":
            return
        self._count += len(pairs) - len(self._blocks.pop(first, []))
        self._blocks[first] = pairs
        while self._count > self._pool_blocks:
            self._count -= len(self._blocks.popitem(last=False)[1])
