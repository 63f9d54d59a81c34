"""What one ``kvoffload bench e2e`` run measures: its workloads, modes, pools and checks, validated
when built. Below both ``bench.py`` (which runs it) and ``verify.py`` (which samples from it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from kvoffload.bench.e2e.runner.beside import MODE as BESIDE
from kvoffload.bench.e2e.runner.engine import MODES
from kvoffload.bench.e2e.runner.graphs import GRAPHS
from kvoffload.bench.e2e.runner.offload_mode import Offload
from kvoffload.bench.e2e.runner.workload import Workload

Advance = Callable[[str], None]  # progress: called once per request run, with a description


@dataclass(frozen=True)
class WorkloadRun:
    workload: Workload
    modes: tuple[str, ...]
    rounds: int  # each mode runs the workload this many times (fresh token ids each round)
    gpu_blocks: int  # GPU pool of every mode but gpu_all
    host_blocks: int  # kvoffload host tier capacity

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes or len(set(self.modes)) != len(self.modes):
            raise ValueError(f"expected distinct modes from {MODES}, got {list(self.modes)}")
        if BESIDE in self.modes and "kvoffload" not in self.modes:
            raise ValueError(
                f"expected mode kvoffload beside {BESIDE} (it copies kvoffload's restored bytes), "
                f"got modes {list(self.modes)}"
            )
        for name in ("rounds", "gpu_blocks", "host_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"expected {name} > 0, got {getattr(self, name)}")

    def all_blocks(self, block_size: int) -> int:
        """The ``gpu_all`` pool: every distinct block plus room for the request in flight."""
        w = self.workload
        return w.distinct_blocks(block_size) + 2 * w.longest_request_blocks(block_size)

    def pool_blocks(self, mode: str, block_size: int) -> int:
        return self.all_blocks(block_size) if mode in ("gpu_all", BESIDE) else self.gpu_blocks

    def cache_blocks(self, block_size: int) -> int:
        """Blocks of KV cache the run needs: every mode's pool (side by side)."""
        return sum(self.pool_blocks(m, block_size) for m in self.modes)


@dataclass(frozen=True)
class BenchConfig:
    model: str
    device: str  # "cpu", "cuda", "cuda:1"
    workloads: tuple[WorkloadRun, ...]
    dtype: str = "bfloat16"  # the model's and the KV cache's
    block_size: int = 16
    chunk_tokens: int = 2048  # prefill chunk
    offload: Offload = field(default_factory=Offload)  # how the engine uses the host tier
    backend: str = "auto"  # kvoffload copy backend
    eviction_window: int = 1  # OffloadConfig.eviction_window of the host tier
    zero_reuse_rounds: int = 2  # rounds of (gpu, kvoffload, ...) on unique prompts; 0 skips
    zero_reuse_turns: int = 16  # requests per zero-reuse round
    verify: int = 2  # sampled turns checked bit for bit; 0 skips
    seed: int = 0
    graphs: tuple[str, ...] = ("eager",)  # engine graph modes, each a whole run (graphs.py)
    profile: int = 0  # the last this many requests of each workload traced (profile.py; CUDA)

    def __post_init__(self) -> None:
        if not self.workloads:
            raise ValueError("expected at least one workload, got none")
        bad = [g for g in self.graphs if g not in GRAPHS]
        if bad or not self.graphs or len(set(self.graphs)) != len(self.graphs):
            raise ValueError(
                f"expected distinct graph modes from {GRAPHS}, got {list(self.graphs)}"
            )
        if self.profile < 0:
            raise ValueError(f"expected profile >= 0 requests, got {self.profile}")
        if self.graphs != ("eager",) and not self.device.startswith("cuda"):
            raise ValueError(
                f"expected graph modes other than eager only on a CUDA device (they capture CUDA "
                f"graphs), got {list(self.graphs)} on {self.device}"
            )
        for name in ("block_size", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"expected {name} > 0, got {getattr(self, name)}")
        for name in ("zero_reuse_rounds", "zero_reuse_turns", "verify"):
            if getattr(self, name) < 0:
                raise ValueError(f"expected {name} >= 0, got {getattr(self, name)}")
        for run in self.workloads:
            need = 2 * run.workload.longest_request_blocks(self.block_size)
            if run.gpu_blocks < need:
                raise ValueError(
                    f"expected a GPU pool of at least {need} blocks for {run.workload.kind} "
                    f"(twice its longest request), got {run.gpu_blocks}"
                )

    @property
    def modes(self) -> list[str]:
        """Every mode some part of the run uses, in ``MODES`` order."""
        used = {m for r in self.workloads for m in r.modes}
        if self.zero_reuse_rounds:
            used |= {"gpu", "kvoffload"}
        return [m for m in MODES if m in used]

    def zero_reuse_variants(self) -> dict[str, tuple[str, Offload]]:
        out = {"gpu": ("gpu", self.offload), "kvoffload": ("kvoffload", self.offload)}
        if self.offload.admission != "all":
            out["kvoffload_store_all"] = (
                "kvoffload",
                dataclasses.replace(self.offload, admission="all"),
            )
        return out

    def cache_blocks(self) -> int:
        zero = len(self.zero_reuse_variants()) * self.workloads[0].gpu_blocks
        runs = [r.cache_blocks(self.block_size) for r in self.workloads]
        return max([*runs, zero if self.zero_reuse_rounds else 0])

    def steps(self) -> int:
        """Progress steps: warm-ups, requests, zero-reuse requests, sampled checks, per graph
        mode."""
        work = sum(r.rounds * len(r.modes) * r.workload.requests() for r in self.workloads)
        zero = len(self.zero_reuse_variants()) * self.zero_reuse_rounds * self.zero_reuse_turns
        one = len(self.modes) + work + (zero if self.zero_reuse_rounds else 0) + self.verify
        return one * len(self.graphs)
