"""kvoffload for vLLM 0.32-0.33 (see ``docs/vllm.md``).

``KVOffloadSpec`` plugs into vLLM's own ``OffloadingConnector``; ``KVOffloadConnector`` is that
connector plus recovery from failed copies (``OffloadingConnector`` here is the same class, for
vLLM's ``--kv-offloading-size``). ``KVOffloadDiskTier`` and ``KVOffloadValkeyTier`` are our lower
tiers as vLLM secondary tiers. All import vLLM, so they are loaded on first access: the vLLM-free
parts (``options``, ``canonical``, ``plan``, ``engine``, ``tier``, ``region``) import without it.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {  # name -> (module, attribute)
    "KVOffloadSpec": ("kvoffload.integrations.vllm.spec", "KVOffloadSpec"),
    "KVOffloadConnector": ("kvoffload.integrations.vllm.connector", "KVOffloadConnector"),
    "OffloadingConnector": ("kvoffload.integrations.vllm.connector", "KVOffloadConnector"),
    "KVOffloadDiskTier": ("kvoffload.integrations.vllm.secondary", "KVOffloadDiskTier"),
    "KVOffloadValkeyTier": ("kvoffload.integrations.vllm.secondary", "KVOffloadValkeyTier"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(where[0]), where[1])
