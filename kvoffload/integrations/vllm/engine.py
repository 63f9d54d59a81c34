"""The worker half without vLLM: host arena, copy backend, and ordered job lanes.

``TransferEngine`` runs vLLM-shaped jobs (GPU block ids by group, host chunk ids) through any
kvoffload copy backend (``make_backend``). Its contract, the one vLLM's ``OffloadingWorker``
needs:

- ``submit`` never blocks on a copy. Jobs of one lane (stores, loads, expedited loads) run one
  after another in submission order; expedited loads have their own lane so they never queue
  behind regular loads.
- A job is ordered after the work already queued on the engine's compute stream when it was
  submitted: on CUDA an event recorded at ``submit`` is waited on before the copy starts, so a
  store reads the KV the forward pass wrote and a load lands after pending writes (vLLM's block
  zeroing) to its destination blocks. CPU tensors are written synchronously, so nothing to wait.
- ``get_finished`` reports each job once, with the bytes it moved and the seconds its copy took;
  a copy that fails is reported ``ok=False`` with the error, never raised.
- ``wait`` blocks until the given jobs finished (their bytes are in place).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import numpy as np

from kvoffload.config import OffloadConfig
from kvoffload.integrations.vllm.plan import plan_transfers
from kvoffload.store.arena import HostArena, PinFn
from kvoffload.transfer.backend import BackendFactory, make_backend
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.spec import Direction, TransferSpec

Fence = Callable[[], None]
LANES = ("store", "load", "expedited")


@dataclass(frozen=True, eq=False)
class JobDone:
    job_id: int
    direction: Direction
    ok: bool
    nbytes: int  # bytes moved (0 when not ok)
    seconds: float  # copy start to completion, as seen by the worker
    blocks: np.ndarray  # the job's engine block ids (for reporting failed loads)
    error: str | None = None


@dataclass(frozen=True, eq=False)
class _Job:
    direction: Direction
    future: Future[float]
    nbytes: int
    blocks: np.ndarray


class TransferEngine:
    def __init__(
        self,
        layout: KVLayout,
        num_chunks: int,
        blocks_per_chunk: int,
        config: OffloadConfig,
        backend_factory: BackendFactory | None = None,
    ) -> None:
        """Allocate ``num_chunks * blocks_per_chunk`` host slots of ``layout.slot_bytes``.

        ``backend_factory`` replaces ``make_backend(config.backend, ...)`` (tests use it to
        inject copy failures).
        """
        if num_chunks <= 0 or blocks_per_chunk <= 0:
            raise ValueError(
                f"expected num_chunks > 0 and blocks_per_chunk > 0, got {num_chunks}, "
                f"{blocks_per_chunk}"
            )
        self.layout = layout
        self.blocks_per_chunk = blocks_per_chunk
        pin = config.pin_memory if config.pin_memory is not None else layout.is_cuda
        self.arena = HostArena(num_chunks * blocks_per_chunk, layout.slot_bytes, pin=_pin_fn(pin))
        if backend_factory is None:
            self.backend = make_backend(config.backend, layout, self.arena)
        else:
            self.backend = backend_factory(layout, self.arena)
        init = _cuda_thread_init(layout.device) if layout.is_cuda else None
        self._lanes = {
            name: ThreadPoolExecutor(1, f"kvoffload-{name}", initializer=init) for name in LANES
        }
        self._backend_lock = threading.Lock()
        self._jobs: dict[int, _Job] = {}

    def submit(
        self,
        job_id: int,
        direction: Direction,
        gpu_blocks: Sequence[int] | np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        host_chunks: Sequence[int] | np.ndarray,
        expedited: bool = False,
    ) -> None:
        """Queue one job; ValueError for a malformed one or a job id already in flight."""
        if job_id in self._jobs:
            raise ValueError(f"submit: expected a new job id, got {job_id} already in flight")
        specs = plan_transfers(
            direction, gpu_blocks, group_sizes, block_indices, host_chunks, self.blocks_per_chunk
        )
        self.backend.validate(specs)
        nbytes = sum(len(s) * self.layout.groups[s.group].slot_bytes for s in specs)
        lane = "store" if direction == "store" else "expedited" if expedited else "load"
        future = self._lanes[lane].submit(self._run, specs, self._fence())
        blocks = np.asarray(gpu_blocks, dtype=np.int64).reshape(-1)
        self._jobs[job_id] = _Job(direction, future, nbytes, blocks)

    def get_finished(self) -> list[JobDone]:
        """Jobs finished since the last call, in submission order; never blocks."""
        done = [job_id for job_id, job in self._jobs.items() if job.future.done()]
        return [self._result(job_id, self._jobs.pop(job_id)) for job_id in done]

    def wait(self, job_ids: Iterable[int]) -> None:
        futures = [self._jobs[j].future for j in job_ids if j in self._jobs]
        wait_futures(futures)

    def drain(self) -> None:
        """Wait for every job in flight."""
        self.wait(list(self._jobs))

    def in_flight(self) -> int:
        return len(self._jobs)

    def close(self) -> None:
        """Let queued copies finish, then release the backend and the host arena."""
        for lane in self._lanes.values():
            lane.shutdown(wait=True)
        self.backend.close()
        self.arena.close()

    def _run(self, specs: list[TransferSpec], fence: Fence | None) -> float:
        if fence is not None:
            fence()
        start = time.perf_counter()
        if specs:
            with self._backend_lock:
                pending = self.backend.submit(specs)
            pending.wait()
            error = pending.error()
            if error is not None:
                raise error
        return time.perf_counter() - start

    def _result(self, job_id: int, job: _Job) -> JobDone:
        error = job.future.exception()
        if error is None:
            return JobDone(job_id, job.direction, True, job.nbytes, job.future.result(), job.blocks)
        message = f"{type(error).__name__}: {error}"
        return JobDone(job_id, job.direction, False, 0, 0.0, job.blocks, message)

    def _fence(self) -> Fence | None:
        if not self.layout.is_cuda:
            return None
        import torch

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(torch.device(self.layout.device)))
        return event.synchronize


def _pin_fn(pin: bool) -> PinFn | None:
    if not pin:
        return None
    from kvoffload.transfer.pinning import cuda_pin

    return cuda_pin


def _cuda_thread_init(device: str) -> Callable[[], None]:
    """Each lane thread gets its own idle current stream: a backend that orders its copies after
    the submitting thread's current stream then waits only for the fence taken at submit (never for
    the engine's later kernels, as the legacy default stream would)."""

    def init() -> None:
        import torch

        dev = torch.device(device)
        torch.cuda.set_device(dev)
        torch.cuda.set_stream(torch.cuda.Stream(dev))  # type: ignore[no-untyped-call]

    return init
