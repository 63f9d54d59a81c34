"""Building vLLM's ``fs`` tier and ours side by side over one primary view, for the scenario tests
(``test_tier_contract.py``, ``test_tier_events.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingKVEventsConfig,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

from kvoffload.integrations.vllm.secondary import KVOffloadDiskTier, KVOffloadValkeyTier
from kvoffload.store.tiers.disk import record_bytes_for
from tests.tiers_support import running_server

ROWS, ROW_BYTES = 8, 64 << 10  # the primary tier: 8 chunks of 64 KiB
CTX = ReqContext(req_id="test")
END = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
KINDS = ("fs", "disk", "valkey")
OURS = ("disk", "valkey")
Build = Callable[..., SecondaryTierManager]


def mock_spec(events: bool = False, tp_size: int = 1, replicated_layout: bool = False) -> Any:
    """vLLM's tier-test spec (``upstream/test_fs_tier.py``): a real ``OffloadingConfig`` (rank
    ``tp_size - 1`` of ``tp_size``) and KV-events switch inside a ``MagicMock``."""
    spec = MagicMock()
    parallel = OffloadingParallelConfig(
        rank=tp_size - 1,
        world_size=tp_size,
        tp_size=tp_size,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        data_parallel_size=1,
        data_parallel_rank_local=None,
        is_parallelism_agnostic=False,
    )
    spec.config = OffloadingConfig(
        groups=(),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=events,
        extra_config={},
        engine_id="test-engine",
        model=OffloadingModelConfig(name="test-model", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=parallel,
        replicated_layout=replicated_layout,
    )
    spec.blocks_per_chunk = 1
    spec.kv_events_config = OffloadingKVEventsConfig(
        enable_kv_cache_events=events, self_describing_kv_events=False
    )
    return spec


def key(n: int) -> OffloadKey:
    return make_offload_key(n.to_bytes(8, "big"), 0)


def make_job(
    job_id: int, keys: list[OffloadKey], chunks: list[int], promotion: bool = False
) -> Any:
    ids = np.array(chunks, dtype=np.int64)
    return TransferJob(job_id, keys, ids, is_promotion=promotion, req_context=CTX)


def rows(random: bool = False) -> np.ndarray:
    """The primary tier's rows, page-aligned (vLLM's fs tier writes with O_DIRECT)."""
    raw = np.zeros(ROWS * ROW_BYTES + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    data = raw[start : start + ROWS * ROW_BYTES].reshape(ROWS, ROW_BYTES)
    if random:
        data[:] = np.random.default_rng(7).integers(0, 256, data.shape, dtype=np.uint8)
    return data


@contextmanager
def tier_builder(tmp_path: Path) -> Iterator[Build]:
    """``make(kind, spec=None, data=None, **entry)``: a tier over ``data``'s rows, shut down on
    exit; each kind keeps its files (or server) until then, so a second tier of the same kind sees
    what the first stored. The ``build`` fixture (``conftest.py``)."""
    built: list[SecondaryTierManager] = []
    with ExitStack() as stack:
        servers: list[Any] = []

        def make(kind: str, spec: Any = None, data: np.ndarray | None = None, **entry: Any) -> Any:
            spec = mock_spec() if spec is None else spec
            view = (rows() if data is None else data).data
            common = {"offloading_spec": spec, "primary_kv_view": view}
            tier: SecondaryTierManager
            if kind == "fs":
                root = str(tmp_path / "fs")
                threads = {"n_read_threads": 2, "n_write_threads": 2}
                tier = FileSystemTierManager(
                    **common, tier_type="fs", root_dir=root, **threads, **entry
                )
            elif kind == "disk":
                entry.setdefault("disk_path", str(tmp_path / "disk"))
                entry.setdefault("disk_capacity_bytes", 64 * record_bytes_for(ROW_BYTES))
                tier = KVOffloadDiskTier(**common, tier_type="KVOffloadDiskTier", **entry)
            else:
                if not servers:
                    servers.append(stack.enter_context(running_server()))
                url = servers[0].url
                tier = KVOffloadValkeyTier(
                    **common, tier_type="KVOffloadValkeyTier", valkey_url=url, **entry
                )
            built.append(tier)
            return tier

        try:
            yield make
        finally:
            for tier in built:
                tier.shutdown()


def drain(tier: SecondaryTierManager) -> list[Any]:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def resolve(tier: SecondaryTierManager, keys: list[OffloadKey], ctx: ReqContext = CTX) -> list[Any]:
    """Look ``keys`` up until no answer is RETRY (both tiers answer RETRY while they probe)."""
    deadline = time.monotonic() + 10
    while True:
        answers = [tier.lookup(k, ctx) for k in keys]
        if LookupResult.RETRY not in answers:
            return answers
        assert time.monotonic() < deadline, "the lookup never resolved"
        tier.on_schedule_end(END)
        tier.drain_jobs()
        list(tier.get_finished_jobs())
        time.sleep(0.01)


def store(
    tier: SecondaryTierManager, keys: list[OffloadKey], chunks: list[int], job: int = 1
) -> None:
    tier.submit_store(make_job(job, keys, chunks))
    assert [r.success for r in drain(tier)] == [True]
