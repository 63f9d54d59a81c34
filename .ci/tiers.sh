#!/usr/bin/env bash
# Lower tiers: install a Valkey (or Redis) server and its CLI (cluster set-up) from the OS packages,
# openssl (the TLS tests make throwaway certificates) and the Python client, so tests/test_tier_*.py
# run against real servers and clusters. Idempotent: does nothing that is already done.
# Usage: bash .ci/tiers.sh   (as root, or with sudo on PATH; inside the venv that runs pytest)
# The tests start and stop their own server on 127.0.0.1 at a free port; nothing stays running.
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1 || command -v "$2" >/dev/null 2>&1; }
have_server() { have valkey-server redis-server; }
have_all() { have_server && have valkey-cli redis-cli && have openssl openssl; }

if ! have_all; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    # Valkey where the distribution ships it (Debian 13+), else Redis (Debian 12): same protocol.
    # The -tools packages hold the CLIs (the server packages depend on them).
    if apt-cache show valkey-server >/dev/null 2>&1; then
        $SUDO apt-get install -y -qq valkey-server valkey-tools openssl >/dev/null
    else
        $SUDO apt-get install -y -qq redis-server redis-tools openssl >/dev/null
    fi
    # The packages start a system service where systemd runs; the tests need none of it.
    if command -v systemctl >/dev/null 2>&1 && systemctl is-system-running >/dev/null 2>&1; then
        $SUDO systemctl disable --now valkey-server redis-server >/dev/null 2>&1 || true
    fi
fi
have_all || { echo "tiers.sh: no server, CLI or openssl after installing" >&2; exit 1; }

# The client (the 'tiers' extra) and hiredis, its C reply parser: ~1.35x faster GETs of 2 MiB
# values than the pure-Python parser on the machine where docs/tiers.md was measured.
python -m pip install -q 'redis>=5.0' 'hiredis>=2.0'
python - <<'PY'
import redis
from kvoffload.store.tiers.local_server import cli_binary, server_binary
print(f"tiers: server {server_binary()}, CLI {cli_binary()}, redis-py {redis.__version__}")
PY
