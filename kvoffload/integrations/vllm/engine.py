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
- ``wait_layer`` returns once one layer of a job has arrived (an index into its layer group's
  layers, ``LayerGroup``), so the engine's attention for layer i can run while later layers are
  still copying; it needs a backend that copies loads layer by layer (``host`` does; the GPU
  backends wait for the whole copy until they move loads layer-major).
- ``wait`` blocks until the given jobs finished (their bytes are in place). An expedited load
  (one the engine's step waits on: vLLM's sync loads) that failed is retried there once, at once,
  through a second copy path (``fallback``: another backend instance, ``host`` on CPU, ``dma`` on
  a GPU or ``staged`` when ``dma`` failed) before it is reported failed: vLLM 0.33 cannot recompute
  a failed sync load on a model with more than one KV-cache group (``docs/vllm.md``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from kvoffload.config import OffloadConfig
from kvoffload.integrations.vllm.plan import plan_transfers
from kvoffload.store.arena import HostArena, PinFn
from kvoffload.transfer.backend import (
    HOST_WAIT_ON_TIMEOUT,
    BackendFactory,
    CopyBackend,
    Pending,
)
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.registry import make_backend
from kvoffload.transfer.spec import Direction, TransferSpec
from kvoffload.transfer.topology import arena_placement

log = logging.getLogger(__name__)
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
    error: str | None = None  # why it failed; on success, the first attempt's error if retried


@dataclass(frozen=True, eq=False)
class _Job:
    direction: Direction
    lane: str
    future: Future[float]
    started: Future[Pending]  # the backend's handle on the copy, once the lane submitted it
    nbytes: int
    blocks: np.ndarray
    specs: list[TransferSpec]
    retried: bool = False  # a failed expedited load gets one retry
    first_error: str | None = None  # the first attempt's error, when the retry succeeded


class TransferEngine:
    def __init__(
        self,
        layout: KVLayout,
        num_chunks: int,
        blocks_per_chunk: int,
        config: OffloadConfig,
        backend_factory: BackendFactory | None = None,
        arena: Callable[[PinFn | None], HostArena] | None = None,
    ) -> None:
        """``num_chunks * blocks_per_chunk`` host slots of ``layout.slot_bytes``: a private arena,
        or the one ``arena(pin)`` builds (a worker's part of the shared region).

        ``backend_factory`` replaces ``make_backend(config.backend, ...)`` (tests use it to
        inject copy failures; the fallback is then a second instance from it).
        """
        if num_chunks <= 0 or blocks_per_chunk <= 0:
            raise ValueError(
                f"expected num_chunks > 0 and blocks_per_chunk > 0, got {num_chunks}, "
                f"{blocks_per_chunk}"
            )
        self.layout = layout
        self.blocks_per_chunk = blocks_per_chunk
        pin = _pin_fn(config.pin_memory if config.pin_memory is not None else layout.is_cuda)
        num_slots = num_chunks * blocks_per_chunk
        if arena is None:
            nbytes = num_slots * layout.slot_bytes
            placement = arena_placement(config.numa_node, layout.device, nbytes)
            self.arena = HostArena(num_slots, layout.slot_bytes, pin=pin, placement=placement)
        else:
            self.arena = arena(pin)
            if self.arena.num_slots != num_slots:
                raise ValueError(f"expected {num_slots} host slots, got {self.arena.num_slots}")
        self._factory = backend_factory or partial(make_backend, config.backend)
        self.backend = self._factory(layout, self.arena)
        self._fallback_name = None if backend_factory else _fallback(config.backend, layout.is_cuda)
        self._fallback: CopyBackend | None = None
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
        started: Future[Pending] = Future()
        future = self._lanes[lane].submit(self._run, self.backend, specs, self._fence(), started)
        blocks = np.asarray(gpu_blocks, dtype=np.int64).reshape(-1)
        self._jobs[job_id] = _Job(direction, lane, future, started, nbytes, blocks, specs)

    def get_finished(self) -> list[JobDone]:
        """Jobs finished since the last call, in submission order; never blocks."""
        done = [job_id for job_id, job in self._jobs.items() if job.future.done()]
        return [self._result(job_id, self._jobs.pop(job_id)) for job_id in done]

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until ``job_ids`` finished; retry a failed expedited load (module docstring)."""
        jobs = {j: self._jobs[j] for j in job_ids if j in self._jobs}
        wait_futures([job.future for job in jobs.values()])
        for job_id, job in jobs.items():
            if job.lane == "expedited" and not job.retried and job.future.exception() is not None:
                self._jobs[job_id] = self._retry(job)

    def wait_layer(self, job_id: int, layer: int, stream: object = None) -> bool:
        """Return once ``layer`` of ``job_id``'s copy has arrived (on a GPU, ``stream``, None for
        the current one, waits for it instead of the host); True also for a job unknown or done.
        False when the copy failed: ``wait`` then retries an expedited load."""
        job = self._jobs.get(job_id)
        if job is None or not job.specs:
            return True
        if job.future.done():
            return job.future.exception() is None
        try:
            job.started.result(HOST_WAIT_ON_TIMEOUT).wait_on(stream, layer)
        except Exception:  # noqa: BLE001 (the copy failed: reported by the return value)
            return False
        return True

    def error(self, job_id: int) -> str | None:
        """Why a finished job that is not yet collected failed; None if it succeeded, is still
        running, or is unknown."""
        job = self._jobs.get(job_id)
        if job is None or not job.future.done() or job.future.exception() is None:
            return None
        return _message(job.future.exception())

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
        if self._fallback is not None:
            self._fallback.close()
        self.arena.close()

    def _run(
        self,
        backend: CopyBackend,
        specs: list[TransferSpec],
        fence: Fence | None,
        started: Future[Pending] | None = None,
    ) -> float:
        """One job on a lane (or a retry in the caller's thread): fence, submit, wait."""
        try:
            if fence is not None:
                fence()
            start = time.perf_counter()
            if not specs:  # nothing to move (wait_layer does not ask for ``started``)
                return 0.0
            with self._backend_lock:
                pending = backend.submit(specs)
        except BaseException as error:
            if started is not None:
                started.set_exception(error)
            raise
        if started is not None:
            started.set_result(pending)
        pending.wait()
        failure = pending.error()
        if failure is not None:
            raise failure
        return time.perf_counter() - start

    def _retry(self, job: _Job) -> _Job:
        """Copy a failed job again through the fallback backend, in this thread."""
        first = _message(job.future.exception())
        future: Future[float] = Future()
        try:
            if self._fallback is None:
                self._fallback = self._fallback_backend()
            future.set_result(self._run(self._fallback, job.specs, None))
        except Exception as error:  # noqa: BLE001 (reported with the job, not swallowed)
            future.set_exception(
                RuntimeError(f"{first}; retried through a fallback: {_message(error)}")
            )
            log.warning("expedited load failed twice (%s)", future.exception())
            return replace(job, future=future, retried=True)
        log.warning("expedited load failed (%s); the fallback copy succeeded", first)
        return replace(job, future=future, retried=True, first_error=first)

    def _fallback_backend(self) -> CopyBackend:
        if self._fallback_name is None:
            return self._factory(self.layout, self.arena)
        return make_backend(self._fallback_name, self.layout, self.arena)

    def _result(self, job_id: int, job: _Job) -> JobDone:
        error = job.future.exception()
        if error is None:
            seconds = job.future.result()
            return JobDone(
                job_id, job.direction, True, job.nbytes, seconds, job.blocks, job.first_error
            )
        return JobDone(job_id, job.direction, False, 0, 0.0, job.blocks, _message(error))

    def _fence(self) -> Fence | None:
        if not self.layout.is_cuda:
            return None
        import torch

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(torch.device(self.layout.device)))
        return event.synchronize


def _fallback(backend: str, is_cuda: bool) -> str | None:
    """The second copy path for a failed expedited load; None: another instance of the first."""
    if backend not in ("auto", "host", "dma", "sm", "staged"):
        return None  # a registered custom backend (or a test's factory): no known alternative
    if not is_cuda:
        return "host"
    return "staged" if backend == "dma" else "dma"


def _message(error: BaseException | None) -> str:
    return f"{type(error).__name__}: {error}"


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
