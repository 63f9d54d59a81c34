# mypy: disable-error-code="no-untyped-call"
"""One process of ``kvoffload bench multi-gpu``: one device, its own NUMA-placed host arena, and
timed windows of copies on command.

The parent sends ``("run", workload, start_at, seconds)``; the worker waits for ``start_at``
(``time.time()``, one clock for every process of the host), repeats steps until ``seconds`` have
passed, checks the bytes of its last step against an oracle and answers with what it moved. A
step moves bytes both ways at once:

- ``link``: one contiguous copy of ``link_bytes`` into the arena and one out of it (GPU: a D2H and
  an H2D on two streams; CPU: two numpy copies between the arena and a buffer standing in for the
  device): what the link (or memory) gives with no kvoffload code in the way.
- ``kv``: a kvoffload store of ``blocks`` engine blocks to host slots and a load of ``blocks``
  others from other slots, submitted together to the copy backend (``method``: ``staged`` on a
  GPU, ``host`` on a CPU).

Any error is sent to the parent as ``("error", text)``; the parent stops the run with it.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvoffload.store.arena import HostArena
from kvoffload.store.numa import NumaSetting, Topology
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.shapes import MODELS, engine_tensors
from kvoffload.transfer.spec import TransferSpec
from kvoffload.transfer.topology import arena_placement, gpu_bus_id

WAIT_S = 120.0  # longest a step's copy may take before the worker reports it stuck


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    device: str  # "cpu" or "cuda:<i>"
    numa_node: NumaSetting
    bind_cpus: bool  # run on the CPUs of the arena's node, when it has one
    model: str
    layout: str
    block_size: int
    blocks: int
    method: str
    link_bytes: int
    sysfs: str  # sysfs root (tests give a fake one)


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.cuda = spec.device.startswith("cuda")
        shape = MODELS[spec.model]
        pool = 2 * spec.blocks
        slot = shape.block_bytes(spec.block_size)
        slots = max(pool, -(-2 * spec.link_bytes // slot))
        # placement and CPU affinity first: threads started later (CUDA's, the backend's) inherit it
        topology = Topology(Path(spec.sysfs))
        placement = arena_placement(spec.numa_node, spec.device, slots * slot, topology)
        self.cpus: list[int] | None = None
        if spec.bind_cpus and placement.node is not None:
            self.cpus = topology.cpus(placement.node)
            os.sched_setaffinity(0, self.cpus)
        if self.cuda:
            torch.cuda.set_device(torch.device(spec.device))
        gen = torch.Generator(device=spec.device).manual_seed(spec.rank)

        def alloc(s: tuple[int, ...]) -> torch.Tensor:  # as transfer.kv.SyntheticKV does
            if shape.dtype_bytes == 1:
                return torch.randint(
                    0, 256, s, device=spec.device, generator=gen, dtype=torch.uint8
                )
            return torch.randn(s, device=spec.device, generator=gen, dtype=torch.bfloat16)

        self.tensors, self.block_dim = engine_tensors(
            shape, spec.layout, pool, spec.block_size, alloc
        )
        self.kv = KVLayout.from_tensors(
            self.tensors, block_size=spec.block_size, block_dim=self.block_dim
        )
        if self.kv.slot_bytes != slot:
            raise RuntimeError(f"expected {slot}-byte slots, got {self.kv.slot_bytes}")
        pin = None
        if self.cuda:
            from kvoffload.transfer.pinning import cuda_pin

            pin = cuda_pin
        self.arena = HostArena(slots, slot, pin=pin, placement=placement)
        # every slot distinct (its index in its first 8 bytes), so a load from a wrong slot shows
        self.arena.slots[:] = np.random.default_rng(spec.rank).integers(0, 256, slot, np.uint8)
        ids = np.arange(slots, dtype="<u8").view(np.uint8).reshape(slots, 8)
        self.arena.slots[:, : min(8, slot)] = ids[:, : min(8, slot)]
        self.backend = _backend(spec.method, self.kv, self.arena)
        rng = np.random.default_rng(spec.rank)
        blocks, where = rng.permutation(pool), rng.permutation(pool)
        n = spec.blocks
        self.store = [TransferSpec.of("store", blocks[:n], where[:n])]
        self.load = [TransferSpec.of("load", blocks[n:], where[n:])]
        flat = self.arena.slots.reshape(-1)
        self.host_in = torch.from_numpy(flat[: spec.link_bytes])
        self.host_out = torch.from_numpy(flat[spec.link_bytes : 2 * spec.link_bytes])
        self.dev_src = torch.randint(
            0, 256, (spec.link_bytes,), device=spec.device, generator=gen, dtype=torch.uint8
        )
        self.dev_dst = torch.empty_like(self.dev_src)
        if self.cuda:
            self.streams = (torch.cuda.Stream(), torch.cuda.Stream())

    def info(self) -> dict[str, Any]:
        found = self.arena.numa_where()
        bus = gpu_bus_id(self.spec.device) if self.cuda else None
        name = torch.cuda.get_device_name() if self.cuda else "cpu"
        return {
            **asdict(self.spec),
            "pid": os.getpid(),
            "device_name": name,
            "bus_id": bus,
            "placement": asdict(self.arena.placement),
            "arena_bytes": self.arena.nbytes,
            "arena_pages": found,
            "cpus": self.cpus,  # the node's CPUs it was bound to, None: not bound
            "affinity": sorted(os.sched_getaffinity(0)),
            "slot_bytes": self.kv.slot_bytes,
            "path": _path(self.backend),
        }

    def step(self, workload: str) -> int:
        """One step of ``workload``; the bytes it moved (both directions)."""
        if workload == "link":
            if self.cuda:
                with torch.cuda.stream(self.streams[0]):
                    self.host_in.copy_(self.dev_src, non_blocking=True)
                with torch.cuda.stream(self.streams[1]):
                    self.dev_dst.copy_(self.host_out, non_blocking=True)
                self.streams[0].synchronize()
                self.streams[1].synchronize()
            else:
                self.host_in.copy_(self.dev_src)
                self.dev_dst.copy_(self.host_out)
            return 2 * self.spec.link_bytes
        pendings = [self.backend.submit(self.store), self.backend.submit(self.load)]
        for p in pendings:
            if not p.wait(WAIT_S) or p.error() is not None:
                raise RuntimeError(f"rank {self.spec.rank}: a {workload} copy failed: {p.error()}")
        return 2 * self.spec.blocks * self.kv.slot_bytes

    def check(self, workload: str) -> bool:
        """Whether the last step's destinations hold their sources' bytes."""
        if workload == "link":
            return bool(
                torch.equal(self.host_in, self.dev_src.cpu())
                and torch.equal(self.dev_dst.cpu(), self.host_out)
            )
        ok = True
        for spec in (*self.store, *self.load):
            host = torch.from_numpy(self.arena.slots[spec.slots, : self.kv.slot_bytes])
            ok = ok and torch.equal(self.slot_images(spec.blocks).cpu(), host)
        return ok

    def slot_images(self, blocks: np.ndarray) -> torch.Tensor:
        """Each block's bytes in host slot order (its regions back to back, tensor order)."""
        index = torch.from_numpy(np.asarray(blocks)).to(self.spec.device)
        parts = [
            t.index_select(self.block_dim, index).movedim(self.block_dim, 0).contiguous()
            for t in self.tensors
        ]
        return torch.cat([p.view(torch.uint8).reshape(len(index), -1) for p in parts], dim=1)

    def window(self, workload: str, start_at: float, seconds: float) -> dict[str, Any]:
        self.step(workload)  # warm-up, outside the window
        while (left := start_at - time.time()) > 0:
            time.sleep(min(left, 0.01))
        t0 = time.time()
        moved, steps = 0, 0
        while time.time() - t0 < seconds:
            moved += self.step(workload)
            steps += 1
        t1 = time.time()
        return {
            "rank": self.spec.rank,
            "device": self.spec.device,
            "bytes": moved,
            "steps": steps,
            "start": t0,
            "end": t1,
            "GBps": moved / (t1 - t0) / 1e9,
            "exact": self.check(workload),
        }

    def close(self) -> None:
        self.backend.close()
        self.arena.close()


