"""vLLM's ``TieringOffloadingSpec`` with a worker that runs on CPU, for the tier contract tests.

vLLM's own worker for that spec (``CPUOffloadingWorker``) copies with CUDA streams and refuses CPU
tensors, and the spec refuses CPU platforms. Everything scheduler-side stays vLLM's (its tiering
manager, its CPU primary tier and the ``SharedOffloadRegion`` both sides map); only the copy is
replaced, by this worker: the same direct layout (one ``create_next_worker_view`` per canonical
tensor), moved with torch on CPU, synchronously. One block per chunk only.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class CPUCopyWorker(OffloadingWorker):
    def __init__(self, kv_caches: CanonicalKVCaches, region: SharedOffloadRegion) -> None:
        self.region = region
        self.device = [
            t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv_caches.tensors
        ]
        self.host = [region.create_next_worker_view(t.page_size_bytes) for t in kv_caches.tensors]
        self.refs = kv_caches.group_data_refs
        self.done: list[TransferResult] = []

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self._copy(job_id, src_spec, dst_spec, store=True)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        self._copy(job_id, dst_spec, src_spec, store=False)
        return True

    def _copy(self, job_id: int, gpu: GPULoadStoreSpec, host: Any, store: bool) -> None:
        blocks = torch.from_numpy(gpu.block_ids.astype("int64"))
        chunks = torch.from_numpy(host.block_ids.astype("int64"))
        start = 0
        nbytes = 0
        for group, size in enumerate(gpu.group_sizes):
            b, c = blocks[start : start + size], chunks[start : start + size]
            for ref in self.refs[group]:
                dev, cpu = self.device[ref.tensor_idx], self.host[ref.tensor_idx]
                if store:
                    cpu[c] = dev[b]
                else:
                    dev[b] = cpu[c]
                nbytes += size * dev.shape[1]
            start += size
        self.done.append(TransferResult(job_id, True, nbytes, 1e-6))

    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return

    def shutdown(self) -> None:
        self.host.clear()
        self.region.cleanup()


class CPUTieringSpec(TieringOffloadingSpec):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._cpu_worker: CPUCopyWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._cpu_worker is None:
            if self.blocks_per_chunk != 1:
                raise ValueError("CPUCopyWorker moves one block per chunk")
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._cpu_worker = CPUCopyWorker(kv_caches, region)
        return self._cpu_worker
