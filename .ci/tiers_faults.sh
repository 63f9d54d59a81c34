#!/usr/bin/env bash
# Lower tiers, the reliability run: host + disk + Valkey traffic with byte flips in slabs and
# values, server kill -9 / freeze and engine restarts, for KVOFFLOAD_FAULT_S seconds (90 here; the
# plain test run does 20). Fails on any wrong byte, exception or broken invariant; prints the
# counts (docs/tiers.md quotes a run of it). Needs what .ci/tiers.sh installs.
set -euo pipefail
cd "$(dirname "$0")/.."
export CI="${CI:-1}"  # a missing server fails instead of skipping
KVOFFLOAD_FAULT_S="${KVOFFLOAD_FAULT_S:-90}" python -m pytest -q -s -p no:cacheprovider \
    tests/test_tier_faults.py
