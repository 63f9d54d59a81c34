"""A CPU stand-in for the CUDA pieces the copy backends call, so their host logic runs on CPU.

Every operation is carried out at the moment it is enqueued, in enqueue order, on real memory:
``memcpy_batch`` and ``memcpy`` move bytes with ``ctypes.memmove``, the copy kernel moves each
block's pages exactly as ``kernels.copy_blocks`` defines them, "device" tensors are CPU tensors.
A pipeline that enqueues work in an order its own events allow therefore produces the real bytes,
and a descriptor, staging offset or chunk boundary computed wrong shows up as wrong bytes. What it
does not test: GPU-side concurrency (events are always complete once recorded), Triton, the
driver. Those are the GPU tests' job (tests/gpu).

Use the ``fake_cuda`` fixture (``tests/conftest.py`` does not enable it globally).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
import torch

from kvoffload.transfer.cuda import base, driver, pending
from kvoffload.transfer.layout import KVLayout

_ids = itertools.count(16)


class FakeStream:
    def __init__(self, device: Any = None) -> None:
        self.cuda_stream = next(_ids)

    def synchronize(self) -> None:
        return

    def wait_event(self, event: Any) -> None:
        return


@dataclass
class Calls:
    """What the backends asked of the fake driver, in order (for assertions)."""

    log: list[tuple[Any, ...]] = field(default_factory=list)
    descriptors: int = 0
    launches: int = 0


class FakeDriver:
    """``CudaDriver``'s interface, moving bytes at once."""

    version = 13000
    batch_resolved = True

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    def memcpy_batch(self, table: np.ndarray, stream: int) -> None:
        if stream in (0, driver.CU_STREAM_LEGACY):
            raise ValueError("expected a created CUDA stream for the copy, got the legacy one")
        if table.dtype != np.int64 or table.ndim != 2 or table.shape[0] != 3:
            raise ValueError(f"expected an int64 (3, n) table, got {table.dtype} {table.shape}")
        for src, dst, size in zip(*(row.tolist() for row in table), strict=True):
            ctypes.memmove(dst, src, size)
        self.calls.descriptors += table.shape[1]
        self.calls.log.append(("batch", stream, table.shape[1]))

    def memcpy(self, src: int, dst: int, nbytes: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)
        self.calls.log.append(("copy", stream, nbytes))


class FakeLauncher:
    """``kernels.CopyLauncher``: the copy kernel's contract, block by block, region by region."""

    calls: Calls

    def launch(
        self,
        stream: Any,
        programs: int,
        blocks: Any,
        slots: Any,
        regions: Any,
        first: int,
        n_blocks: int,
        n_regions: int,
        host_base: int,
        slot_stride: int,
        to_host: bool,
        identity: bool,
        jobs: int,
        words: int,
        num_warps: int = 4,
    ) -> None:
        table = regions.numpy()
        bases, strides, pages, offsets = (table[k, :n_regions].tolist() for k in range(4))
        ids = blocks.numpy()[first : first + n_blocks].tolist()
        slot_ids = (
            list(range(n_blocks)) if identity else slots.numpy()[first : first + n_blocks].tolist()
        )
        for b, s in zip(ids, slot_ids, strict=True):
            for base_, stride, page, off in zip(bases, strides, pages, offsets, strict=True):
                eng = base_ + b * stride
                slot = host_base + s * slot_stride + off
                size = page // 8 * 8
                if to_host:
                    ctypes.memmove(slot, eng, size)
                else:
                    ctypes.memmove(eng, slot, size)
        FakeLauncher.calls.launches += 1
        FakeLauncher.calls.log.append(("launch", stream.cuda_stream, n_blocks))


def cuda_layout(kv: KVLayout) -> KVLayout:
    """``kv`` (built from CPU tensors) as if its tensors were on the GPU."""
    return replace(kv, device="cuda:0")


def no_pin(address: int, nbytes: int) -> Any:
    return lambda: None


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    """Patch torch.cuda, the driver module and the kernel launcher for the duration of a test."""
    calls = Calls()
    events = itertools.count(1 << 20)
    recorded: dict[int, int] = {}

    def event_record(event: int, stream: int) -> None:
        recorded[event] = stream
        calls.log.append(("record", stream, event))

    def stream_wait_event(stream: int, event: int) -> None:
        calls.log.append(("wait", stream, event))

    patches = {
        "event_create": lambda: next(events),
        "event_destroy": lambda event: None,
        "event_record": event_record,
        "event_done": lambda event: True,
        "stream_wait_event": stream_wait_event,
        "current_context": lambda: 1,
        "host_device_pointer": lambda address: address,
    }
    for name, fn in patches.items():
        monkeypatch.setattr(driver, name, fn)
    monkeypatch.setattr(driver.CudaDriver, "load", classmethod(lambda cls, **kw: FakeDriver(calls)))
    FakeLauncher.calls = calls
    # The backends import the launcher from this module when they start. CPU torch wheels come
    # without Triton, so the module is replaced whole rather than patched after importing it.
    kernels = types.ModuleType("kvoffload.transfer.cuda.kernels")
    kernels.CopyLauncher = FakeLauncher  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, kernels.__name__, kernels)
    monkeypatch.setattr(base, "_current_stream", lambda device: 7)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    real_empty, real_to = torch.empty, torch.Tensor.to

    def empty(*shape: Any, device: Any = None, pin_memory: bool = False, **kw: Any) -> Any:
        if device is not None and torch.device(device).type == "cuda":
            device = None
        return real_empty(*shape, device=device, **kw)

    def to(self: torch.Tensor, *args: Any, **kw: Any) -> Any:
        if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
            return self
        return real_to(self, *args, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(pending, "ENQUEUE_TIMEOUT", 10.0)
    yield calls
    gc.collect()  # pendings left over give their events back while the fake is in place
