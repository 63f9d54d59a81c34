#!/usr/bin/env bash
# `bench e2e --lower-tiers` on a CPU in the GPU's regime (issue 30): a local redis-server behind
# benchmarks/slow_link.py (MBPS MB/s, default 8), so that Valkey is slower than recomputing the
# micro model's prefix and the load rule declines it, as on an H100; the disk tier is left fast.
# From the repository root (with redis-server on PATH):
#
#   OUT=/some/dir.json bash benchmarks/cpu_lower_tiers.sh [extra bench e2e options]
set -euo pipefail
OUT=${OUT:-kvoffload-results/e2e_lower_micro_cpu.json}
PORTS=$(python3 -c 'import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(" ".join(str(x.getsockname()[1]) for x in s))')
read -r SERVER LINK <<<"$PORTS"
redis-server --port "$SERVER" --bind 127.0.0.1 --save '' --appendonly no >/dev/null &
server_pid=$!
python3 benchmarks/slow_link.py --listen "$LINK" --to "127.0.0.1:$SERVER" --mbps "${MBPS:-8}" &
link_pid=$!
trap 'kill "$link_pid" "$server_pid" 2>/dev/null || true' EXIT
for _ in $(seq 50); do redis-cli -p "$LINK" ping >/dev/null 2>&1 && break; sleep 0.1; done
python3 -m kvoffload.cli bench e2e --lower-tiers valkey,disk --model micro --device cpu \
  --documents "${DOCUMENTS:-12}" --valkey-url "redis://127.0.0.1:$LINK/0" --out "$OUT" "$@"
