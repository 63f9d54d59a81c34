#!/usr/bin/env bash
# The one GPU script: every GPU test under tests/gpu, `kvoffload doctor`, and the GPU transfer
# benchmark (JSON + PNG), in one call on the GPU machine. Run from the repository root:
#
#   OUT=/some/dir bash benchmarks/gpu_run.sh            # full benchmark (a few minutes on an H100)
#   OUT=/some/dir bash benchmarks/gpu_run.sh --quick    # one block size, fewer repetitions
#
# Writes under $OUT: gpu_run.log (everything), transfer_gpu.json, transfer_gpu.png. Extra
# arguments go to `kvoffload bench transfer`. Exit status: non-zero if any step failed.
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
step nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
step timeout 360 python3 -m pytest tests/gpu -q -p no:cacheprovider -m gpu -rs
step python3 -m kvoffload.cli doctor
step timeout 120 python3 -m kvoffload.cli calibrate --pieces 4096,32768,262144,2097152 --blocks 16,128
step timeout 420 python3 -m kvoffload.cli bench transfer --device cuda --out "$OUT/transfer_gpu.json" "$@"
echo "=== done, status $status" | tee -a "$LOG"
exit $status
