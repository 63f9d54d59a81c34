"""Shared test setup: GPU tests skip cleanly where CUDA is absent; lower-tier tests that could
not run are counted in the summary line.

A GPU test carries the marker ``gpu``; every test under ``tests/gpu/`` gets it automatically.
The lower-tier tests start their own Valkey/Redis servers when one is installed; where none is
(a fresh machine), they skip and the final line says how many, and how to install one.
"""

from __future__ import annotations

import functools

import pytest

# The start of every lower-tier skip reason (tests/tiers_support.py: SERVER_MISSING).
TIER_SKIP = "lower-tier test: needs valkey-server or redis-server"
TIER_SKIP_STAT = "lower-tier tests did not run (install a server: bash .ci/tiers.sh)"
# The same for the test that needs a Prometheus server (tests/prometheus_support.py).
PROMETHEUS_SKIP = "Prometheus test: needs prometheus on PATH"
PROMETHEUS_SKIP_STAT = "Prometheus tests did not run (install it: bash .ci/prometheus.sh)"


@functools.cache
def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "/tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marker gpu); none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Put the lower-tier and Prometheus tests that skipped for want of a server into the final
    summary line (``... 12 skipped, 12 lower-tier tests did not run (install a server: ...)``)."""
    skipped = terminalreporter.stats.get("skipped", [])
    for reason, stat in ((TIER_SKIP, TIER_SKIP_STAT), (PROMETHEUS_SKIP, PROMETHEUS_SKIP_STAT)):
        counted = [r for r in skipped if reason in str(getattr(r, "longrepr", ""))]
        if counted:
            terminalreporter.stats[stat] = counted
