"""The shared tier on a real Valkey/Redis Cluster (3 primaries + 3 replicas on loopback): one
round trip per primary per batch, blocks shared between engine processes, tenants kept apart,
and a primary killed mid-run (misses, then hits once its replica has taken over)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pytest

from kvoffload.store.tiers.valkey import ValkeyTier
from tests.test_tier_processes import N, role
from tests.tiers_support import (
    block_keys,
    cluster,
    random_blocks,
    running_cluster,
    views,
    wait_for,
)

__all__ = ["cluster"]  # the session fixture, imported for pytest

FP = "0123456789abcdef0123456789abcdef"
B = 16 << 10


def blocks(n: int, seed: int = 0) -> np.ndarray:
    return random_blocks(n, B, seed)


keys = block_keys


def owner(tier: ValkeyTier, key: bytes) -> int:
    """Port of the primary that holds ``key``, from the client's own slot map."""
    client = tier._client
    node = client.nodes_manager.get_node_from_slot(client.keyslot(tier.key_name(key)))
    return int(node.port)


def test_a_batch_costs_one_round_trip_per_primary(cluster, monkeypatch):
    from redis.connection import AbstractConnection

    tier = ValkeyTier(cluster.url, FP, B)
    data, ks = blocks(256), keys(256)
    assert tier.put(ks[:8], views(data[:8])) == [True] * 8  # connections made
    sends: Counter[int] = Counter()
    real = AbstractConnection.send_packed_command

    def counted(self, *args, **kwargs):
        sends[self.port] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)
    assert tier.put(ks, views(data)) == [True] * 256
    put_sends = dict(sends)
    sends.clear()
    out = np.zeros_like(data)
    assert tier.get(ks, views(out)) == [True] * 256 and np.array_equal(out, data)
    primaries = set(cluster.primary_ports())
    # 256 blocks spread over every primary (a per-block hash tag), one packed write to each.
    assert set(put_sends) == primaries and set(put_sends.values()) == {1}
    assert set(sends) == primaries and set(sends.values()) == {1}
    assert len({owner(tier, k) for k in ks}) == 3
    tier.close()


def test_block_stored_by_one_process_is_loaded_by_another_through_a_cluster(cluster):
    stored = role("store", 31, valkey_url=cluster.url, valkey_namespace="team-a")
    loaded = role("load", 31, valkey_url=cluster.url, valkey_namespace="team-a")
    assert loaded["ready"] == N and loaded["digest"] == stored["digest"]  # byte-identical
    assert loaded["stats"]["tiers"]["valkey"]["gets"] == N
    other = role("load", 31, valkey_url=cluster.url, valkey_namespace="team-b")
    assert other["ready"] == 0 and other["stats"]["tiers"]["valkey"]["gets"] == 0


def test_primary_killed_mid_run_misses_then_hits_after_failover():
    with running_cluster() as cl:
        tier = ValkeyTier(cl.url, FP, B, timeout_s=0.5)
        data, ks = blocks(96, seed=4), keys(96, tag=4)
        assert tier.put(ks, views(data)) == [True] * 96
        victim = owner(tier, ks[0])
        on_victim = [i for i, k in enumerate(ks) if owner(tier, k) == victim]
        log: list[tuple[float, int, bool]] = []  # (when, block, read back ok)
        problems: list[str] = []
        stop = threading.Event()

        def traffic() -> None:
            i = 0
            out = np.zeros((1, B), dtype=np.uint8)
            while not stop.is_set():
                j = i % 96
                try:
                    tier.put([ks[j]], views(data[j : j + 1]))
                    ok = tier.get([ks[j]], views(out))[0]
                except BaseException as e:  # noqa: BLE001 (the point: nothing escapes a tier call)
                    problems.append(repr(e))
                    return
                if ok and not np.array_equal(out[0], data[j]):
                    problems.append(f"wrong bytes for block {j}")
                log.append((time.monotonic(), j, ok))
                i += 1

        thread = threading.Thread(target=traffic)
        thread.start()
        try:
            assert wait_for(lambda: sum(ok for _, _, ok in log) >= 96, 30)
            killed_at = time.monotonic()
            cl.node(victim).kill()  # SIGKILL mid-traffic
            assert wait_for(lambda: any(not ok for t, _, ok in log if t > killed_at), 30)
            assert wait_for(
                lambda: victim not in cl.primary_ports() and len(cl.primary_ports()) == 3, 30
            )
            promoted_at = time.monotonic()
            victim_set = set(on_victim)
            assert wait_for(
                lambda: sum(ok and j in victim_set for t, j, ok in log if t > promoted_at) >= 5, 30
            ), "no hits on the failed primary's slots after its replica took over"
        finally:
            stop.set()
            thread.join(30)
        assert problems == []
        misses = sum(not ok for t, _, ok in log if t > killed_at)
        s = tier.stats.snapshot()
        assert misses > 0 and s["reconnects"] >= 1 and tier.up
        # Blocks written before the kill were replicated: every one reads back bit-exact or misses.
        out = np.zeros_like(data)
        got = tier.get(ks, views(out))
        assert sum(got) >= 90 and all(np.array_equal(out[i], data[i]) for i in range(96) if got[i])
        tier.close()


