import pytest

from kvoffload.config import DEFAULT_HOST_CAPACITY_BYTES, OffloadConfig
from kvoffload.store.arena import HostArena


def test_capacity_in_bytes_or_blocks():
    assert OffloadConfig(host_capacity_bytes=10 * 4096).num_slots(4096) == 10
    assert OffloadConfig(host_capacity_blocks=7).num_slots(1 << 30) == 7
    assert OffloadConfig().num_slots(1 << 20) == DEFAULT_HOST_CAPACITY_BYTES >> 20


def test_capacity_smaller_than_one_block():
    with pytest.raises(ValueError, match="at least one block"):
        OffloadConfig(host_capacity_bytes=1000).num_slots(4096)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"eviction_policy": "mru"}, r"eviction_policy in \['arc', 'lru'\], got 'mru'"),
        ({"backend": "gpu"}, "backend in"),
        ({"host_capacity_bytes": -1}, "positive int"),
        ({"host_capacity_blocks": 1.5}, "positive int"),
        ({"host_capacity_bytes": 1, "host_capacity_blocks": 1}, "got both"),
        ({"pin_memory": "yes"}, "pin_memory"),
        ({"cpu_bytes": 1}, r"unknown kvoffload option\(s\) \['cpu_bytes'\]"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig.from_dict(options)


def test_arena_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_slots > 0"):
        HostArena(0, 10)
    with pytest.raises(ValueError, match="slot_bytes > 0"):
        HostArena(1, 0)


def test_registered_backends_are_accepted():
    from kvoffload.transfer.registry import BACKENDS, register_backend

    with pytest.raises(ValueError, match="backend in"):
        OffloadConfig(backend="mine")
    register_backend("mine", BACKENDS["host"])
    try:
        assert OffloadConfig(backend="mine").backend == "mine"
    finally:
        del BACKENDS["mine"]
