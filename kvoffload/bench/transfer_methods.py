"""The methods ``kvoffload bench transfer`` compares, built by name (torch-free at import).

``staged`` is the library's default backend: the native engine where it runs, the ``dma``
backend where not; the JSON records which (``path_of``). ``vllm-triton`` is vLLM's own Triton
copy kernel reproduced by ``kvoffload.bench.vllm_triton`` (imported only when asked for; without
that module the method is skipped with a note).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from kvoffload.bench.transfer_cases import METHODS
from kvoffload.store.arena import HostArena
from kvoffload.transfer.backend import CopyBackend
from kvoffload.transfer.layout import KVLayout

VLLM_TRITON = "kvoffload.bench.vllm_triton"


def unavailable(method: str) -> str | None:
    """Why ``method`` cannot run in this checkout, or None; ValueError for an unknown name."""
    if method not in METHODS:
        raise ValueError(f"expected a method in {list(METHODS)}, got {method!r}")
    if method == "vllm-triton" and importlib.util.find_spec(VLLM_TRITON) is None:
        return f"skipped: {VLLM_TRITON} is absent from this checkout"
    return None


def make(method: str, kv: KVLayout, arena: HostArena) -> CopyBackend:
    """A backend for ``method`` over ``kv`` and ``arena``."""
    from kvoffload.transfer.registry import make_backend

    if method == "dma":
        from kvoffload.transfer.cuda.dma import DmaBackend

        return DmaBackend(kv, arena, merge=False)  # one descriptor per piece, as vLLM does
    if method == "vllm-triton":
        module: Any = importlib.import_module(VLLM_TRITON)
        backend: CopyBackend = module.make_backend(kv, arena)
        return backend
    if method in ("staged", "sm", "auto"):  # auto: the planner, as users get it
        return make_backend(method, kv, arena)
    raise ValueError(f"expected a method in {list(METHODS)}, got {method!r}")


def path_of(backend: object) -> dict[str, Any]:
    """Which path a backend ran (``path``: ``native`` for the engine, else the backend's name,
    e.g. ``dma`` where ``staged`` fell back) and why."""
    return {
        "path": getattr(backend, "path", getattr(backend, "name", "")),
        "path_reason": getattr(backend, "path_reason", None),
    }
