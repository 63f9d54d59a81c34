"""OffloadConfig: every user-facing option, validated once, at the boundary."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.store.arena import slots_for_capacity
from kvoffload.store.numa import check_setting as check_numa_setting
from kvoffload.store.policies import POLICIES, check_window
from kvoffload.transfer.registry import BACKENDS

DEFAULT_HOST_CAPACITY_BYTES = 4 << 30
# Longest accepted timeout: a day. Larger values (inf, 1e12) overflow the clients' timers and mean
# "never", which a timeout must not.
MAX_TIMEOUT_S = 86_400.0
# A load this late is reported failed. Generous: a 1 GiB load takes ~0.3 s on a 2-core CPU and
# ~20 ms over PCIe Gen5, so reaching it means a copy is stuck, not slow.
DEFAULT_LOAD_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class OffloadConfig:
    # Host RAM for offloaded KV, in bytes. Give this or host_capacity_blocks, not both; with
    # neither, 4 GiB.
    host_capacity_bytes: int | None = None
    # Host RAM for offloaded KV, in blocks (one block = one host slot, all layers of a group).
    host_capacity_blocks: int | None = None
    # Which block to give up when the host tier is full: "lru" or "arc".
    eviction_policy: str = "lru"
    # A store that must evict n blocks picks them among the policy's first n x this many
    # evictable ones (at most num_slots / 16 more than n) by runs of consecutive host slots, the
    # oldest first: a later load moves one copy per run and layer slice (docs/api.md, "Eviction
    # window"). 1 (the default): the policy's exact order; larger windows cost host hits under
    # pressure (measured there).
    eviction_window: int = 1
    # Copy backend: "auto" (host for CPU tensors, the calibrated choice on a GPU), "host",
    # "staged", "dma" or "sm".
    backend: str = "auto"
    # Page-lock the host arena: None pins it when the engine's KV is on a CUDA device.
    pin_memory: bool | None = None
    # NUMA node of the host arena: "auto" (the node nearest the KV's GPU, where the host has
    # several; placed nowhere otherwise, with the reason logged), "off", or a node id (bound
    # strictly; an error where it cannot be). docs/transfer.md, "NUMA and many GPUs".
    numa_node: int | str = "auto"
    # Seconds a load may take before it is reported failed (the engine recomputes those blocks);
    # its engine blocks stay in use until the copy really ends (docs/api.md, "Load deadline").
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S

    # -- lower tiers (docs/tiers.md): host blocks are also written to disk and/or Valkey -------
    # Model name and revision, mixed into the lower tiers' layout fingerprint so that two models
    # with the same KV shapes never share blocks. Required when disk_path or valkey_url is set.
    model_id: str = ""
    # Directory of the disk tier (blocks survive a restart there); None: no disk tier.
    disk_path: str | None = None
    # Disk space the disk tier may use, in bytes; the least recently used blocks go first.
    disk_capacity_bytes: int = 32 << 30
    # URL of the shared Valkey/Redis tier: redis://[user@]host:port/db, rediss:// (TLS),
    # unix:///path.sock, or a cluster by seed nodes: redis+cluster://host:port[,host:port...]
    # (rediss+cluster:// for TLS); never a password (valkey_password_env / _file). None: no
    # shared tier.
    valkey_url: str | None = None
    # Seconds a block lives in Valkey after its last write or hit; 0: no expiry.
    valkey_ttl_s: int = 3600
    # Largest Valkey value (header + one block); larger blocks are not shared.
    valkey_max_value_bytes: int = 64 << 20
    # Valkey connect and reply timeout, seconds; a slower answer is a miss.
    valkey_timeout_s: float = 0.5
    # Connections in the Valkey client pool.
    valkey_pool_size: int = 8
    # Most host-block bytes being written down at once (each pins its host slot until written;
    # capped at half the host capacity); later blocks wait their turn, oldest first.
    tier_write_backlog_bytes: int = 512 << 20
    # Background threads per lower tier.
    tier_threads: int = 2
    # The engine's prefill rate (tokens/s) until it reports one (Offloader.report_prefill): a
    # lower-tier hit is loaded only when expected to beat recomputing it; 0: unknown (loaded).
    prefill_tokens_per_s: float = 0.0

    # -- the shared tier's tenant, credentials and TLS (docs/tiers.md) ------------------------
    # Tenant: part of every Valkey key (kvoffload:<namespace>:...), so deployments sharing a
    # server or cluster never read each other's blocks; an ACL key pattern can confine a user
    # to it. 1-64 of letters, digits, '_', '.', '-'.
    valkey_namespace: str = "default"
    # Name of the environment variable that holds the Valkey password; None: no password.
    valkey_password_env: str | None = None
    # Or a file that holds it (read at each new connection, so it can be rotated).
    valkey_password_file: str | None = None
    # TLS (rediss:// and rediss+cluster:// only; certificates and host names are always
    # verified): the CA bundle that signs the servers' certificates (None: the system's)...
    valkey_tls_ca_file: str | None = None
    # ...and a client certificate (PEM) and its key, for servers that require one.
    valkey_tls_cert_file: str | None = None
    valkey_tls_key_file: str | None = None

    def __new__(cls, *args: Any, **options: Any) -> OffloadConfig:
        # The generated __init__ raises TypeError on a misspelt option; the README promises a
        # ValueError naming it (and a refused call builds nothing).
        _check_known(cls, options)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if self.host_capacity_bytes is not None and self.host_capacity_blocks is not None:
            raise ValueError(
                "expected host_capacity_bytes or host_capacity_blocks, got both "
                f"({self.host_capacity_bytes}, {self.host_capacity_blocks})"
            )
        for name in ("host_capacity_bytes", "host_capacity_blocks"):
            if getattr(self, name) is not None:
                _check_int(self, name, minimum=1)
        _check_choice(self, "eviction_policy", sorted(POLICIES))
        check_window(self.eviction_window, "eviction_window")
        _check_choice(self, "backend", ["auto", *sorted(BACKENDS)])  # with register_backend()-ed
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            raise ValueError(
                f"expected pin_memory to be None, True or False, got {self.pin_memory!r}"
            )
        if self.pin_memory:
            _check_cuda_for_pinning()
        _check_seconds(self, "load_timeout_s")
        check_numa_setting(self.numa_node)
        self._check_valkey_access()  # first: its messages never show a password from the URL
        self._check_tiers()

    @property
    def has_lower_tiers(self) -> bool:
        return self.disk_path is not None or self.valkey_url is not None

    def _check_tiers(self) -> None:
        if not isinstance(self.model_id, str):
            raise ValueError(f"expected model_id to be a string, got {self.model_id!r}")
        for name in ("disk_path", "valkey_url"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"expected {name} to be None or a non-empty string, got {value!r}")
        path = self.disk_path
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(
                f"expected disk_path to be a directory (or not to exist yet), got {path!r}, "
                "which exists and is not a directory"
            )
        if self.has_lower_tiers and not self.model_id:
            raise ValueError(
                "expected model_id (the model name and revision, so that two models with the same "
                "KV shapes never share disk or Valkey blocks) when disk_path or valkey_url is "
                "set, got ''"
            )
        positive = (
            "disk_capacity_bytes",
            "valkey_max_value_bytes",
            "valkey_pool_size",
            "tier_write_backlog_bytes",
            "tier_threads",
        )
        for name in positive:
            _check_int(self, name, minimum=1)
        _check_int(self, "valkey_ttl_s", minimum=0)
        _check_seconds(self, "valkey_timeout_s")
        rate = self.prefill_tokens_per_s
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1e30:
            raise ValueError(
                f"expected prefill_tokens_per_s >= 0 (tokens/s; 0: unknown), got {rate!r}"
            )

    def _check_valkey_access(self) -> None:
        """The shared tier's URL form, namespace, password source and TLS files (the files
        themselves are read when the tier starts)."""
        from kvoffload.store.tiers.endpoint import (
            Credentials,
            TlsFiles,
            check_namespace,
            parse_valkey_url,
        )

        check_namespace(self.valkey_namespace)
        Credentials(None, self.valkey_password_env, self.valkey_password_file).check()
        tls = TlsFiles(self.valkey_tls_ca_file, self.valkey_tls_cert_file, self.valkey_tls_key_file)
        if self.valkey_url is None:
            tls.check(tls=True)  # types only: without a URL nothing is used
            return
        tls.check(parse_valkey_url(self.valkey_url).tls)

    def num_slots(self, slot_bytes: int) -> int:
        """Host slots for blocks of ``slot_bytes``; ValueError if not even one fits, or if they
        need more bytes than this machine has RAM (checked before anything is allocated)."""
        if self.host_capacity_blocks is not None:
            slots, name = self.host_capacity_blocks, "host_capacity_blocks"
        else:
            capacity = self.host_capacity_bytes or DEFAULT_HOST_CAPACITY_BYTES
            slots, name = slots_for_capacity(capacity, slot_bytes), "host_capacity_bytes"
        ram = physical_ram_bytes()
        need = slots * slot_bytes
        if ram is not None and need > ram:
            given = getattr(self, name)
            raise ValueError(
                f"expected {name} to fit in this machine's RAM ({ram} bytes, {ram / 2**30:.1f} "
                f"GiB), got {name}={'the default' if given is None else given}, which needs "
                f"{slots} slots of {slot_bytes} bytes = {need} bytes ({need / 2**30:.4g} GiB) of "
                "host RAM; set host_capacity_bytes or host_capacity_blocks lower"
            )
        return slots

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> OffloadConfig:
        """Build from user options (JSON, a CLI); unknown keys raise ValueError naming them."""
        _check_known(cls, options)
        return cls(**dict(options))


def physical_ram_bytes() -> int | None:
    """This machine's RAM in bytes, None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# -- checks shared by the options above (each ValueError names the key) ------------------------


