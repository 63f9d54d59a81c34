"""Coupled loads staged in a span of areas (2026-11-28, ``StagedConfig.load_chunk_areas``): a load
chunk is copied into, and scattered from, several consecutive staging areas of one DMA stream, so
a layer slice that fits the span is one chunk on one stream and no other stream joins it before
its flag words. What the tests hold the core to: fewer chunks and no join where a slice fits, the
oracle's bytes at every span and size (slices cut into chunks where they do not fit), each slice's
words written on the stream that scattered it, and bad spans refused before anything runs."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from kvoffload.transfer.cuda import extension
from kvoffload.transfer.cuda.staged_config import StagedConfig
from kvoffload.transfer.spec import TransferSpec
from tests.fake_cuda import Calls, fake_cuda  # noqa: F401 (the fixture)
from tests.test_cuda_backends_on_cpu import POOL, Pair
from tests.test_native_engine import needs_core, round_trips, staged


def spanned(pair: Pair, areas: int, dma_streams: int = 2) -> Any:
    """Coupled both ways, four areas of two slots each, four equal layer slices of a Llama-3-8B
    page (eight blocks' slices fill one area)."""
    return staged(
        pair,
        load_coupled=True,
        store_coupled=True,
        depth=4,
        dma_streams=dma_streams,
        staging_bytes=8 * pair.kv.slot_bytes,
        load_chunk_areas=areas,
        plan_link_GBps=0.0,  # the most slices the byte rules allow: 4
    )


def load_log(calls: Calls, backend: Any, specs: list[TransferSpec]) -> list[tuple[Any, ...]]:
    start = len(calls.log)
    pending = backend.submit(specs)
    assert pending.wait(10) and pending.error() is None
    return calls.log[start:]


@needs_core
@pytest.mark.parametrize(("areas", "chunks"), [(1, 8), (0, 4), (2, 4)])
def test_a_slice_that_fits_the_span_is_one_chunk_and_nothing_joins_it(
    fake_cuda: Calls,  # noqa: F811
    areas: int,
    chunks: int,
) -> None:
    """12 blocks in 4 slices: 12 slices' bytes overflow one area (8) and fit two. One area per
    chunk: 8 chunks, and every slice but the last joins the other stream (a record there, a wait
    on the slice's last). A span of two: 4 chunks, one per slice on alternating streams, and the
    only record on a DMA stream is the job's end joining its tail."""
    pair = Pair("llama3-8b", "page")
    backend = spanned(pair, areas)
    try:
        assert backend.config.load_span == (areas or 2)
        specs = [TransferSpec.of("load", list(range(12)), list(range(12, 24)))]
        log = load_log(fake_cuda, backend, specs)
        launches = [e for e in log if e[0] == "launch"]
        assert len(launches) == chunks
        dmas = set(backend.spec.dmas[1])
        records = [e for e in log if e[0] == "record" and e[1] in dmas]
        assert len(records) == (1 + 3 if areas == 1 else 1)  # slices' joins, then the end's
        if areas != 1:  # each slice's words on the stream that scattered it
            streams = [e[1] for e in launches]
            assert streams[0] != streams[1] and set(streams) == dmas
            writes = [e for e in log if e[0] == "write32"]
            assert {e[1] for e in writes} <= dmas
        pair.oracle.copy(specs)
        pair.check()
    finally:
        backend.close()
        pair.close()


@needs_core
@pytest.mark.parametrize(("areas", "dma_streams"), [(0, 2), (2, 2), (1, 2), (0, 1), (2, 1)])
def test_every_span_moves_the_oracles_bytes(
    fake_cuda: Calls,  # noqa: F811
    areas: int,
    dma_streams: int,
) -> None:
    """Stores and loads of 1, 5, 9 and 24 blocks land as the host backend's, at each span and
    stream count (stores are not spanned); 24 blocks' slices overflow a span of 1 or 2 areas and
    are cut into chunks again, fit one of 4."""
    pair = Pair("llama3-8b", "page")
    backend = spanned(pair, areas, dma_streams)
    try:
        assert backend.config.load_span == (areas or 4 // dma_streams)
        round_trips(pair, backend, seed=areas * 10 + dma_streams)
        specs = [TransferSpec.of("load", list(range(POOL)), list(range(POOL)))]
        log = load_log(fake_cuda, backend, specs)
        per_slice = -(-POOL // (8 * backend.config.load_span))  # a span holds 8 blocks an area
        assert len([e for e in log if e[0] == "launch"]) == 4 * per_slice
        pair.oracle.copy(specs)
        pair.check()
    finally:
        backend.close()
        pair.close()


def test_the_span_is_checked_and_resolved() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="load_chunk_areas an int >= 0"):
            StagedConfig(load_chunk_areas=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"divide depth // dma_streams \(2\) or 0, got 3"):
        StagedConfig(depth=4, dma_streams=2, load_chunk_areas=3)
    assert StagedConfig().load_span == 2  # depth 4, two DMA streams
    assert StagedConfig(depth=8, dma_streams=2).load_span == 4
    assert StagedConfig(depth=8, dma_streams=2, load_chunk_areas=2).load_span == 2
    assert StagedConfig(load_coupled=False, load_chunk_areas=3).load_span == 1  # split: unused


@needs_core
def test_a_core_spec_with_a_bad_span_is_refused(fake_cuda: Calls) -> None:  # noqa: F811
    """The core checks the span itself (a spec packed by hand): it divides the depth into a
    multiple of the DMA streams, and is 1 for split loads."""
    core = extension.module()
    assert core is not None
    pair = Pair("llama3-8b", "page")
    backend = spanned(pair, 0)
    try:
        table = np.zeros(len(extension.DRIVER_FIELDS), dtype=np.uint64)  # refused before a call
        for span, coupled in ((3, 1), (4, 1), (0, 1), (2, 0)):
            spec = dataclasses.replace(backend.spec, load_span=span, load_coupled=coupled)
            with pytest.raises(ValueError, match="load span dividing the depth"):
                core.Core(extension.address(table), spec.pack())
    finally:
        backend.close()
        pair.close()
