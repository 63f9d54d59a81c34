"""The GPU block pool: a fixed number of KV blocks, with prefix caching by block key.

As in vLLM: a block whose request finished keeps its KV and its key and joins the free queue; a
later request whose prefix has that key takes it back (a GPU hit). New allocations take free
blocks from the head of the queue (least recently freed first), which evicts their cached key. A
request's blocks are freed last block first, so the tail of a prefix is evicted before its head.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from kvoffload import as_block_key

BlockKey = bytes


class PoolExhausted(RuntimeError):
    pass


class BlockPool:
    """Blocks ``first .. first + num_blocks - 1`` of the KV cache (two pools with disjoint ranges
    can share one cache)."""

    def __init__(self, num_blocks: int, first: int = 0) -> None:
        if num_blocks <= 0 or first < 0:
            raise ValueError(f"expected num_blocks > 0 and first >= 0, got {num_blocks}, {first}")
        self.num_blocks = num_blocks
        self.first = first
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(first, first + num_blocks))
        self._refs = dict.fromkeys(range(first, first + num_blocks), 0)
        self._key_of: dict[int, BlockKey] = {}
        self._block_of: dict[BlockKey, int] = {}
        self.evictions = 0  # cached blocks whose KV was overwritten

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def head(self, n: int) -> list[int]:
        """The next ``n`` free blocks ``allocate`` would take (fewer if fewer are free)."""
        return list(itertools.islice(self._free, n))

    def key_of(self, block: int) -> BlockKey | None:
        """The key whose KV ``block`` caches, or None."""
        return self._key_of.get(block)

    def match(self, keys: Sequence[BlockKey]) -> list[int]:
        """Take the blocks caching the leading ``keys`` (a reference each)."""
        blocks = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            self._take(block)
            blocks.append(block)
        return blocks

    def allocate(self, n: int) -> list[int]:
        """``n`` free blocks, least recently freed first; their cached keys are dropped."""
        if n > len(self._free):
            raise PoolExhausted(f"need {n} free GPU blocks, have {len(self._free)}")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._uncache(block)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def cache(self, blocks: Sequence[int], keys: Sequence[BlockKey]) -> None:
        """Record that ``blocks`` hold the KV named by ``keys`` (a key cached already is kept)."""
        if len(blocks) != len(keys):
            raise ValueError(f"expected one key per block ({len(blocks)}), got {len(keys)}")
        for block, key in zip(blocks, keys, strict=True):
            if key not in self._block_of and block not in self._key_of:
                self._block_of[as_block_key(key)] = block
                self._key_of[block] = key

    def release(self, blocks: Sequence[int]) -> None:
        for block in reversed(blocks):
            if self._refs.get(block, 0) <= 0:
                raise ValueError(f"release: expected a block in use, got free block {block}")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    def drop_cached(self) -> int:
        """Forget every cached key of a free block (as if the pool had been churned through)."""
        dropped = [b for b in self._free if b in self._key_of]
        for block in dropped:
            self._uncache(block)
        return len(dropped)

    def _take(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1

    def _uncache(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
            self.evictions += 1
