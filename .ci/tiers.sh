#!/usr/bin/env bash
# Lower tiers: install a Valkey (or Redis) server from the OS packages and the Python client, so
# tests/test_tier_*.py run against a real server. Idempotent: does nothing that is already done.
# Usage: bash .ci/tiers.sh   (as root, or with sudo on PATH; inside the venv that runs pytest)
# The tests start and stop their own server on 127.0.0.1 at a free port; nothing stays running.
set -euo pipefail

have_server() { command -v valkey-server >/dev/null 2>&1 || command -v redis-server >/dev/null 2>&1; }

if ! have_server; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    # Valkey where the distribution ships it (Debian 13+), else Redis (Debian 12): same protocol.
    if apt-cache show valkey-server >/dev/null 2>&1; then
        $SUDO apt-get install -y -qq valkey-server >/dev/null
    else
        $SUDO apt-get install -y -qq redis-server >/dev/null
    fi
    # The packages start a system service where systemd runs; the tests need none of it.
    if command -v systemctl >/dev/null 2>&1 && systemctl is-system-running >/dev/null 2>&1; then
        $SUDO systemctl disable --now valkey-server redis-server >/dev/null 2>&1 || true
    fi
fi
have_server || { echo "tiers.sh: no valkey-server or redis-server after installing" >&2; exit 1; }

# The client (the 'tiers' extra) and hiredis, its C reply parser: ~1.35x faster GETs of 2 MiB
# values than the pure-Python parser on the machine where docs/tiers.md was measured.
python -m pip install -q 'redis>=5.0' 'hiredis>=2.0'
python - <<'PY'
import redis
from kvoffload.store.tiers.local_server import server_binary
print(f"tiers: server {server_binary()}, redis-py {redis.__version__}")
PY
