"""Our options inside vLLM's ``kv_connector_extra_config``, validated once (imports no vLLM).

vLLM reads some keys of that dict itself (the spec to load, the chunk size, event and prompt-only
switches); those are left to vLLM. ``cpu_bytes_to_use`` sizes the host tier, as it does for vLLM's
own ``CPUOffloadingSpec``. Every other key must be one of ours, and goes through
``OffloadConfig.from_dict`` so that unknown keys and bad values raise ``ValueError`` naming the key
and what is accepted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.config import OffloadConfig

# Keys of kv_connector_extra_config that vLLM 0.33 reads itself (OffloadingConnector, its
# scheduler, OffloadingSpec and the spec factory).
VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "canonical_layout",
        "self_describing_kv_events",
        "offload_prompt_only",
        "sync_load_budget_bytes",
    }
)
# Our keys the vLLM adapter supports (OffloadConfig fields); the host capacity comes from
# cpu_bytes_to_use instead of host_capacity_bytes / host_capacity_blocks.
ADAPTER_KEYS = ("eviction_policy", "backend", "pin_memory")
CAPACITY_KEY = "cpu_bytes_to_use"


@dataclass(frozen=True)
class VllmOptions:
    config: OffloadConfig  # host_capacity_bytes is cpu_bytes_to_use
    cpu_bytes_to_use: int  # upper bound on host RAM for offloaded KV, per worker


def parse_options(extra_config: Mapping[str, Any]) -> VllmOptions:
    """Split vLLM's keys from ours and validate ours.

    >>> options = parse_options({"cpu_bytes_to_use": 1 << 30, "eviction_policy": "arc"})
    >>> options.config.eviction_policy, options.cpu_bytes_to_use
    ('arc', 1073741824)
    """
    if extra_config.get("canonical_layout"):
        raise ValueError(
            "expected canonical_layout to be false with KVOffloadSpec (each worker keeps its own "
            f"host copy of its pages), got {extra_config['canonical_layout']!r}"
        )
    capacity = _capacity(extra_config.get(CAPACITY_KEY))
    ours = {k: v for k, v in extra_config.items() if k not in VLLM_KEYS and k != CAPACITY_KEY}
    accepted = [CAPACITY_KEY, *ADAPTER_KEYS]
    config_fields = {f.name for f in dataclasses.fields(OffloadConfig)}
    not_here = sorted(k for k in ours if k in config_fields and k not in ADAPTER_KEYS)
    if not_here:
        raise ValueError(
            f"kvoffload option(s) {not_here} are not supported with vLLM (the host tier is sized "
            f"by {CAPACITY_KEY}; the lower tiers are not wired into the vLLM adapter yet); "
            f"expected some of {accepted}"
        )
    unknown = sorted(set(ours) - set(ADAPTER_KEYS))
    if unknown:
        raise ValueError(
            f"unknown kvoffload option(s) {unknown} in kv_connector_extra_config; expected some "
            f"of {accepted} (besides vLLM's own {sorted(VLLM_KEYS)})"
        )
    config = OffloadConfig.from_dict({**ours, "host_capacity_bytes": capacity})
    return VllmOptions(config, capacity)


def _capacity(value: object) -> int:
    # vLLM's --kv-offloading-size fills this in as GiB * 2**30, which may be a float.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(
            f"expected {CAPACITY_KEY} in kv_connector_extra_config to be a positive number of "
            f"bytes, got {value!r}"
        )
    return value
