"""kvoffload for vLLM 0.33 (``pip install 'kvoffload[vllm]'``; see ``docs/vllm.md``).

``KVOffloadSpec`` plugs into vLLM's own ``OffloadingConnector``; ``KVOffloadConnector`` is that
connector plus recovery from failed copies. Both import vLLM, so they are loaded on first access:
the vLLM-free parts (``options``, ``canonical``, ``plan``, ``engine``, ``tier``) import without it.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "KVOffloadSpec": "kvoffload.integrations.vllm.spec",
    "KVOffloadConnector": "kvoffload.integrations.vllm.connector",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
