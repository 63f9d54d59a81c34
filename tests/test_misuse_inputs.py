"""Misused input is refused with a ValueError that says what was expected and what was given, and
a refused call changes nothing (issue 24, "Why" 4 to 6, each as it was found).

Each test names what the code before issue 24 did with the same call.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvoffload import KVLayout, OffloadConfig, build_local, prefix_block_keys
from kvoffload.offload.jobs import TransferJob
from kvoffload.offload.local import LocalOffload

NUM_BLOCKS, BS = 32, 16


@pytest.fixture
def local() -> Iterator[LocalOffload]:
    gen = torch.Generator().manual_seed(0)
    kv = [
        torch.randint(-(2**15), 2**15, (2, NUM_BLOCKS, BS, 2, 32), dtype=torch.int16, generator=gen)
        for _ in range(2)
    ]
    made = build_local(KVLayout.from_tensors(kv, block_size=BS, block_dim=1), OffloadConfig())
    made.kv = kv  # type: ignore[attr-defined]  # kept alive with the layout
    yield made
    made.close()


def store(local: LocalOffload, req_id: str, keys: list[bytes], blocks: list[int]) -> TransferJob:
    """Store ``keys`` from ``blocks`` and complete the job; returns it."""
    job = local.offloader.schedule_store(req_id, keys, blocks)
    assert job is not None
    local.worker.submit(job)
    assert local.worker.wait([job.job_id], timeout=30) == set()
    local.offloader.complete(local.worker.get_finished())
    return job


def unchanged(local: LocalOffload) -> tuple[object, ...]:
    off = local.offloader
    ix = off.index
    return (ix.num_free, ix.num_readable, ix.num_writing, ix.num_pinned, off.in_flight())


@pytest.mark.parametrize(
    ("keys", "given"),
    [(b"AB", "one bytes object"), (bytearray(b"AB"), "one bytearray"), ("AB", "one str")],
)
def test_a_key_like_object_for_a_key_list_is_refused(
    local: LocalOffload, keys: object, given: str
) -> None:
    """Before: ``schedule_store("r", b"AB", [0, 1])`` stored int keys 65 and 66."""
    off, before = local.offloader, unchanged(local)
    with pytest.raises(ValueError, match=f"schedule_store: expected a list of keys, got {given}"):
        off.schedule_store("r", keys, [0, 1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"lookup: expected a list of keys, got {given}"):
        off.lookup(keys)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"schedule_load: expected a list of keys, got {given}"):
        off.schedule_load("r", keys, [0, 1])  # type: ignore[arg-type]
    assert unchanged(local) == before


def test_lookup_of_one_bytes_key_is_refused_not_zero(local: LocalOffload) -> None:
    """Before: ``lookup(b"Q" * 16)`` returned 0 quietly, even for a held key."""
    off = local.offloader
    key = b"Q" * 16
    store(local, "r", [key], [0])
    assert off.lookup([key]) == 1
    with pytest.raises(ValueError, match="pass \\[key\\] for a single key"):
        off.lookup(key)  # type: ignore[arg-type]


def test_keys_as_a_generator_or_an_int_say_what_was_given(local: LocalOffload) -> None:
    """Before: a generator used twice gave "expected one engine block per key (0), got 3"."""
    off, before = local.offloader, unchanged(local)
    keys = prefix_block_keys(np.arange(48), BS)
    gen = (k for k in keys)
    with pytest.raises(ValueError, match="expected a list of keys \\(in prefix order\\), got a "):
        off.schedule_store("r", gen, [0, 1, 2])  # type: ignore[arg-type]
    assert next(gen) == keys[0]  # not consumed by the refusal
    with pytest.raises(ValueError, match="lookup: expected a list of keys, got int 3"):
        off.lookup(3)  # type: ignore[arg-type]
    assert unchanged(local) == before
    off.touch(k for k in keys)  # touch takes any iterable: order means nothing there


@pytest.mark.parametrize(
    ("blocks", "shown"),
    [
        (np.array([2**64 - 1], dtype=np.uint64), str(2**64 - 1)),  # before: "got -1"
        ([2**63], str(2**63)),  # before: "got -9223372036854775808"
        ([2**64], str(2**64)),  # before: "got dtype object"
    ],
)
def test_block_ids_beyond_int64_show_the_id_given(
    local: LocalOffload, blocks: object, shown: str
) -> None:
    before = unchanged(local)
    with pytest.raises(
        ValueError, match=f"expected engine block ids in \\[0, 2\\*\\*63\\), got {shown}$"
    ):
        local.offloader.schedule_store("r", [b"k"], blocks)  # type: ignore[arg-type]
    assert unchanged(local) == before


def test_a_too_long_load_is_refused_in_the_apis_words(local: LocalOffload) -> None:
    """Before: "prepare_load: expected READABLE keys" (internal names)."""
    off = local.offloader
    keys = prefix_block_keys(np.arange(48), BS)
    store(local, "s", keys[:2], [0, 1])
    hit = off.lookup(keys)
    assert hit == 2
    before = unchanged(local)
    with pytest.raises(ValueError) as refused:
        off.schedule_load("r", keys, [5, 6, 7])
    message = str(refused.value)
    assert message.startswith("schedule_load: expected keys held on host")
    assert "of which 1 are not held, the first at position 2" in message
    assert "READABLE" not in message and "prepare_load" not in message
    assert unchanged(local) == before


def test_wait_on_a_job_id_never_handed_out_is_refused(local: LocalOffload) -> None:
    """Before: ``worker.wait_on(12345, layer=0)`` returned quietly."""
    off, worker = local.offloader, local.worker
    for job_id in (12345, -1, 0, "3", True):
        with pytest.raises(ValueError, match="wait_on: expected a job id its Offloader handed"):
            worker.wait_on(job_id, layer=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"handed out, got 1$"):
        worker.wait_on(1)
    job = store(local, "r", [b"k"], [3])
    assert job.job_id == 0 and off.is_settled("r")
    worker.wait_on(job.job_id, layer=0)  # finished: returns at once
    with pytest.raises(ValueError, match=r"handed out, got 1$"):
        worker.wait_on(1)
    assert worker.enqueued(job.job_id)  # finished: nothing left to enqueue
    for job_id in (1, 12345):
        with pytest.raises(ValueError, match="enqueued: expected a job id its Offloader handed"):
            worker.enqueued(job_id)


def test_an_unknown_keyword_is_a_value_error() -> None:
    """Before: ``OffloadConfig(host_capacity_byte=...)`` raised TypeError."""
    with pytest.raises(ValueError, match=r"unknown kvoffload option\(s\) \['host_capacity_byte'\]"):
        OffloadConfig(host_capacity_byte=1 << 20)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="host_capacity_byte"):
        OffloadConfig.from_dict({"host_capacity_byte": 1 << 20})


def test_one_tensor_instead_of_a_list_is_refused() -> None:
    """Before: a bare ``RuntimeError: Boolean value of Tensor ... is ambiguous``."""
    t = torch.zeros(4, 16, 2, 8)
    with pytest.raises(
        ValueError,
        match=r"expected a list of KV tensors \(one per layer\), got "
        r"one Tensor of shape \(4, 16, 2, 8\); pass \[tensor\]",
    ):
        KVLayout.from_tensors(t, block_size=16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got one ndarray of shape"):
        KVLayout.from_tensors(np.zeros((4, 16, 2, 8)), block_size=16)  # type: ignore[arg-type]


def test_a_block_size_the_tensors_cannot_hold_is_refused() -> None:
    """Before: ``block_size=32`` on 16-token blocks was accepted and mapped KV wrongly."""
    kv = [torch.zeros(8, 16, 2, 8) for _ in range(2)]
    with pytest.raises(
        ValueError,
        match=r"hold block_size=32 tokens in one of its dims, got block dims \(16, 2, 8\)",
    ):
        KVLayout.from_tensors(kv, block_size=32)
    assert KVLayout.from_tensors(kv, block_size=16).groups[0].num_blocks == 8


def test_the_token_dim_taken_as_the_block_dim_is_refused() -> None:
    """Before: ``[blocks, tokens, heads, dim]`` with ``block_dim=1`` made 8 regions per tensor of
    16 'blocks' each (one per token)."""
    kv = [torch.zeros(8, 16, 2, 8) for _ in range(2)]
    with pytest.raises(ValueError, match=r"dim 1 \(block_dim\) has size 16: is it the token dim"):
        KVLayout.from_tensors(kv, block_size=16, block_dim=1)
    kv_first = [torch.zeros(2, 8, 16, 2, 8) for _ in range(2)]  # [2, blocks, ...]: right
    assert len(KVLayout.from_tensors(kv_first, 16, block_dim=1).groups[0].regions) == 4


def test_a_flat_page_cannot_be_checked_and_passes() -> None:
    """docs/api.md: a block given as one flat dim says nothing of its tokens."""
    layout = KVLayout.from_tensors([np.zeros((4, 4096), np.uint8)], block_size=32)
    assert layout.block_size == 32


def test_a_long_engine_id_is_a_region_name_not_an_oserror(tmp_path: Path) -> None:
    """Before: a 300-character engine id raised ``OSError: [Errno 36] File name too long``."""
    from kvoffload.integrations.vllm.region import SharedRegion

    region = SharedRegion("e" * 300, 4096, tmp_path)
    assert region.created and len(region.path.name) < 255
    region.close()
