"""Shared pieces of the lower-tier tests: real Valkey/Redis servers and clusters, throwaway TLS
certificates, small filesystems, a tiny engine whose KV is numpy arrays of random bytes.

The server is the OS package's ``valkey-server`` or ``redis-server`` on 127.0.0.1 at a free port
(``.ci/tiers.sh`` installs it, with its CLI and the ``redis`` client). Without them the tests that
need them skip with ``SERVER_MISSING`` in the reason (``tests/conftest.py`` counts those in the
summary line), except under CI (``CI`` set), where a missing server is a failure.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvoffload import KVLayout, OffloadConfig, build_local
from kvoffload.offload import Offloader, TransferWorker
from kvoffload.offload.local import LocalOffload
from kvoffload.offload.tiers import TierMover
from kvoffload.store.arena import HostArena
from kvoffload.store.tiers.local_server import (
    LocalCluster,
    LocalServer,
    ServerTls,
    cli_binary,
    server_binary,
)
from kvoffload.transfer.host import HostBackend

MODEL = "test/model@rev1"
NUM_BLOCKS, BS, LAYERS = 32, 16, 2
BLOCK_SHAPE = (BS, 2, 32)  # tokens, kv heads, head size (int16): 2 KiB per K or V page


SERVER_MISSING = "lower-tier test: needs valkey-server or redis-server"  # conftest counts these


def _missing(what: str) -> None:
    msg = f"{SERVER_MISSING} ({what}; bash .ci/tiers.sh installs it)"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


def require_server() -> None:
    if server_binary() is None:
        _missing("no valkey-server or redis-server on PATH")
    if importlib.util.find_spec("redis") is None:
        _missing("no redis client: pip install -e '.[tiers]'")


def require_cluster() -> None:
    require_server()
    if cli_binary() is None:
        _missing("no valkey-cli or redis-cli on PATH")


@contextlib.contextmanager
def running_server(maxmemory: str = "0", **kwargs: Any) -> Iterator[LocalServer]:
    require_server()
    server = LocalServer(maxmemory=maxmemory, **kwargs).start()
    try:
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def running_cluster(**kwargs: Any) -> Iterator[LocalCluster]:
    """3 primaries + 3 replicas on loopback (``LocalCluster``), stopped afterwards."""
    require_cluster()
    with LocalCluster(**kwargs) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    """One 3 + 3 cluster shared by the tests that do not kill its nodes."""
    with running_cluster() as c:
        yield c


@dataclass(frozen=True)
class Certs:
    """Throwaway PEM files: a CA, a server certificate for 127.0.0.1 and a client certificate
    it signed, and a second CA that signed nothing here."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str

    def server_tls(self, require_client_cert: bool = True) -> ServerTls:
        return ServerTls(
            self.server_cert,
            self.server_key,
            self.ca,
            require_client_cert,
            self.client_cert,
            self.client_key,
        )


def make_certs(root: Path) -> Certs:
    """Certificates made with the ``openssl`` command (EC P-256, valid 2 days)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        _missing("no openssl on PATH to make test certificates")
    root.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl or "", *args], cwd=root, capture_output=True, check=True)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    days = ["-days", "2"]
    for ca in ("ca", "other-ca"):
        subject = ["-subj", f"/CN=kvoffload test {ca}"]
        run("req", "-x509", *key, "-keyout", f"{ca}.key", "-out", f"{ca}.crt", *days, *subject)
    (root / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    (root / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    signed_by_ca = ["-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", *days]
    for who in ("server", "client"):
        run("req", *key, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={who}")
        out = ["-out", f"{who}.crt", "-extfile", f"{who}.ext"]
        run("x509", "-req", "-in", f"{who}.csr", *signed_by_ca, *out)
    names = ("ca.crt", "server.crt", "server.key", "client.crt", "client.key", "other-ca.crt")
    return Certs(*(str(root / name) for name in names))


def redis_client(server: LocalServer, password: str | None = None):  # -> redis.Redis (tests)
    import redis

    return redis.Redis.from_url(server.url, password=password)


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on a fresh directory; skips where mounting is not allowed."""
    if shutil.which("mount") is None:
        pytest.skip("cannot mount a tmpfs here (no mount command)")
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


def random_blocks(n: int, nbytes: int, seed: int = 0) -> np.ndarray:
    """``n`` blocks of ``nbytes`` seeded random bytes, one per row."""
    return np.random.default_rng(seed).integers(0, 256, (n, nbytes), dtype=np.uint8)


def block_keys(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(4, "little") * 4 for i in range(n)]


def views(arr: np.ndarray) -> list[memoryview]:
    return [memoryview(row) for row in arr]


def wait_for(cond: Any, timeout: float = 15.0) -> bool:
    """Poll ``cond()`` every 50 ms; True once it holds, False after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


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


def build_with(kv: list[np.ndarray], host_blocks: int, make_tiers, **options: Any) -> LocalOffload:
    """Like ``build``, with tiers made by ``make_tiers(slot_bytes)`` (test doubles that subclass
    the real tiers, or fakes that move real bytes)."""
    layout = layout_of(kv)
    engine_blocks = [g.num_blocks for g in layout.groups]
    config = OffloadConfig(host_capacity_blocks=host_blocks, **options)
    offloader = Offloader(config, layout.slot_bytes, engine_blocks, layout.block_size)
    arena = HostArena(offloader.num_slots, layout.slot_bytes)
    mover = TierMover(arena, make_tiers(layout.slot_bytes))
    offloader.attach_tiers(mover)
    worker = TransferWorker(HostBackend(layout, arena), offloader)
    return LocalOffload(offloader, worker, arena, mover)


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
