#!/usr/bin/env bash
# The Prometheus server that tests/test_prometheus.py starts (and stops) itself, from the OS
# packages (Debian 12: prometheus 2.42). Idempotent. Usage: bash .ci/prometheus.sh (as root, or
# with sudo on PATH). The package starts a system service where systemd runs; the test needs none.
set -euo pipefail
if ! command -v prometheus >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    if command -v systemctl >/dev/null 2>&1 && systemctl is-system-running >/dev/null 2>&1; then
        $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
fi
command -v prometheus >/dev/null 2>&1 || { echo "prometheus.sh: no prometheus after installing" >&2; exit 1; }
prometheus --version 2>&1 | head -1
