"""``valkey_url`` forms, the namespace and the password/TLS options, checked when ``OffloadConfig``
is built (no server needed)."""

from __future__ import annotations

import dataclasses

import pytest

from kvoffload import OffloadConfig
from kvoffload.store.tiers.endpoint import (
    Credentials,
    ValkeyEndpoint,
    parse_valkey_url,
    redact_url,
)


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("redis://cache:6380/2", ValkeyEndpoint("", False, False, (("cache", 6380),), db=2)),
        ("rediss://u@cache", ValkeyEndpoint("", False, True, (("cache", 6379),), username="u")),
        ("unix:///run/valkey.sock", ValkeyEndpoint("", False, False, unix_path="/run/valkey.sock")),
        (
            "redis+cluster://10.0.0.1:7000,10.0.0.2:7001",
            ValkeyEndpoint("", True, False, (("10.0.0.1", 7000), ("10.0.0.2", 7001))),
        ),
        (
            "rediss+cluster://tenant-a@[::1]:7000/",
            ValkeyEndpoint("", True, True, (("::1", 7000),), username="tenant-a"),
        ),
    ],
)
def test_url_forms(url, want):
    assert parse_valkey_url(url) == dataclasses.replace(want, url=url)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://cache:6379", "expected valkey_url like"),
        ("redis://", "expected a host"),
        ("redis://:6379/0", "expected a host"),
        ("redis://cache:0", "port 1..65535"),
        ("redis://cache:99999", "port 1..65535"),
        ("redis://cache:port", "port 1..65535"),
        ("redis://cache/x", "database number"),
        ("redis://a:1,b:2", "several seed nodes need redis\\+cluster"),
        ("redis+cluster://a:1/3", "no database number in a cluster"),
        ("unix://", "unix:///path"),
        ("unix://relative.sock", "unix:///path"),
        ("redis://cache:6379/0?ssl=true", "without a query"),
        ("redis://user:hunter2@cache:6379/0", "without a password"),
        ("redis+cluster://:hunter2@a:1,b:2", "without a password"),
    ],
)
def test_bad_urls_are_refused_with_the_password_hidden(url, message):
    with pytest.raises(ValueError, match=message) as info:
        OffloadConfig(model_id="m", valkey_url=url)
    assert "hunter2" not in str(info.value)


def test_redact_url():
    assert redact_url("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url("redis+cluster://:secret@a:1,b:2") == "redis+cluster://:***@a:1,b:2"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"valkey_namespace": ""}, "valkey_namespace"),
        ({"valkey_namespace": "a:b"}, "valkey_namespace"),
        ({"valkey_namespace": "t{1}"}, "valkey_namespace"),
        ({"valkey_namespace": "team*"}, "valkey_namespace"),
        ({"valkey_namespace": "x" * 65}, "valkey_namespace"),
        ({"valkey_namespace": 3}, "valkey_namespace"),
        ({"valkey_password_env": "A", "valkey_password_file": "/p"}, "got both"),
        ({"valkey_password_env": "NOT A NAME"}, "environment variable name"),
        ({"valkey_password_file": ""}, "valkey_password_file to be a path"),
        ({"valkey_tls_ca_file": "/ca.pem"}, "plain-text"),
        ({"valkey_tls_key_file": "/k.pem", "valkey_url": "rediss://h:1"}, "valkey_tls_cert_file"),
        ({"valkey_tls_cert_file": 5, "valkey_url": "rediss://h:1"}, "valkey_tls_cert_file"),
    ],
)
def test_bad_tenant_password_and_tls_options(options, message):
    base = {"model_id": "m", "valkey_url": "redis://h:1/0"}
    with pytest.raises(ValueError, match=message):
        OffloadConfig.from_dict({**base, **options})


def test_good_options_are_kept():
    config = OffloadConfig(
        model_id="m",
        valkey_url="rediss+cluster://tenant-a@h1:7000,h2:7000",
        valkey_namespace="tenant-a",
        valkey_password_file="/run/secrets/valkey",
        valkey_tls_ca_file="/etc/ca.pem",
        valkey_tls_cert_file="/etc/client.pem",
        valkey_tls_key_file="/etc/client.key",
    )
    assert config.valkey_namespace == "tenant-a" and config.has_lower_tiers


def test_credentials_read_the_current_password(tmp_path, monkeypatch):
    secret = tmp_path / "pw"
    secret.write_text("first\n")
    creds = Credentials("u", password_file=str(secret))
    assert creds.get_credentials() == ("u", "first")
    secret.write_text("second")
    assert creds.get_credentials() == ("u", "second")
    secret.unlink()  # mid-rotation: the last one read is used, the server decides
    assert creds.get_credentials() == ("u", "second")
    assert "second" not in repr(creds)
    monkeypatch.setenv("KVOFFLOAD_TEST_PW", "")
    with pytest.raises(ValueError, match=r"KVOFFLOAD_TEST_PW .* unset or empty"):
        Credentials(password_env="KVOFFLOAD_TEST_PW").read_password()
