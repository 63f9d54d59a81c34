"""The copy kernel's access width (``StagedConfig.access_bytes``, ``chunks.vector_words``): the
native core's kernels take 16-byte accesses only where every piece allows them. The fake driver
(``tests/fake_cuda.py``) refuses a 16-byte-access variant launched over a piece that is not
16-byte aligned, so a wrong choice fails these tests; the bytes are the host backend's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvoffload.store.arena import HostArena
from kvoffload.transfer.cuda.chunks import vector_words
from kvoffload.transfer.cuda.staged_config import StagedConfig
from kvoffload.transfer.host import HostBackend
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import TransferSpec
from tests.fake_cuda import _FUNCTIONS, Calls, cuda_layout, fake_cuda, no_pin  # noqa: F401
from tests.test_native_engine import needs_core, staged

POOL = 12


def test_vector_words_takes_16_bytes_only_where_every_value_allows() -> None:
    assert vector_words([0, 16, 4096, 1 << 40]) == 2
    assert vector_words([16, 32, 24]) == 1  # one piece of 24 bytes
    assert vector_words([16, 32], access_bytes=8) == 1
    assert vector_words([]) == 2
    with pytest.raises(ValueError, match="expected access_bytes 8 or 16, got 4"):
        vector_words([16], access_bytes=4)


@pytest.mark.parametrize("bad", [4, 12, 32, True, "16"])
def test_the_config_refuses_other_widths(bad: Any) -> None:
    with pytest.raises(ValueError, match="expected access_bytes 8 or 16"):
        StagedConfig(access_bytes=bad)


class Odd:
    """Two layers of ``words`` 2-byte values per block (pages of 2 * words bytes), the engine's
    and the oracle's, and their arenas."""

    def __init__(self, words: int) -> None:
        rng = np.random.default_rng(words)
        self.mine = [rng.integers(0, 1 << 16, (POOL, words), dtype=np.uint16) for _ in range(2)]
        self.theirs = [t.copy() for t in self.mine]
        kv = KVLayout.from_tensors(self.mine, block_size=16, block_dim=0)
        self.kv = cuda_layout(kv)
        oracle_kv = KVLayout.from_tensors(self.theirs, block_size=16, block_dim=0)
        self.arena = HostArena(POOL, kv.slot_bytes, pin=no_pin)
        self.arena_oracle = HostArena(POOL, kv.slot_bytes)
        self.oracle = HostBackend(oracle_kv, self.arena_oracle)

    def check(self) -> None:
        assert np.array_equal(self.arena.slots, self.arena_oracle.slots), "host slots differ"
        for a, b in zip(self.mine, self.theirs, strict=True):
            assert np.array_equal(a, b), "engine tensors differ"

    def close(self) -> None:
        self.oracle.close()
        self.arena.close()
        self.arena_oracle.close()


@needs_core
@pytest.mark.parametrize(
    ("words", "access", "vec"),
    [(12, 16, 1), (20, 16, 1), (16, 16, 2), (16, 8, 1), (64, 16, 2)],
)
def test_the_core_picks_the_width_its_pieces_allow_and_moves_the_oracles_bytes(
    fake_cuda: Calls,  # noqa: F811
    words: int,
    access: int,
    vec: int,
) -> None:
    """12 / 20 values: pages of 24 / 40 bytes, 8-byte aligned and not 16 (so is the second
    layer's offset in a slot): 8-byte accesses whatever ``access_bytes`` says."""
    pair = Odd(words)
    before = len(_FUNCTIONS)
    backend = staged(pair, access_bytes=access)  # type: ignore[arg-type]
    try:
        compiled = [_FUNCTIONS[f] for f in range(before + 1, len(_FUNCTIONS) + 1)]
        assert len(compiled) == 2  # a store's variant and a load's
        assert {key[5] for key in compiled} == {vec}
        rng = np.random.default_rng(words)
        for count in (5, 1, POOL):
            blocks = rng.choice(POOL, count, replace=False)
            slots = rng.choice(POOL, count, replace=False)
            for spec in (
                TransferSpec.of("store", blocks, slots),
                TransferSpec.of("load", rng.choice(POOL, count, replace=False), slots),
            ):
                pending = backend.submit([spec])
                assert pending.wait(10) and pending.error() is None
                pair.oracle.copy([spec])
                pair.check()
    finally:
        backend.close()
        pair.close()
    assert not fake_cuda.errors
