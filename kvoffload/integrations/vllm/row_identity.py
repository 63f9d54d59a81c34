"""What a host row's bytes mean, for the lower tiers' fingerprint (``row_fingerprint``).

A value in a lower tier is read back only under the same fingerprint: the model identity, KV
dtype, parallel layout, chunk geometry, the spec's row layout and the vLLM version. The parallel
layout is left out where the row's bytes do not depend on it (``layout_free``), so such chunks are
shared across TP sizes. Facts are read only where a real ``OffloadingSpec`` has them, of the types
it has them: vLLM's tests hand tiers a bare ``MagicMock()`` spec, whose every attribute is a mock.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import vllm
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.kv_offload.base import OffloadingSpec

ROW_FORMAT = "kvoffload-vllm-row-1"


def model_identity(spec: OffloadingSpec) -> str:
    """The default ``model_id``: vLLM's model name, revision and KV dtype.

    vLLM hands a spec no revision; it is read from the current vLLM config when one is set (our
    ``KVOffloadConnector`` sets it while the scheduler is built), else recorded as unknown: serve
    several revisions under one model name only with an explicit ``model_id``.
    """
    model = getattr(getattr(spec, "config", None), "model", None)
    name, dtype = spec_fact(model, "name", str), spec_fact(model, "dtype", str)
    current = get_current_vllm_config_or_none()
    revision = current.model_config.revision if current is not None else "unknown"
    return f"{name or 'unknown'}@{revision}|kv={dtype or 'unknown'}"


def layout_free(spec: OffloadingSpec) -> bool:
    """Whether a host row's bytes are the same under every parallel layout, so that values are
    shared across TP sizes: vLLM certified a replicated (MLA) KV cache whose bytes are the same on
    every rank (``replicated_layout``; vLLM's spec then keeps one copy per row, ours one per rank,
    so ``row_bytes`` still tells copy counts apart), or a parallelism-free canonical layout."""
    config = getattr(spec, "config", None)
    if spec_fact(config, "replicated_layout", bool):
        return True
    par = getattr(config, "parallel", None)
    return bool(
        spec_fact(config, "canonical_layout", bool)
        and spec_fact(par, "is_parallelism_agnostic", bool)
    )


def row_fingerprint(spec: OffloadingSpec, row_bytes: int, model_id: str) -> str:
    """32 hex digits naming what a host row's bytes mean: values under another are never read.

    Reads only what a real ``OffloadingSpec`` has, of the types it has them (a test's bare
    ``MagicMock`` spec answers every name with a mock: those facts count as unknown)."""
    config = getattr(spec, "config", None)
    par = getattr(config, "parallel", None)
    cache = getattr(config, "cache", None)
    groups = spec_fact(config, "groups", tuple)
    sizes = ("world_size", "tp_size", "pp_size", "pcp_size", "dcp_size")
    row_layout = getattr(type(spec), "ROW_LAYOUT", None)
    facts = {
        "format": ROW_FORMAT,
        "vllm": vllm.__version__,
        "row_layout": row_layout or f"{type(spec).__module__}.{type(spec).__qualname__}",
        "model_id": model_id,
        "kv_dtype": spec_fact(getattr(config, "model", None), "dtype", str),
        "kv_cache_layout": spec_fact(config, "kv_cache_layout", str),
        "canonical_layout": spec_fact(config, "canonical_layout", bool),
        "replicated_layout": spec_fact(config, "replicated_layout", bool),
        "parallel": "any" if layout_free(spec) else [spec_fact(par, n, int) for n in sizes],
        "tokens_per_hash": spec_fact(cache, "tokens_per_hash", int),
        "blocks_per_chunk": spec_fact(cache, "blocks_per_chunk", int),
        "groups": None
        if groups is None
        else [[g.tokens_per_block, list(g.layer_names)] for g in groups],
        "worker_kv_bytes_per_block": spec_fact(config, "worker_kv_bytes_per_block", int),
        "row_bytes": row_bytes,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


def spec_fact(obj: object, name: str, kind: type) -> Any:
    """``obj.name`` where it is a ``kind`` (a bool is no int here), else None."""
    value = getattr(obj, name, None)
    if isinstance(value, bool) and kind is not bool:
        return None
    return value if isinstance(value, kind) else None
