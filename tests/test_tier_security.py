"""Who may use the shared tier, against real servers: passwords from the environment or a file
(never shown), ACL users confined to their namespace, TLS with verified certificates (one
server and a cluster), and the errors a misconfiguration gives at start-up."""

from __future__ import annotations

import logging
import secrets
from typing import Any

import numpy as np
import pytest

from kvoffload import OffloadConfig
from kvoffload.store.tiers.base import TierStartupError
from kvoffload.store.tiers.local_server import free_port
from kvoffload.store.tiers.valkey import ValkeyTier
from tests.tiers_support import (
    block_keys,
    cluster,
    make_certs,
    random_blocks,
    redis_client,
    running_cluster,
    running_server,
    views,
    wait_for,
)

__all__ = ["cluster"]  # the session fixture, imported for pytest

FP = "0123456789abcdef0123456789abcdef"
B = 8 << 10
# The ACL docs/tiers.md gives a tenant: its key prefix only, the commands the tier sends only.
TENANT_ACL = (
    "on >{password} resetkeys ~kvoffload:{namespace}:* resetchannels -@all "
    "+get +getex +set +strlen +del +ping +cluster|slots +command"
)


def blocks(n: int, seed: int = 0) -> np.ndarray:
    return random_blocks(n, B, seed)


keys = block_keys


def round_trip(tier: ValkeyTier, n: int = 8, seed: int = 0) -> bool:
    """Put ``n`` blocks and read them back bit-exact; True when every one came back."""
    data, ks = blocks(n, seed), keys(n, seed)
    if tier.put(ks, views(data)) != [True] * n:
        return False
    out = np.zeros_like(data)
    return tier.get(ks, views(out)) == [True] * n and np.array_equal(out, data)


def with_user(url: str, user: str) -> str:
    return url.replace("://", f"://{user}@", 1)


@pytest.fixture
def password(monkeypatch) -> str:
    value = "pw-" + secrets.token_hex(12)
    monkeypatch.setenv("KVOFFLOAD_TEST_VALKEY_PASSWORD", value)
    return value


# -- passwords -----------------------------------------------------------------------------------


def test_password_from_the_environment_or_a_file_and_rotation(password, tmp_path):
    with running_server(extra_args=("--requirepass", password)) as server:
        tier = ValkeyTier(server.url, FP, B, password_env="KVOFFLOAD_TEST_VALKEY_PASSWORD")
        assert tier.up and round_trip(tier)
        tier.close()
        secret_file = tmp_path / "valkey-password"
        secret_file.write_text(password + "\n")
        tier = ValkeyTier(server.url, FP, B, password_file=str(secret_file))
        assert tier.up and round_trip(tier, seed=1)
        # Rotation: the server and the file change; the next connection reads the new password.
        client = redis_client(server, password)
        rotated = "pw-" + secrets.token_hex(12)
        secret_file.write_text(rotated + "\n")
        client.config_set("requirepass", rotated)
        client.client_kill_filter(_type="normal", skipme=True)  # drop the tier's connections
        client.close()
        assert wait_for(lambda: tier.up and round_trip(tier, seed=2))
        assert redis_client(server, rotated).dbsize() == 24  # 3 round trips of 8 blocks
        tier.close()


def test_wrong_or_missing_password_is_a_clear_error_at_start_up(password, monkeypatch, caplog):
    with running_server(extra_args=("--requirepass", password)) as server:
        monkeypatch.setenv("KVOFFLOAD_TEST_WRONG", "not-" + password)
        with caplog.at_level(logging.DEBUG), pytest.raises(TierStartupError) as wrong:
            ValkeyTier(server.url, FP, B, password_env="KVOFFLOAD_TEST_WRONG")
        assert "refused the credentials" in str(wrong.value)
        with pytest.raises(TierStartupError, match="refused the credentials"):
            ValkeyTier(server.url, FP, B)  # none given: NOAUTH
        monkeypatch.delenv("KVOFFLOAD_TEST_UNSET", raising=False)
        with pytest.raises(ValueError, match=r"KVOFFLOAD_TEST_UNSET .* unset or empty"):
            ValkeyTier(server.url, FP, B, password_env="KVOFFLOAD_TEST_UNSET")
        with pytest.raises(ValueError, match="valkey_password_file"):
            ValkeyTier(server.url, FP, B, password_file="/nonexistent/kvoffload-password")
    shown = [str(wrong.value), repr(wrong.value), caplog.text]
    assert not any(password in text for text in shown)