def _check_known(cls: type[OffloadConfig], options: Mapping[str, Any]) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown kvoffload option(s) {unknown}; expected some of {sorted(known)}")


def _check_int(config: OffloadConfig, name: str, minimum: int) -> None:
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"expected {name} to be {what}, got {value!r}")


def _check_seconds(config: OffloadConfig, name: str) -> None:
    value = getattr(config, name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(
            f"expected {name} to be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {value!r}"
        )


def _check_choice(config: OffloadConfig, name: str, choices: list[str]) -> None:
    value = getattr(config, name)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"expected {name} in {choices}, got {value!r}")


def _check_cuda_for_pinning() -> None:
    """pin_memory=True page-locks the arena through CUDA: refuse it where torch has no CUDA.
    Imports torch only here, when pinning was asked for (importing kvoffload stays light)."""
    if importlib.util.find_spec("torch") is None:
        raise ValueError(
            "expected pin_memory=True only where torch with CUDA is installed (pinning uses the "
            "CUDA runtime), got pin_memory=True and no torch: leave pin_memory unset or False"
        )
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            "expected pin_memory=True only where torch sees a CUDA device (pinning uses the CUDA "
            f"runtime), got pin_memory=True and torch {torch.__version__} without CUDA: leave "
            "pin_memory unset (it pins when the KV is on a GPU) or set it to False"
        )