@pytest.mark.parametrize("bad", ["hash", "list", "short string"])
def test_value_of_the_wrong_type_is_deleted_and_forgotten_on_a_cluster(cluster, bad):
    import redis
    from redis.cluster import ClusterNode

    tier = ValkeyTier(cluster.url, FP, B)
    ks = keys(2, tag=7)
    admin = redis.RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", cluster.nodes[0].port)])
    name = tier.key_name(ks[0])
    admin.delete(name)
    {"hash": lambda: admin.hset(name, "f", "v"), "list": lambda: admin.rpush(name, b"x"),
     "short string": lambda: admin.set(name, b"x" * 10)}[bad]()  # fmt: skip
    assert tier.probe(ks[:1]) == [False]
    assert admin.exists(name) == 0 and tier.stats.corrupt == 1
    assert tier.contains(ks[:1]) == [False]  # remembered: not probed again for a while
    admin.close()
    tier.close()


def test_slots_moved_mid_run_are_followed():
    """Resharding under traffic: the client follows ASK (a slot being migrated) and MOVED (a
    slot moved) by itself; every read is bit-exact or a miss, and afterwards every block hits
    on its new primary."""
    with running_cluster() as cl:
        tier = ValkeyTier(cl.url, FP, B, timeout_s=2.0)
        data, ks = blocks(256, seed=6), keys(256, tag=6)
        assert tier.put(ks, views(data)) == [True] * 256
        before = {k: owner(tier, k) for k in ks}
        source, target = cl.primary_ports()[:2]
        ids = {p: cl.cli_call(cl.node(p), "CLUSTER", "MYID").strip() for p in (source, target)}
        problems: list[str] = []
        reads: list[int] = []
        stop = threading.Event()

        def traffic() -> None:
            out = np.zeros_like(data)
            while not stop.is_set():
                try:
                    got = tier.get(ks, views(out))
                except BaseException as e:  # noqa: BLE001 (the point: nothing escapes a tier call)
                    problems.append(repr(e))
                    return
                reads.append(sum(got))
                problems.extend(f"wrong bytes, block {i}" for i in range(256)
                                if got[i] and not np.array_equal(out[i], data[i]))  # fmt: skip

        thread = threading.Thread(target=traffic)
        thread.start()
        try:
            moved = cl.cli_call(
                cl.node(source),
                "--cluster", "reshard", f"127.0.0.1:{source}",
                "--cluster-from", ids[source], "--cluster-to", ids[target],
                "--cluster-slots", "2000", "--cluster-yes",
                timeout_s=120,
            )  # fmt: skip
        finally:
            stop.set()
            thread.join(30)
        assert "Moving slot" in moved, moved[-2000:]
        assert problems == [] and len(reads) > 0
        out = np.zeros_like(data)
        assert tier.get(ks, views(out)) == [True] * 256 and np.array_equal(out, data)
        after = {k: owner(tier, k) for k in ks}
        assert any(before[k] == source and after[k] == target for k in ks)  # the map followed
        assert tier.up
        tier.close()