def test_a_password_never_shows_in_a_repr_a_log_or_an_error(password, caplog):
    config = OffloadConfig(
        host_capacity_blocks=4,
        model_id="m",
        valkey_url="redis://127.0.0.1:1/0",
        valkey_password_env="KVOFFLOAD_TEST_VALKEY_PASSWORD",
    )
    with pytest.raises(ValueError) as in_url:
        OffloadConfig(model_id="m", valkey_url=f"redis://user:{password}@127.0.0.1:6379/0")
    with pytest.raises(ValueError) as bad_scheme:
        OffloadConfig(model_id="m", valkey_url=f"http://user:{password}@127.0.0.1:6379/0")
    with running_server(extra_args=("--requirepass", password)) as server:
        with caplog.at_level(logging.DEBUG):
            tier = ValkeyTier(server.url, FP, B, password_env="KVOFFLOAD_TEST_VALKEY_PASSWORD")
            round_trip(tier)
            server.kill()  # warnings about the server going away
            tier.get(keys(1), views(np.zeros((1, B), dtype=np.uint8)))
            shown = [
                repr(config),
                str(in_url.value),
                str(bad_scheme.value),
                repr(tier),
                caplog.text,
            ]
            shown += [repr(tier._client), repr(tier._client.connection_pool), repr(tier.__dict__)]
        tier.close()
    assert "valkey_password_env" in str(in_url.value) and "***" in str(in_url.value)
    assert not [text for text in shown if password in text]


# -- ACL users and namespaces --------------------------------------------------------------------


def set_acl(nodes_cli, user: str, password: str, namespace: str) -> None:
    rules = TENANT_ACL.format(password=password, namespace=namespace).split()
    for call in nodes_cli:
        reply = call("ACL", "SETUSER", user, "reset", *rules)
        assert (reply.decode() if isinstance(reply, bytes) else reply).strip() == "OK"


def test_acl_user_confined_to_its_namespace_on_one_server(password):
    with running_server() as server:
        client = redis_client(server)
        set_acl([client.execute_command], "tenant-a", password, "tenant-a")
        url = with_user(server.url, "tenant-a")
        tier = ValkeyTier(
            url, FP, B, namespace="tenant-a", password_env="KVOFFLOAD_TEST_VALKEY_PASSWORD"
        )
        assert tier.up and round_trip(tier)  # the documented ACL is enough for the tier
        # Another namespace under the same user: every command refused, each a miss, tier up.
        wrong = ValkeyTier(
            url, FP, B, namespace="tenant-b", password_env="KVOFFLOAD_TEST_VALKEY_PASSWORD"
        )
        assert not round_trip(wrong) and wrong.up
        assert wrong.stats.refused > 0 and wrong.stats.puts == 0
        # The ACL narrowed at run time: the keys it now refuses are misses, remembered as such.
        client.execute_command("ACL", "SETUSER", "tenant-a", "resetkeys", "~elsewhere:*")
        out = np.zeros((8, B), dtype=np.uint8)
        assert tier.get(keys(8, 0), views(out)) == [False] * 8 and tier.up
        assert tier.stats.refused == 8 and tier.contains(keys(8, 0)) == [False] * 8
        wrong.close()
        tier.close()
        client.close()


