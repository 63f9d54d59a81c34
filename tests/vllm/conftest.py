"""vLLM contract tests: skipped where vLLM is not installed (the main CPU suite).

vLLM runs on CPU here, with no compiled ops and no network: ``VLLM_TARGET_DEVICE=cpu`` and
``HF_HUB_OFFLINE=1`` are set before any test module imports it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


import pytest


@pytest.fixture(autouse=True)
def _close_engine_sims():
    yield
    if "tests.vllm.harness" in sys.modules:  # engines built by this test: close them
        from tests.vllm.harness import OPEN

        while OPEN:
            OPEN.pop().close()


@pytest.fixture
def build(tmp_path: Path) -> Iterator[Any]:
    """vLLM's fs tier or one of ours over a primary view (``tier_support.tier_builder``)."""
    from tests.vllm.tier_support import tier_builder

    with tier_builder(tmp_path) as make:
        yield make