def _backend(method: str, kv: KVLayout, arena: HostArena) -> Any:
    """A copy backend by its registry name (``staged``, ``dma``, ``sm``, ``auto``, ``host``)."""
    from kvoffload.transfer.registry import make_backend

    return make_backend(method, kv, arena)


def _path(backend: object) -> dict[str, Any]:
    """Which path the backend ran (``native`` for the core, else its name) and why."""
    return {
        "path": getattr(backend, "path", getattr(backend, "name", "")),
        "path_reason": getattr(backend, "path_reason", None),
    }


def serve(spec: WorkerSpec, conn: Connection) -> None:
    """The process's entry point (``multiprocessing`` spawn): build, answer ``ready``, then run
    windows until told to close."""
    worker = None
    try:
        worker = Worker(spec)
        for workload in ("link", "kv"):  # compile and first-touch before any window
            worker.step(workload)
        conn.send(("ready", worker.info()))
        while True:
            msg = conn.recv()
            if msg[0] == "close":
                break
            _, workload, start_at, seconds = msg
            conn.send(("done", worker.window(workload, start_at, seconds)))
    except Exception:
        conn.send(("error", f"rank {spec.rank} on {spec.device}:\n{traceback.format_exc()}"))
        raise  # the process exits non-zero; the parent stops the run with the text above
    finally:
        if worker is not None:
            worker.close()
        conn.close()
