"""Our options inside vLLM's ``kv_connector_extra_config``, validated once (imports no vLLM).

Two places take our options:

- ``KVOffloadSpec`` (``parse_options``): vLLM reads some keys of the dict itself (the spec to load,
  the chunk size, event, prompt-only and sync-load switches, ``secondary_tiers``); those are left to
  vLLM. ``cpu_bytes_to_use`` sizes the host tier with vLLM's meaning: bytes across every worker
  (every TP/PP rank) together, as for vLLM's own ``CPUOffloadingSpec``. Our lower tiers are flat
  keys (``disk_path``, ``valkey_url``, ...), turned into one ``secondary_tiers`` entry per tier.
- a ``secondary_tiers`` entry naming ``KVOffloadDiskTier`` or ``KVOffloadValkeyTier``
  (``parse_tier_options``), under vLLM's ``TieringOffloadingSpec`` or ours.

Every value goes through ``OffloadConfig`` so that unknown keys and bad values raise ``ValueError``
naming the key and what is accepted, before anything is built. JSON users write numbers as
strings, so before that a string is read as what its option holds (``as_number``): a byte size
(``cpu_bytes_to_use`` and every ``*_bytes`` option) as an integer or a size with a unit
(``"4194304"``, ``"512MiB"``, ``"64GiB"``, ``"1.5GB"``), another integer option as an integer
(``"3600"``), a number of seconds as a decimal (``"0.5"``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from kvoffload.config import OffloadConfig

# Keys of kv_connector_extra_config that vLLM 0.33 reads itself (OffloadingConnector, its
# scheduler, OffloadingSpec, the spec factory and the tiering manager).
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
        "secondary_tiers",
    }
)
CAPACITY_KEY = "cpu_bytes_to_use"
HOST_KEYS = ("eviction_policy", "eviction_window", "backend", "pin_memory")
LAYER_KEY = "per_layer_loads"  # KVOffloadConnector: sync loads waited for layer by layer
MODULE = "kvoffload.integrations.vllm"
DISK_TIER, VALKEY_TIER = "KVOffloadDiskTier", "KVOffloadValkeyTier"
LOCALITIES = ("LOCAL", "REMOTE")

_FIELDS = tuple(f.name for f in dataclasses.fields(OffloadConfig))
# Units of a byte size given as a string, case-insensitive ("64GiB", "512 MiB", "1.5GB").
UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}  # fmt: skip
_INT_TYPES = (int, "int", "int | None")
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
_INT = re.compile(r"\s*[+-]?\d+\s*")
_INT_KEYS = frozenset(f.name for f in dataclasses.fields(OffloadConfig) if f.type in _INT_TYPES)
_SECONDS_KEYS = frozenset(k for k in _FIELDS if k.endswith("_s"))
_VALKEY_KEYS = tuple(k for k in _FIELDS if k.startswith("valkey_"))
_COMMON_TIER_KEYS = ("model_id", "tier_threads")
# Each tier's own keys (the first one is required), then the keys every tier takes.
TIER_KEYS: dict[str, tuple[str, ...]] = {
    DISK_TIER: ("disk_path", "disk_capacity_bytes", *_COMMON_TIER_KEYS),
    VALKEY_TIER: (*_VALKEY_KEYS, *_COMMON_TIER_KEYS),
}
# OffloadConfig fields that have no meaning under vLLM, and what replaces them.
_NOT_HERE = {
    "host_capacity_bytes": f"the host tier is sized by {CAPACITY_KEY}",
    "host_capacity_blocks": f"the host tier is sized by {CAPACITY_KEY}",
    "tier_write_backlog_bytes": "vLLM's tiering manager writes every stored chunk down "
    "(bound it with a tier's 'backpressure' entry)",
    "numa_node": "the workers' shared host region is not NUMA-placed yet (docs/transfer.md)",
}


@dataclass(frozen=True)
class VllmOptions:
    config: OffloadConfig  # host_capacity_bytes is cpu_bytes_to_use
    cpu_bytes_to_use: int  # host RAM for offloaded KV, all workers together
    tiers: tuple[dict[str, Any], ...]  # secondary_tiers entries for our flat tier keys
    per_layer_loads: bool = False  # a sync load's layer i is waited for by layer i's attention


@dataclass(frozen=True)
class TierOptions:
    config: OffloadConfig  # the tier's keys; model_id filled in when it was not given
    locality: str  # LOCAL or REMOTE, for vLLM's per-request tier filter


def parse_options(extra_config: Mapping[str, Any]) -> VllmOptions:
    """Split vLLM's keys from ours and validate ours.

    >>> options = parse_options({"cpu_bytes_to_use": 1 << 30, "disk_path": "/mnt/kv"})
    >>> options.cpu_bytes_to_use, [t["type"] for t in options.tiers]
    (1073741824, ['KVOffloadDiskTier'])
    """
    if extra_config.get("canonical_layout"):
        raise ValueError(
            "expected canonical_layout to be false with KVOffloadSpec (each worker keeps its own "
            f"pages), got {extra_config['canonical_layout']!r}"
        )
    capacity = _capacity(as_number(CAPACITY_KEY, extra_config.get(CAPACITY_KEY)))
    per_layer = extra_config.get(LAYER_KEY, False)
    if not isinstance(per_layer, bool):
        raise ValueError(f"expected {LAYER_KEY} to be true or false, got {per_layer!r}")
    mine = (CAPACITY_KEY, LAYER_KEY)
    ours = {k: v for k, v in extra_config.items() if k not in VLLM_KEYS and k not in mine}
    tier_keys = {k for keys in TIER_KEYS.values() for k in keys}
    accepted = (*mine, *HOST_KEYS, *sorted(tier_keys))
    _check_known(ours, accepted, f"kv_connector_extra_config (besides vLLM's {sorted(VLLM_KEYS)})")
    host = {k: as_number(k, v) for k, v in ours.items() if k in HOST_KEYS}
    config = OffloadConfig.from_dict({**host, "host_capacity_bytes": capacity})
    tiers = []
    for tier, keys in TIER_KEYS.items():
        entry = {k: ours[k] for k in keys if k in ours}
        if keys[0] in entry:
            tiers.append({"type": tier, "module_path": MODULE, **entry})
    orphans = sorted(set(ours) - set(HOST_KEYS) - {k for t in tiers for k in t})
    if orphans:
        raise ValueError(
            f"option(s) {orphans} configure a lower tier that is not enabled; expected disk_path "
            "and/or valkey_url next to them"
        )
    for entry in tiers:
        parse_tier_options(entry["type"], _entry_options(entry), default_model_id="check")
    return VllmOptions(config, capacity, tuple(tiers), per_layer)


def parse_tier_options(tier: str, options: Mapping[str, Any], default_model_id: str) -> TierOptions:
    """Validate one tier's options (a ``secondary_tiers`` entry without ``type``/``module_path``/
    ``backpressure``). ``model_id`` defaults to ``default_model_id``; an explicit one wins."""
    keys = TIER_KEYS[tier]
    locality = options.get("locality", "LOCAL" if tier == DISK_TIER else "REMOTE")
    if locality not in LOCALITIES:
        raise ValueError(f"expected locality in {list(LOCALITIES)} for {tier}, got {locality!r}")
    given = {k: v for k, v in options.items() if k != "locality"}
    _check_known(given, keys, f"the {tier} entry")
    if keys[0] not in given:
        raise ValueError(f"expected {keys[0]} in the {tier} entry, got keys {sorted(given)}")
    model_id = given.get("model_id", default_model_id)
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"expected model_id to be a non-empty string, got {model_id!r}")
    numbers = {k: as_number(k, v) for k, v in given.items()}
    config = OffloadConfig.from_dict({**numbers, "model_id": model_id})
    return TierOptions(config, locality)


def as_number(key: str, value: Any) -> Any:
    """``value`` of option ``key``, a string read as the number that option holds (module doc);
    anything else unchanged (the config checks it). ValueError for a string that is not one.

    >>> as_number("cpu_bytes_to_use", "64GiB"), as_number("valkey_ttl_s", "60")
    (68719476736, 60)
    """
    if not isinstance(value, str):
        return value
    if key == CAPACITY_KEY or key.endswith("_bytes"):
        return parse_size(key, value)
    if key in _INT_KEYS and _INT.fullmatch(value):
        return int(value)
    if key in _SECONDS_KEYS:
        try:
            return float(Decimal(value.strip()))
        except InvalidOperation:
            pass
        raise ValueError(f"expected {key} to be a number of seconds like 0.5, got {value!r}")
    if key in _INT_KEYS:
        raise ValueError(f"expected {key} to be an integer like 8, got {value!r}")
    return value


def parse_size(key: str, text: str) -> int:
    """A byte size: ``"4194304"``, ``"512MiB"``, ``"64 GiB"``, ``"1.5GB"`` (``UNITS``); the
    result must be a whole, positive number of bytes."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in UNITS:
        raise ValueError(
            f"expected {key} to be a number of bytes, as an integer or a string like '4194304', "
            f"'512MiB' or '64GiB' (units: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), got {text!r}"
        )
    size = Decimal(match.group(1)) * UNITS[unit]
    if size != size.to_integral_value() or size <= 0:
        raise ValueError(
            f"expected {key} to be a whole, positive number of bytes, got {text!r} = {size} bytes"
        )
    return int(size)


def _entry_options(entry: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k not in ("type", "module_path")}


def _check_known(given: Mapping[str, Any], accepted: tuple[str, ...], where: str) -> None:
    not_here = sorted(k for k in given if k in _NOT_HERE)
    if not_here:
        raise ValueError(
            f"kvoffload option(s) {not_here} are not supported with vLLM "
            f"({'; '.join(_NOT_HERE[k] for k in not_here)}); expected some of {list(accepted)}"
        )
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise ValueError(
            f"unknown kvoffload option(s) {unknown} in {where}; expected some of {list(accepted)}"
        )


def _capacity(value: object) -> int:
    # vLLM's --kv-offloading-size fills this in as GiB * 2**30, which may be a float.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(
            f"expected {CAPACITY_KEY} in kv_connector_extra_config to be a positive number of "
            f"bytes (all workers together), got {value!r}"
        )
    return value
