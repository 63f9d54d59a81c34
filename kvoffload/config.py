"""OffloadConfig: every user-facing option, validated once, at the boundary."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.store.arena import slots_for_capacity
from kvoffload.store.policies import POLICIES
from kvoffload.transfer.backend import BACKENDS

DEFAULT_HOST_CAPACITY_BYTES = 4 << 30


@dataclass(frozen=True)
class OffloadConfig:
    # Host RAM for offloaded KV, in bytes. Give this or host_capacity_blocks, not both; with
    # neither, 4 GiB.
    host_capacity_bytes: int | None = None
    # Host RAM for offloaded KV, in blocks (one block = one host slot, all layers of a group).
    host_capacity_blocks: int | None = None
    # Which block to give up when the host tier is full: "lru" or "arc".
    eviction_policy: str = "lru"
    # Copy backend: "auto" (host for CPU tensors, the calibrated choice on a GPU), "host",
    # "staged", "dma" or "sm".
    backend: str = "auto"
    # Page-lock the host arena: None pins it when the engine's KV is on a CUDA device.
    pin_memory: bool | None = None

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

    def __post_init__(self) -> None:
        if self.host_capacity_bytes is not None and self.host_capacity_blocks is not None:
            raise ValueError(
                "expected host_capacity_bytes or host_capacity_blocks, got both "
                f"({self.host_capacity_bytes}, {self.host_capacity_blocks})"
            )
        for name in ("host_capacity_bytes", "host_capacity_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"expected {name} to be a positive int, got {value!r}")
        if self.eviction_policy not in POLICIES:
            raise ValueError(
                f"expected eviction_policy in {sorted(POLICIES)}, got {self.eviction_policy!r}"
            )
        names = ["auto", *sorted(BACKENDS)]  # built-in and register_backend()-ed ones
        if self.backend not in names:
            raise ValueError(f"expected backend in {names}, got {self.backend!r}")
        if self.pin_memory not in (None, True, False):
            raise ValueError(
                f"expected pin_memory to be None, True or False, got {self.pin_memory!r}"
            )
        self._check_valkey_access()  # first: its messages never show a password from the URL
        self._check_tiers()

    @property
    def has_lower_tiers(self) -> bool:
        return self.disk_path is not None or self.valkey_url is not None

    def _check_tiers(self) -> None:
        for name in ("disk_path", "valkey_url"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"expected {name} to be None or a non-empty string, got {value!r}")
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
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"expected {name} to be a positive int, got {value!r}")
        if not isinstance(self.valkey_ttl_s, int) or self.valkey_ttl_s < 0:
            raise ValueError(f"expected valkey_ttl_s to be an int >= 0, got {self.valkey_ttl_s!r}")
        if not isinstance(self.valkey_timeout_s, (int, float)) or not self.valkey_timeout_s > 0:
            raise ValueError(
                f"expected valkey_timeout_s to be a number > 0, got {self.valkey_timeout_s!r}"
            )
        if self.valkey_url is not None and not self.valkey_url.startswith(
            ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
        ):
            raise ValueError(
                "expected valkey_url like redis://host:port/db, rediss://... or unix:///path, "
                f"got {self.valkey_url!r}"
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
        """Host slots for blocks of ``slot_bytes``; ValueError if not even one fits."""
        if self.host_capacity_blocks is not None:
            return self.host_capacity_blocks
        capacity = self.host_capacity_bytes or DEFAULT_HOST_CAPACITY_BYTES
        return slots_for_capacity(capacity, slot_bytes)

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> OffloadConfig:
        """Build from user options (JSON, a CLI); unknown keys raise ValueError naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown kvoffload option(s) {unknown}; expected some of {sorted(known)}"
            )
        return cls(**dict(options))
