"""kvoffload for vLLM 0.32-0.33 (see ``docs/vllm.md``).

``KVOffloadSpec`` plugs into vLLM's own ``OffloadingConnector``; ``KVOffloadConnector`` is that
connector plus recovery from failed copies (``OffloadingConnector`` here is the same class, for
vLLM's ``--kv-offloading-size``). ``KVOffloadDiskTier`` and ``KVOffloadValkeyTier`` are our lower
tiers as vLLM secondary tiers. All import vLLM, so they are loaded on first access: the vLLM-free
parts (``options``, ``canonical``, ``plan``, ``engine``, ``tier``, ``region``) import without it.
"""

from __future__ import annotations

import functools
import importlib
import re
from typing import Any

# vLLM releases the adapter is tested with (major, minor): it reads vLLM internals that change
# between releases (docs/vllm.md lists them).
SUPPORTED_VLLM = ((0, 32), (0, 33))

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
    check_vllm_version()
    return getattr(importlib.import_module(where[0]), where[1])


@functools.cache
def check_vllm_version() -> None:
    """ImportError unless the installed vLLM is a release in ``SUPPORTED_VLLM``."""
    import vllm

    found = str(getattr(vllm, "__version__", "unknown"))
    parts = re.match(r"(\d+)\.(\d+)", found)
    if parts is None or (int(parts[1]), int(parts[2])) not in SUPPORTED_VLLM:
        tested = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_VLLM)
        raise ImportError(
            f"kvoffload.integrations.vllm supports vLLM {tested} (it reads vLLM internals that "
            f"change between releases; see docs/vllm.md), got vLLM {found}"
        )
