"""``KVOffloadWorker``: vLLM's ``OffloadingWorker`` on a kvoffload ``TransferEngine`` (worker side).

The layout comes from vLLM's ``CanonicalKVCaches`` (``canonical.py``); every job goes through
``TransferEngine`` (``engine.py``), which holds the ordering and completion rules.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvoffload.config import OffloadConfig
from kvoffload.integrations.vllm.canonical import layout_from_canonical
from kvoffload.integrations.vllm.engine import JobDone, TransferEngine
from kvoffload.transfer.backend import BackendFactory


class KVOffloadWorker(OffloadingWorker):
    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        num_chunks: int,
        blocks_per_chunk: int,
        max_slot_bytes: int,
        block_size: int,
        config: OffloadConfig,
        backend_factory: BackendFactory | None = None,
    ) -> None:
        layout = layout_from_canonical(kv_caches.tensors, kv_caches.group_data_refs, block_size)
        if layout.slot_bytes > max_slot_bytes:
            raise ValueError(
                f"expected at most {max_slot_bytes} KV bytes per block and group (vLLM's "
                f"worker_kv_bytes_per_block), got {layout.slot_bytes} from the registered caches"
            )
        self.engine = TransferEngine(layout, num_chunks, blocks_per_chunk, config, backend_factory)
        self.on_finished: Callable[[JobDone], None] | None = None  # set by KVOffloadConnector

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self.engine.submit(job_id, "store", *_gpu(src_spec), _chunks(dst_spec))
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        self.engine.submit(job_id, "load", *_gpu(dst_spec), _chunks(src_spec), expedited)
        return True

    def get_finished(self) -> list[TransferResult]:
        results = []
        for done in self.engine.get_finished():
            if self.on_finished is not None:
                self.on_finished(done)
            results.append(TransferResult(done.job_id, done.ok, done.nbytes, done.seconds))
        return results

    def wait(self, job_ids: set[int]) -> None:
        self.engine.wait(job_ids)

    def shutdown(self) -> None:
        self.engine.close()


def _gpu(spec: GPULoadStoreSpec) -> tuple[np.ndarray, list[int], list[int]]:
    if not isinstance(spec, GPULoadStoreSpec):
        raise ValueError(f"expected a GPULoadStoreSpec, got {type(spec).__name__}")
    return spec.block_ids, list(spec.group_sizes), list(spec.block_indices)


def _chunks(spec: LoadStoreSpec) -> np.ndarray:
    if not isinstance(spec, BlockIDsLoadStoreSpec) or isinstance(spec, GPULoadStoreSpec):
        raise ValueError(f"expected host chunk ids, got {type(spec).__name__}")
    chunks: np.ndarray = spec.block_ids
    return chunks
