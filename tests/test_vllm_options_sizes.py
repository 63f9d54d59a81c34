"""vLLM's kv_connector_extra_config takes numbers as strings and sizes with units (options.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.integrations.vllm.options import (
    DISK_TIER,
    VALKEY_TIER,
    as_number,
    parse_options,
    parse_tier_options,
)

GIB = 1 << 30


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ("4194304", 4194304),
        ("64GiB", 64 * GIB),
        ("512MiB", 512 << 20),
        (" 64 gib ", 64 * GIB),
        ("1.5GiB", 3 * GIB // 2),
        ("2GB", 2 * 10**9),
        ("8KiB", 8192),
        ("1TiB", 1 << 40),
        ("100B", 100),
        (4194304, 4194304),
    ],
)
def test_cpu_bytes_to_use_as_a_string(given: object, want: int) -> None:
    assert parse_options({"cpu_bytes_to_use": given}).cpu_bytes_to_use == want


@pytest.mark.parametrize(
    "given", ["", "lots", "64 GiBs", "-1", "0", "0GiB", "1.5", "0.5B", "1e9", "64 Gi B", "0x10"]
)
def test_a_bad_size_string_names_the_option_and_what_was_expected(given: str) -> None:
    with pytest.raises(ValueError, match=r"expected cpu_bytes_to_use to be a .*got") as info:
        parse_options({"cpu_bytes_to_use": given})
    assert repr(given) in str(info.value)


def test_every_size_and_integer_option_of_the_tiers_takes_strings(tmp_path: Path) -> None:
    options = parse_options(
        {
            "cpu_bytes_to_use": "1GiB",
            "disk_path": str(tmp_path),
            "disk_capacity_bytes": "2GiB",
            "valkey_url": "redis://127.0.0.1:6379/0",
            "valkey_max_value_bytes": "32MiB",
            "valkey_ttl_s": "60",
            "valkey_pool_size": "4",
            "valkey_timeout_s": "0.25",
            "tier_threads": "3",
        }
    )
    disk = {k: v for k, v in options.tiers[0].items() if k not in ("type", "module_path")}
    valkey = {k: v for k, v in options.tiers[1].items() if k not in ("type", "module_path")}
    disk_config = parse_tier_options(DISK_TIER, disk, "m").config
    valkey_config = parse_tier_options(VALKEY_TIER, valkey, "m").config
    assert disk_config.disk_capacity_bytes == 2 * GIB and disk_config.tier_threads == 3
    assert valkey_config.valkey_max_value_bytes == 32 << 20
    assert (valkey_config.valkey_ttl_s, valkey_config.valkey_pool_size) == (60, 4)
    assert valkey_config.valkey_timeout_s == 0.25


@pytest.mark.parametrize(
    ("key", "given", "message"),
    [
        ("disk_capacity_bytes", "2 gigs", "expected disk_capacity_bytes to be a number of bytes"),
        ("tier_threads", "two", "expected tier_threads to be an integer like 8, got 'two'"),
        ("tier_threads", "2.5", "expected tier_threads to be an integer like 8, got '2.5'"),
        ("valkey_timeout_s", "soon", "expected valkey_timeout_s to be a number of seconds"),
        ("valkey_ttl_s", "-5", "expected valkey_ttl_s to be an int >= 0, got -5"),
    ],
)
def test_bad_strings_for_tier_options(key: str, given: str, message: str, tmp_path: Path) -> None:
    entry = {"disk_path": str(tmp_path), key: given}
    tier = DISK_TIER if key.startswith(("disk", "tier")) else VALKEY_TIER
    if tier == VALKEY_TIER:
        entry = {"valkey_url": "redis://127.0.0.1:6379/0", key: given}
    with pytest.raises(ValueError, match=message):
        parse_tier_options(tier, entry, "m")


def test_strings_of_options_that_hold_text_stay_text() -> None:
    assert as_number("eviction_policy", "123") == "123"
    assert as_number("valkey_namespace", "42") == "42"
    assert as_number("disk_path", "7GiB") == "7GiB"
