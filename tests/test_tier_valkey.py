"""The Valkey tier against a real server on loopback: TTL, size cap, corrupt and evicted values,
a server killed or frozen mid-run, and the reconnect."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from kvoffload.store.tiers.valkey import ValkeyTier
from tests.tiers_support import (
    block_keys,
    random_blocks,
    redis_client,
    running_server,
    views,
    wait_for,
)

FP = "0123456789abcdef0123456789abcdef"
B = 64 << 10  # the Llama-3-8B per-layer page (block size 16, bf16: 16 x 8 x 128 x 2 x 2)


def blocks(n: int, seed: int = 0) -> np.ndarray:
    return random_blocks(n, B, seed)


keys = block_keys


def read(tier: ValkeyTier, ks: list[bytes]) -> tuple[list[bool], np.ndarray]:
    out = np.zeros((len(ks), B), dtype=np.uint8)
    return tier.get(ks, views(out)), out


@pytest.fixture
def server():
    with running_server() as s:
        yield s


def test_put_get_probe_and_ttl(server):
    data, ks = blocks(40), keys(40)
    tier = ValkeyTier(server.url, FP, B, ttl_s=100)
    assert tier.contains(ks[:1]) == [None]  # nothing known yet
    assert tier.put(ks, views(data)) == [True] * 40
    ok, out = read(tier, ks)
    assert ok == [True] * 40 and np.array_equal(out, data)
    assert tier.probe([ks[0], b"never-stored"]) == [True, False]
    assert tier.contains([ks[0], b"never-stored", b"unknown"]) == [True, False, None]
    client = redis_client(server)
    name = tier.key_name(ks[3])
    assert 0 < client.pttl(name) <= 100_000
    client.expire(name, 5)
    read(tier, ks[3:4])  # a hit refreshes the TTL (GETEX)
    assert client.pttl(name) > 50_000
    s = tier.stats.snapshot()
    assert (s["puts"], s["put_bytes"], s["gets"], s["get_bytes"]) == (40, 40 * B, 41, 41 * B)
    tier.close()


def test_expired_value_is_a_miss(server):
    tier = ValkeyTier(server.url, FP, B, ttl_s=1)
    tier.put(keys(2), views(blocks(2)))
    time.sleep(2.2)
    assert read(tier, keys(2))[0] == [False, False] and tier.stats.misses == 2
    tier.close()


def test_size_cap_and_other_fingerprint(server):
    small = ValkeyTier(server.url, FP, B, max_value_bytes=B)  # header + block do not fit
    assert small.put(keys(3), views(blocks(3))) == [False] * 3
    assert small.stats.put_skipped == 3 and redis_client(server).dbsize() == 0
    small.close()
    tier = ValkeyTier(server.url, FP, B)
    tier.put(keys(2), views(blocks(2)))
    other = ValkeyTier(server.url, "f" * 32, B)
    assert other.probe(keys(2)) == [False, False] and read(other, keys(2))[0] == [False, False]
    other.close()
    tier.close()


def test_corrupt_value_is_a_miss_and_deleted(server, caplog):
    data, ks = blocks(3), keys(3)
    tier = ValkeyTier(server.url, FP, B)
    tier.put(ks, views(data))
    client = redis_client(server)
    name = tier.key_name(ks[1])
    value = client.get(name)
    client.setrange(name, len(value) - 7, bytes([value[-7] ^ 0x01]))  # one payload bit
    with caplog.at_level(logging.WARNING):
        ok, out = read(tier, ks)
    assert ok == [True, False, True] and np.array_equal(out[[0, 2]], data[[0, 2]])
    assert tier.stats.corrupt == 1 and "checksum" in caplog.text
    assert client.exists(name) == 0
    client.set(name, b"short")  # a truncated value
    assert read(tier, ks[1:2])[0] == [False] and tier.stats.corrupt == 2
    tier.close()


def test_values_evicted_by_the_server_are_misses():
    with running_server(maxmemory="3mb") as server:  # allkeys-lru: the server drops old blocks
        data, ks = blocks(64, seed=5), keys(64, tag=5)
        tier = ValkeyTier(server.url, FP, B)
        ok = tier.put(ks, views(data))
        got, out = read(tier, ks)
        assert sum(got) < 64 and tier.stats.misses == 64 - sum(got)  # evicted: misses
        assert all(np.array_equal(out[i], data[i]) for i in range(64) if got[i])
        assert all(ok[i] for i in range(64) if got[i])
        tier.close()


def test_server_killed_mid_run_then_back(server, caplog):
    data, ks = blocks(16, seed=2), keys(16, tag=2)
    tier = ValkeyTier(server.url, FP, B, timeout_s=0.5)
    errors: list[BaseException] = []
    results: list[bool] = []
    stop = threading.Event()

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            try:
                results.extend(tier.put(ks[i % 16 : i % 16 + 1], views(data[i % 16 : i % 16 + 1])))
                ok, out = read(tier, ks[i % 16 : i % 16 + 1])
                if ok[0] and not np.array_equal(out[0], data[i % 16]):
                    errors.append(AssertionError(f"wrong bytes for block {i % 16}"))
            except BaseException as e:  # noqa: BLE001 (the point: nothing escapes a tier call)
                errors.append(e)
            i += 1

    with caplog.at_level(logging.WARNING):
        thread = threading.Thread(target=traffic)
        thread.start()
        assert wait_for(lambda: sum(results) >= 20)
        server.kill()  # SIGKILL mid-traffic
        assert wait_for(lambda: not tier.up)
        failures_before = len(results) - sum(results)
        assert wait_for(lambda: len(results) - sum(results) > failures_before + 20)
        server.start()  # same port, empty
        assert wait_for(lambda: tier.up)
        n = len(results)
        assert wait_for(lambda: sum(results[n:]) >= 10)
        stop.set()
        thread.join(30)
    assert errors == []
    s = tier.stats.snapshot()
    assert s["reconnects"] >= 1 and (s["put_skipped"] + s["put_failures"]) > 0 and s["errors"] > 0
    assert "unreachable" in caplog.text
    tier.close()


def test_frozen_server_times_out_into_misses(server):
    tier = ValkeyTier(server.url, FP, B, timeout_s=0.3)
    tier.put(keys(4), views(blocks(4)))
    server.pause()  # SIGSTOP: the socket stays open, nothing answers
    try:
        assert read(tier, keys(4))[0] == [False] * 4  # after the timeout, not forever
        assert not tier.up and tier.stats.errors == 4
        assert tier.put(keys(1, tag=9), views(blocks(1))) == [False]  # down: not even tried
    finally:
        server.resume()
    assert wait_for(lambda: tier.up)
    ok, out = read(tier, keys(4))
    assert ok == [True] * 4 and np.array_equal(out, blocks(4))
    tier.close()


def test_bad_arguments(server):
    with pytest.raises(ValueError, match="ttl_s >= 0"):
        ValkeyTier(server.url, FP, B, ttl_s=-1)
    for timeout in (float("inf"), 1e12, 0.0):  # inf and 1e12 overflow a socket timeout
        with pytest.raises(ValueError, match="timeout_s <= 86400"):
            ValkeyTier(server.url, FP, B, timeout_s=timeout)
    tier = ValkeyTier(server.url, FP, B)
    with pytest.raises(ValueError, match="one buffer per key"):
        tier.get(keys(2), [memoryview(bytearray(B))])
    tier.close()


@pytest.mark.parametrize("bad", ["hash", "list", "short string", "garbage of the right size"])
def test_value_that_cannot_be_a_block_is_a_miss_deleted_and_not_fetched_again(server, bad):
    """Issue 13.4: a hash, a list or a bad string under a tier key was reported pending on every
    lookup, each sending another GET. Now: one look, a miss, deleted, forgotten."""
    from kvoffload import prefix_block_keys
    from tests.tiers_support import BS, build, engine_kv, tier_of

    local = build(engine_kv(0), host_blocks=8, valkey_url=server.url)
    keys = prefix_block_keys(np.arange(2 * BS), BS, salt=b"wrong-type")
    tier = tier_of(local, "valkey")
    name = tier.key_name(keys[0])
    client = redis_client(server)
    size = tier._value_bytes(keys[0])
    {
        "hash": lambda: client.hset(name, "field", "value"),
        "list": lambda: client.rpush(name, b"x", b"y"),
        "short string": lambda: client.set(name, b"not a block"),
        "garbage of the right size": lambda: client.set(name, b"\x07" * size),
    }[bad]()
    client.config_resetstat()
    found = [local.offloader.lookup_tiers(keys) for _ in range(40)]
    deadline = time.monotonic() + 2.5  # past KNOWN_ABSENT_S: the key may be asked about again
    while time.monotonic() < deadline:
        found.append(local.offloader.lookup_tiers(keys))
        time.sleep(0.01)
    stats = client.info("commandstats")
    reads = sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("get", "getex"))
    probes = stats.get("cmdstat_strlen", {}).get("calls", 0)
    assert found[-1].hit == 0 and not found[-1].probing  # a miss, not pending
    assert reads <= 1 and probes <= 3, (reads, probes, len(found))
    assert client.exists(name) == 0 and tier.stats.corrupt == 1
    local.close()
