#!/usr/bin/env bash
# vLLM contract tests (tests/vllm) in their own venv, so the main test run stays light. They
# include vLLM 0.33.0's own tier tests, vendored under tests/vllm/upstream/ (collected on 0.33
# only), and the same scenarios run against our tiers (tests/vllm/test_tier_*.py).
#
#   .ci/vllm.sh [pytest args]
#
# The venv holds CPU torch 2.13.0, vllm 0.33.0 installed without its dependencies (its metadata
# pins GPU packages and a certifi newer than the index had), and the pure-Python packages vLLM's
# scheduler and offloading connector import, pinned in .ci/vllm-requirements.txt. It is reused
# when it already holds those versions; the install time is printed when it is built.
#
# Environment: VLLM_VENV (default .venv-vllm), PYTHON (default python3),
#   KVOFFLOAD_VLLM_E2E=1 also runs the end-to-end engine test with vllm-cpu 0.32 (.ci/vllm_e2e.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
TORCH=2.13.0+cpu
VLLM=0.33.0

have() {
  "$VENV/bin/python" - "$@" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if all(version(p) == v for p, v in zip(sys.argv[1::2], sys.argv[2::2])) else 1)
EOF
}

if [ -x "$VENV/bin/python" ] && have torch "$TORCH" vllm "$VLLM"; then
  echo "vllm.sh: reusing $VENV (vllm $VLLM, torch $TORCH)"
else
  start=$(date +%s)
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install -q --no-deps)
  # A local CPU wheel (pip find-links) when there is one, else PyTorch's CPU index: a plain
  # `pip install torch` would pull the multi-GB CUDA build.
  "${pip[@]}" --no-index "torch==$TORCH" 2>/dev/null ||
    "${pip[@]}" "torch==$TORCH" --index-url https://download.pytorch.org/whl/cpu
  "${pip[@]}" "vllm==$VLLM"
  "${pip[@]}" -r .ci/vllm-requirements.txt
  echo "vllm.sh: built $VENV in $(($(date +%s) - start)) s, $(du -sh "$VENV" | cut -f1)"
fi

# The Valkey client for the tier tests, beside the venv rather than in it (a venv given by
# VLLM_VENV / VLLM_CPU_VENV may be shared): pinned in .ci/vllm-tiers.txt.
TIERS=.venv-tiers/$(basename "$VENV")
PYTHONPATH="$TIERS" "$VENV/bin/python" -c "import redis, hiredis" 2>/dev/null ||
  "$VENV/bin/python" -m pip install -q --no-deps --target "$TIERS" -r .ci/vllm-tiers.txt

export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PYTHONPATH=".:$TIERS"
"$VENV/bin/python" -m pytest tests/vllm -q -p no:warnings "$@"

if [ "${KVOFFLOAD_VLLM_E2E:-0}" = 1 ]; then
  .ci/vllm_e2e.sh
fi
