#!/usr/bin/env bash
# Lower tiers on the GPU host (issue 30): `bench tiers --sections read` (one engine process reading
# 2 MiB blocks from one local server and a local 3 + 3 cluster, against the server's raw GETs and
# redis-benchmark) and `bench e2e --lower-tiers valkey,valkey-cluster,disk` on Llama-3-8B and
# Qwen2.5-7B shapes: Valkey on one server (slower than an H100's prefill: the rule declines it) and
# on a 3 + 3 cluster started by the benchmark (4.1 GB/s read with 4 threads on the H100 host: the
# rule can take it), and disk.
# The machine has no package index: the server, its CLI (`--cluster create`) and the client come
# from .carry/redis, built HERE by `bash benchmarks/carry_redis.sh` (and carried with the run).
# From the repository root:
#
#   OUT=/some/dir bash benchmarks/gpu_lower_tiers.sh
#   MODELS=tiny MIB=64 DOCUMENTS=4 OUT=/tmp/x bash benchmarks/gpu_lower_tiers.sh  # CPU smoke test
#
# Options (environment): MODELS (default "llama3-8b qwen2.5-7b"), DOCUMENTS per workload (default
# 12: 2 verified, 10 timed), TIER_THREADS (default 4, as the 4.1 GB/s cluster read), MIB (512),
# WORKLOADS (default valkey,valkey-cluster,disk).
# Writes under $OUT: lower_tiers.log, tiers_read_gpu.json, e2e_lower_<model>.json (Qwen with
# 32-token blocks, as benchmarks/gpu_run.sh runs it). Each e2e JSON has, per workload, `target`
# (which bound applied: the rule loaded or recomputed; `met`: p50 TTFT restored <= recompute's),
# `paired_ms` (per document, restored minus recompute: median, its interval, the order effect),
# and `requests` (per request: its order, TTFT, the engine's host steps, the host time in each
# kvoffload call, the engine's thread waiting for tier I/O, what the tiers' threads did).
# Each step has its own time limit; expected about 4 minutes together on the H100 host.
# Exit status: non-zero if any step failed or a restored turn was not bit-exact.
set -o pipefail
OUT=${OUT:-benchmarks/results/gpu_lower_tiers}
mkdir -p "$OUT"
CARRY=$PWD/.carry/redis
if [ ! -x "$CARRY/bin/redis-server" ] || [ ! -x "$CARRY/bin/redis-cli" ]; then
  echo "gpu_lower_tiers.sh: no $CARRY/bin/redis-server or redis-cli; run" \
    "benchmarks/carry_redis.sh first" >&2
  exit 1
fi
export PATH="$CARRY/bin:$PATH" PYTHONPATH=".:$CARRY/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LOG="$OUT/lower_tiers.log"
status=0
step() {
  echo "=== $* ($(date -u +%H:%M:%S))" | tee -a "$LOG"
  "$@" 2>&1 | tee -a "$LOG" || { status=1; echo "=== FAILED: $*" | tee -a "$LOG"; }
}
step redis-server --version
step redis-cli --version
step timeout 50 python3 -m kvoffload.cli bench tiers --sections read --mib "${MIB:-512}" --rounds 1 \
  --out "$OUT/tiers_read_gpu.json"
for model in ${MODELS:-llama3-8b qwen2.5-7b}; do
  case $model in qwen*) bs=32 ;; *) bs=16 ;; esac
  step timeout 200 python3 -m kvoffload.cli bench e2e --model "$model" --block-size "$bs" \
    --lower-tiers "${WORKLOADS:-valkey,valkey-cluster,disk}" --documents "${DOCUMENTS:-12}" \
    --tier-threads "${TIER_THREADS:-4}" --out "$OUT/e2e_lower_$model.json"
done
exit $status
