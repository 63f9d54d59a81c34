import pytest

from tests.policy_model import ARCPolicy, LRUPolicy, make_policy


def k(i: int) -> bytes:
    return i.to_bytes(4, "big")


def test_lru_order_follows_use():
    p = LRUPolicy(4)
    for i in range(4):
        p.insert(k(i))
    p.touch(k(0))
    assert list(p.candidates()) == [k(1), k(2), k(3), k(0)]
    p.remove(k(2), evicted=True)
    assert list(p.candidates()) == [k(1), k(3), k(0)] and len(p) == 3


def test_arc_prefers_blocks_seen_once():
    p = ARCPolicy(4)
    for i in range(4):
        p.insert(k(i))
    p.touch(k(0))  # 0 moves to T2 (seen twice)
    assert next(iter(p.candidates())) == k(1)
    assert list(p.candidates())[-1] == k(0)


def test_arc_ghost_hit_grows_recency_target():
    p = ARCPolicy(2)
    p.insert(k(1))
    p.insert(k(2))
    p.remove(k(1), evicted=True)  # ghost in B1
    assert p.p == 0
    p.insert(k(1))  # B1 ghost hit: T1 was too small
    assert p.p == 1 and k(1) in p and len(p) == 2


def test_arc_ghosts_stay_bounded():
    p = ARCPolicy(8)
    for i in range(1000):
        p.insert(k(i))
        if len(p) > 8:
            p.remove(next(iter(p.candidates())), evicted=True)
    assert len(p) == 8
    assert len(p._b1) + len(p._b2) <= 8  # ghost lists bounded by capacity


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"expected an eviction policy in \['arc', 'lru'\], got 'fifo'"
    ):
        make_policy("fifo", 4)
