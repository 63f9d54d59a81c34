"""One real vLLM engine run on CPU, printed as JSON (run by ``test_engine_e2e.py`` in a subprocess).

    python -m tests.vllm.e2e_run MODEL_DIR '{"offload": true, "disk_path": ..., "runs": [...]}'

A tiny random-weight Llama (``load_format="dummy"``, fixed seed) from a local config, token-id
prompts, greedy sampling. Each entry of ``runs`` generates the same prompt once: ``reset`` first
clears the GPU prefix cache (so a reuse can only come through the connector), ``scramble`` first
XORs the host region (a control: tokens must then depend on the loaded bytes). With ``offload`` the
connector is ``KVOffloadConnector`` + ``KVOffloadSpec`` + the ``host`` backend, plus whichever of
``disk_path``/``valkey_url`` is given. Before exiting, the run waits until the lower tiers hold
everything they were given, and reports the counters: vLLM's own (``LLM.get_metrics()``, the
``vllm:`` names it keeps) and the tiers'.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BLOCK = 32  # vLLM's CPU attention wants multiples of 32
PROMPT = list(range(100, 100 + 5 * BLOCK + 3))
TIER_KEYS = ("disk_path", "valkey_url", "valkey_timeout_s")


def main(model: str, spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    if spec.get("offload"):
        kv = KVTransferConfig(
            kv_connector="KVOffloadConnector",
            kv_connector_module_path="kvoffload.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "spec_name": "KVOffloadSpec",
                "spec_module_path": "kvoffload.integrations.vllm",
                "cpu_bytes_to_use": 64 << 20,
                "backend": "host",
                **{k: spec[k] for k in TIER_KEYS if k in spec},
            },
        )
    llm = LLM(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=512,
        block_size=BLOCK,
        enforce_eager=True,
        seed=0,
        max_num_seqs=4,
        tensor_parallel_size=spec.get("tp", 1),
        disable_log_stats=False,
        kv_transfer_config=kv,
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=PROMPT)
    out: dict[str, Any] = {"vllm": __import__("vllm").__version__, "runs": []}
    for run in spec.get("runs", ["plain"]):
        if "scramble" in run:
            scramble_host()
        if "reset" in run:
            assert llm.reset_prefix_cache()
        result = llm.generate([prompt], params, use_tqdm=False)[0]
        out["runs"].append(
            {"tokens": list(result.outputs[0].token_ids), "cached": result.num_cached_tokens}
        )
    if kv is not None:
        out["tiers"] = settle_and_count(llm)
        out["metrics"] = {  # name, or name{tier}: counters and gauges
            m.name + (f"{{{m.labels['tier']}}}" if "tier" in m.labels else ""): m.value
            for m in llm.get_metrics()
            if ("kvoffload" in m.name or "tiering" in m.name) and hasattr(m, "value")
        }
    llm.llm_engine.engine_core.shutdown()  # workers, shared memory (TP>1 leaves /dev/shm files)
    return out


def scramble_host() -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    arena = get_kv_transfer_group().connector_worker.worker.engine.arena
    arena.slots[:] = arena.slots ^ 0x5A


def settle_and_count(llm: Any) -> dict[str, Any]:
    """Wait for the lower tiers' writes to finish, then snapshot every tier's counters."""
    manager = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager
    for tier in manager.secondary_tiers:
        tier.drain_jobs()  # the bytes are written; vLLM collects the results on its next step
    counts = {"host": manager.host.tier.stats.snapshot()}
    for tier in manager.secondary_tiers:
        counts[tier.short] = tier.tier.stats.snapshot()
    return counts


if __name__ == "__main__":
    print("E2E " + json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
