"""Shared test setup: GPU tests skip cleanly where CUDA is absent.

A GPU test carries the marker ``gpu``; every test under ``tests/gpu/`` gets it automatically.
"""

from __future__ import annotations

import functools

import pytest


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