def test_tenants_on_a_cluster_never_read_each_other(cluster, password, monkeypatch):
    other_password = "pw-" + secrets.token_hex(12)
    monkeypatch.setenv("KVOFFLOAD_TEST_OTHER_PASSWORD", other_password)
    calls = [lambda *a, n=n: cluster.cli_call(n, *a) for n in cluster.nodes]
    set_acl(calls, "tenant-a", password, "tenant-a")
    set_acl(calls, "tenant-b", other_password, "tenant-b")
    a = ValkeyTier(
        with_user(cluster.url, "tenant-a"),
        FP,
        B,
        namespace="tenant-a",
        password_env="KVOFFLOAD_TEST_VALKEY_PASSWORD",
    )
    b = ValkeyTier(
        with_user(cluster.url, "tenant-b"),
        FP,
        B,
        namespace="tenant-b",
        password_env="KVOFFLOAD_TEST_OTHER_PASSWORD",
    )
    assert a.up and b.up and round_trip(a, n=32, seed=5)
    assert b.probe(keys(32, 5)) == [False] * 32  # same model, same keys: not b's
    assert b.get(keys(32, 5), views(np.zeros((32, B), dtype=np.uint8))) == [False] * 32
    assert b.stats.refused == 0 and b.stats.misses == 32  # its own (empty) namespace
    with pytest.raises(TierStartupError, match="refused the credentials"):
        ValkeyTier(
            with_user(cluster.url, "tenant-a"),
            FP,
            B,
            namespace="tenant-a",
            password_env="KVOFFLOAD_TEST_OTHER_PASSWORD",
        )
    for call in calls:  # an ACL without what the cluster client asks at start-up
        call("ACL", "SETUSER", "tenant-b", "-command")
    with pytest.raises(TierStartupError, match="refused a command the tier needs"):
        ValkeyTier(
            with_user(cluster.url, "tenant-b"),
            FP,
            B,
            namespace="tenant-b",
            password_env="KVOFFLOAD_TEST_OTHER_PASSWORD",
        )
    a.close()
    b.close()


# -- TLS -------------------------------------------------------------------------------------------


def test_tls_verified_by_default_and_refusals_are_start_up_errors(tmp_path):
    certs = make_certs(tmp_path / "certs")
    good: dict[str, Any] = {
        "tls_ca_file": certs.ca,
        "tls_cert_file": certs.client_cert,
        "tls_key_file": certs.client_key,
    }
    with running_server(tls=certs.server_tls(require_client_cert=True)) as server:
        assert server.url.startswith("rediss://")
        tier = ValkeyTier(server.url, FP, B, **good)
        assert tier.up and round_trip(tier)
        tier.close()
        with pytest.raises(TierStartupError, match=r"TLS handshake.*certificate verify failed"):
            ValkeyTier(server.url, FP, B)  # the system's CAs do not know this one
        with pytest.raises(TierStartupError, match=r"TLS handshake.*certificate verify failed"):
            ValkeyTier(server.url, FP, B, **{**good, "tls_ca_file": certs.other_ca})
        with pytest.raises(TierStartupError, match="TLS handshake"):
            ValkeyTier(server.url, FP, B, tls_ca_file=certs.ca)  # no client certificate
        plain = ValkeyTier(server.url.replace("rediss://", "redis://"), FP, B, timeout_s=0.3)
        assert not plain.up and not round_trip(plain)  # a miss, not an exception or a hang
        plain.close()
    with pytest.raises(ValueError, match="plain-text"):
        ValkeyTier("redis://127.0.0.1:6379/0", FP, B, tls_ca_file=certs.ca)


def test_tls_cluster(tmp_path):
    certs = make_certs(tmp_path / "certs")
    with running_cluster(tls=certs.server_tls()) as tls_cluster:
        assert tls_cluster.url.startswith("rediss+cluster://")
        tier = ValkeyTier(
            tls_cluster.url,
            FP,
            B,
            tls_ca_file=certs.ca,
            tls_cert_file=certs.client_cert,
            tls_key_file=certs.client_key,
        )
        assert tier.up and round_trip(tier, n=64)
        tier.close()
        with pytest.raises(TierStartupError, match="TLS handshake"):
            ValkeyTier(tls_cluster.url, FP, B, tls_ca_file=certs.other_ca)


def test_cluster_url_for_one_server_and_the_reverse_are_start_up_errors(cluster):
    with running_server() as server:
        one = server.url.replace("redis://", "redis+cluster://").removesuffix("/0")
        with pytest.raises(TierStartupError, match="not a cluster node"):
            ValkeyTier(one, FP, B)
    node = f"redis://127.0.0.1:{cluster.nodes[0].port}/0"
    with pytest.raises(TierStartupError, match="redis\\+cluster://"):
        ValkeyTier(node, FP, B)


def test_no_server_at_start_up_is_not_an_error():
    tier = ValkeyTier(f"redis://127.0.0.1:{free_port()}/0", FP, B, timeout_s=0.2)
    assert not tier.up and tier.contains(keys(1)) == [False] and not round_trip(tier)
    tier.close()
