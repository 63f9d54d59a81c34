"""Shared pieces of the lower-tier tests: a real Valkey/Redis server, small filesystems, a tiny
engine whose KV is numpy arrays of random bytes.

The server is the OS package's ``valkey-server`` or ``redis-server`` on 127.0.0.1 at a free port
(``.ci/tiers.sh`` installs it). Without one the tests that need it skip, except under CI (``CI``
set), where a missing server is a failure rather than a silent skip.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvoffload import KVLayout, OffloadConfig, build_local
from kvoffload.offload import Offloader, TransferWorker
from kvoffload.offload.local import LocalOffload
from kvoffload.offload.tiers import TierMover
from kvoffload.store.arena import HostArena
from kvoffload.store.tiers.local_server import LocalServer, server_binary
from kvoffload.transfer.host import HostBackend

MODEL = "test/model@rev1"
NUM_BLOCKS, BS, LAYERS = 32, 16, 2
BLOCK_SHAPE = (BS, 2, 32)  # tokens, kv heads, head size (int16): 2 KiB per K or V page


def require_server() -> None:
    if server_binary() is not None:
        return
    msg = "needs valkey-server or redis-server on PATH (run .ci/tiers.sh)"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


@contextlib.contextmanager
def running_server(maxmemory: str = "0") -> Iterator[LocalServer]:
    require_server()
    server = LocalServer(maxmemory=maxmemory).start()
    try:
        yield server
    finally:
        server.close()


def redis_client(server: LocalServer):  # -> redis.Redis (typed loosely: tests only)
    import redis

    return redis.Redis.from_url(server.url)


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on a fresh directory; skips where mounting is not allowed."""
    path = Path(tempfile.mkdtemp(prefix="kvoffload-tmpfs-"))
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        path.rmdir()
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        path.rmdir()


def remount(path: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


def engine_kv(seed: int, num_blocks: int = NUM_BLOCKS) -> list[np.ndarray]:
    """Per-layer ``[2, num_blocks, bs, heads, hd]`` int16 KV filled with seeded random bytes."""
    rng = np.random.default_rng(seed)
    return [
        rng.integers(-(2**15), 2**15, (2, num_blocks, *BLOCK_SHAPE), dtype=np.int16)
        for _ in range(LAYERS)
    ]


def layout_of(kv: list[np.ndarray]) -> KVLayout:
    return KVLayout.from_tensors(kv, block_size=BS, block_dim=1)


def blocks_of(kv: list[np.ndarray], ids: list[int]) -> list[np.ndarray]:
    return [t[:, ids].copy() for t in kv]


def build(kv: list[np.ndarray], host_blocks: int, **tiers: object) -> LocalOffload:
    config = OffloadConfig.from_dict(
        {"host_capacity_blocks": host_blocks, "model_id": MODEL, **tiers}
    )
    return build_local(layout_of(kv), config)


def build_with(kv: list[np.ndarray], host_blocks: int, make_tiers) -> LocalOffload:
    """Like ``build``, with tiers made by ``make_tiers(slot_bytes)`` (test doubles that subclass
    the real tiers)."""
    layout = layout_of(kv)
    offloader = Offloader(OffloadConfig(host_capacity_blocks=host_blocks), layout.slot_bytes)
    arena = HostArena(offloader.num_slots, layout.slot_bytes)
    mover = TierMover(arena, make_tiers(layout.slot_bytes))
    offloader.attach_tiers(mover)
    return LocalOffload(offloader, TransferWorker(HostBackend(layout, arena)), arena, mover)


def mover_of(local: LocalOffload) -> TierMover:
    assert local.mover is not None
    return local.mover


def tier_of(local: LocalOffload, name: str) -> Any:
    return mover_of(local).tiers[name]


def run_job(local: LocalOffload, job: object) -> None:
    """Submit ``job``, wait for it, and hand its result to the Offloader."""
    assert job is not None
    local.worker.submit(job)  # type: ignore[arg-type]
    assert local.worker.wait([job.job_id], timeout=30) == set()  # type: ignore[attr-defined]
    local.offloader.complete(local.worker.get_finished())


def wait_ready(local: LocalOffload, keys: list[bytes], want: int, timeout: float = 20.0) -> int:
    """Call ``lookup_tiers`` until ``want`` keys are ready or nothing is pending; returns ready."""
    deadline = time.monotonic() + timeout
    while True:
        found = local.offloader.lookup_tiers(keys)
        if found.ready >= want or (not found.pending and not found.probing):
            return found.ready
        if time.monotonic() > deadline:
            raise AssertionError(f"still pending after {timeout} s: {found}")
        time.sleep(0.01)
