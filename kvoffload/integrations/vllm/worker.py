"""``KVOffloadWorker``: vLLM's ``OffloadingWorker`` on a kvoffload ``TransferEngine`` (worker side).

The layout comes from vLLM's ``CanonicalKVCaches`` (``canonical.py``); every job goes through
``TransferEngine`` (``engine.py``), which holds the ordering, completion and retry rules.

A failed copy is reported to vLLM as failed, which vLLM 0.33's own connector answers by stopping
(its worker asserts that every transfer succeeded: loud, never wrong KV). ``KVOffloadConnector``
sets ``recovering``: failed jobs are then handed to vLLM as finished (so its bookkeeping releases
them) without bytes or time, and every finished job is kept (``take_done``) for the connector to
report the failed ones.
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
from kvoffload.store.arena import HostArena, PinFn
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
        arena: Callable[[PinFn | None], HostArena] | None = None,
    ) -> None:
        layout = layout_from_canonical(kv_caches.tensors, kv_caches.group_data_refs, block_size)
        if layout.slot_bytes > max_slot_bytes:
            raise ValueError(
                f"expected at most {max_slot_bytes} KV bytes per block and group (vLLM's "
                f"worker_kv_bytes_per_block), got {layout.slot_bytes} from the registered caches"
            )
        self.engine = TransferEngine(
            layout, num_chunks, blocks_per_chunk, config, backend_factory, arena
        )
        self.recovering = False  # set by KVOffloadConnector
        # Set by KVOffloadConnector around vLLM's submission of sync loads that it then waits
        # for layer by layer (per_layer_loads): vLLM's wait for them returns at once.
        self.defer_waits = False
        self._done: list[JobDone] = []

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
            if self.recovering:
                self._done.append(done)
            if done.ok:
                results.append(TransferResult(done.job_id, True, done.nbytes, done.seconds))
            else:
                results.append(TransferResult(done.job_id, self.recovering))
        return results

    def take_done(self) -> list[JobDone]:
        """Jobs finished since the last call (``recovering`` only), failed or not."""
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        if not self.defer_waits:
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
