#!/usr/bin/env bash
# The one GPU script: every GPU test under tests/gpu, `kvoffload doctor` and `calibrate`, the GPU
# transfer benchmark and the end-to-end TTFT benchmark (JSON + PNG), on the GPU machine. Run from
# the repository root:
#
#   OUT=/some/dir bash benchmarks/gpu_run.sh            # everything
#   OUT=/some/dir bash benchmarks/gpu_run.sh --quick    # transfer: fewer reps, a 150 s budget
#   STEPS="transfer-tests calibrate transfer" OUT=... bash benchmarks/gpu_run.sh  # the data plane
#   STEPS="tests e2e" OUT=... bash benchmarks/gpu_run.sh  # a subset (a device call is <= 10 min)
#
# The data plane's share: see docs/transfer.md ("Running it") for the measured wall time of each
# step; `python3 -m kvoffload.cli bench transfer --dry-run` lists the sweep's cases, methods and
# sections (no GPU). --time-budget-s (default 280 s) bounds the whole transfer run: a fifth goes to
# the host section, and a case whose estimate no longer fits is skipped and listed.
#
# STEPS (default "tests doctor transfer e2e"; "stage": benchmarks/stage_bisect.py's three ways of
# uploading the graph runner's inputs; "calibrate" alone writes the table only; "probe" runs
# benchmarks/staged_sweep.py, the developer probe of slice schedules and scatter programs). Writes
# under $OUT: gpu_run.log (everything), transfer_gpu.json/.png, staged_probe.json, enqueue_probe.json
# (STEPS "enqueue"), e2e_gpu.json/.png,
# e2e_gpu_qwen.json/.png. Extra arguments go to `kvoffload bench transfer`.
# Exit status: non-zero if any step failed.
set -o pipefail
OUT=${OUT:-benchmarks/results/gpu_run}
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVOFFLOAD_CACHE_DIR="${KVOFFLOAD_CACHE_DIR:-$(mktemp -d)}"
LOG="$OUT/gpu_run.log"
status=0
step() {
  echo "=== $* ($(date -u +%H:%M:%S))" | tee -a "$LOG"
  "$@" 2>&1 | tee -a "$LOG" || { status=1; echo "=== FAILED: $*" | tee -a "$LOG"; }
}
STEPS=${STEPS:-tests doctor transfer e2e}
want() { [[ " $STEPS " == *" $1 "* ]]; }
step nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
want tests && step timeout 360 python3 -m pytest tests/gpu -q -p no:cacheprovider -m gpu -rs
want transfer-tests && step timeout 200 python3 -m pytest tests/gpu/test_transfer_backends.py \
  tests/gpu/test_transfer_layers.py tests/gpu/test_transfer_ordering.py -q -p no:cacheprovider -m gpu -rs
want doctor && step python3 -m kvoffload.cli doctor
if want calibrate || want transfer; then
  step timeout 150 python3 -m kvoffload.cli calibrate --pieces 4096,32768,262144,2097152 --blocks 16,128,512
fi
want transfer && step timeout 400 python3 -m kvoffload.cli bench transfer --device cuda --out "$OUT/transfer_gpu.json" "$@"
want probe && step timeout 150 python3 benchmarks/staged_sweep.py "$OUT/staged_probe.json" --label after
# the compiled enqueue loop against the Python one, and inline submission (about 15 s)
want enqueue && step timeout 120 python3 benchmarks/staged_sweep.py "$OUT/enqueue_probe.json" --label enqueue --sections enqueue
# e2e (issue 25): chat and docs, Llama-3-8B then Qwen2.5-7B shapes (32-token blocks), each in the
# eager, piecewise and full graph modes (every graph captured at start), modes recompute, gpu_all
# and kvoffload (the targets' three), trimmed to fit one device call: chat 8 conversations x 8
# turns, docs 16 documents and 48 requests, one zero-reuse round of 8 prompts, 2 sampled turns
# checked per graph mode. Budget: about 6 min for both (timeouts 240 s each); the step's wall time
# is in gpu_run.log. Before the graph modes this step took 226 s for chat + fits (run7).
E2E_TRIM=(--workloads chat,docs --graph eager,piecewise,full --modes recompute,gpu_all,kvoffload
  --conversations 8 --documents 16 --requests 48 --zero-reuse-rounds 1 --zero-reuse-turns 8 --verify 2)
# the graph runner's input upload three ways (benchmarks/stage_bisect.py; issue 25): piecewise
# docs, restored requests only, about 25 s per way
STAGE_ARGS=(--workloads docs --graph piecewise --modes kvoffload --documents 16 --requests 48
  --zero-reuse-rounds 0 --verify 0)
for way in sync pin-per-step persistent-pinned; do
  want stage && step timeout 100 python3 benchmarks/stage_bisect.py "$way" "${STAGE_ARGS[@]}" \
    --out "$OUT/stage_$way.json"
done
want e2e && step timeout 240 python3 -m kvoffload.cli bench e2e "${E2E_TRIM[@]}" --out "$OUT/e2e_gpu.json"
want e2e && step timeout 240 python3 -m kvoffload.cli bench e2e --model qwen2.5-7b --block-size 32 "${E2E_TRIM[@]}" --out "$OUT/e2e_gpu_qwen.json"
echo "=== done, status $status" | tee -a "$LOG"
exit $status
