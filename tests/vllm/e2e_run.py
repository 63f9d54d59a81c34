"""One real vLLM engine run on CPU, printed as JSON (run by ``test_engine_e2e.py`` in a subprocess).

    python -m tests.vllm.e2e_run MODEL_DIR (offload|plain)

A tiny random-weight Llama (``load_format="dummy"``, fixed seed) from a local config, token-id
prompts, greedy sampling. The same prompt runs twice with the GPU prefix cache reset in between,
so the second run can only reuse its prefix through the connector. With ``offload`` the connector
is ``KVOffloadConnector`` + ``KVOffloadSpec`` + the ``host`` backend; a third run after
scrambling the host arena shows that the tokens depend on the loaded bytes.
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


def main(model: str, mode: str) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    if mode == "offload":
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
        kv_transfer_config=kv,
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=PROMPT)
    out: dict[str, Any] = {"vllm": __import__("vllm").__version__}
    runs = ["first", "second"] + (["scrambled"] if mode == "offload" else [])
    for run in runs:
        if run == "scrambled":
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            arena = get_kv_transfer_group().connector_worker.worker.engine.arena
            arena.slots[:] = arena.slots ^ 0x5A
        if run != "first":
            assert llm.reset_prefix_cache()
        result = llm.generate([prompt], params, use_tqdm=False)[0]
        out[run] = {
            "tokens": list(result.outputs[0].token_ids),
            "cached": result.num_cached_tokens,
        }
        if run == "second" and mode == "offload":
            connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
            out["tier"] = connector.connector_scheduler.manager.tier.stats.snapshot()
    return out


if __name__ == "__main__":
    print("E2E " + json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
