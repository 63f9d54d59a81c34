import subprocess
import sys

import pytest

from kvoffload.config import DEFAULT_HOST_CAPACITY_BYTES, OffloadConfig
from kvoffload.store.arena import HostArena


def test_capacity_in_bytes_or_blocks():
    assert OffloadConfig(host_capacity_bytes=10 * 4096).num_slots(4096) == 10
    assert OffloadConfig(host_capacity_blocks=7).num_slots(1 << 30) == 7
    assert OffloadConfig().num_slots(1 << 20) == DEFAULT_HOST_CAPACITY_BYTES >> 20


def test_capacity_beyond_this_machines_ram_names_the_option_and_the_bytes(monkeypatch):
    """host_capacity_blocks=2**62 used to end in numpy's "array is too big" from the index."""
    import numpy as np

    from kvoffload import config, prefix_block_keys
    from kvoffload.offload import Offloader

    ram = config.physical_ram_bytes()
    assert ram is not None and ram > 0
    message = (
        rf"expected host_capacity_blocks to fit in this machine's RAM \({ram} bytes.*got "
        rf"host_capacity_blocks={2**62}, which needs {2**62} slots of 4096 bytes = {2**74} bytes"
    )
    with pytest.raises(ValueError, match=message):
        Offloader(OffloadConfig(host_capacity_blocks=2**62), 4096)
    monkeypatch.setattr(config, "physical_ram_bytes", lambda: 10 * 4096)
    with pytest.raises(ValueError, match=r"host_capacity_bytes=the default, which needs"):
        OffloadConfig().num_slots(4096)
    with pytest.raises(ValueError, match=r"got host_capacity_bytes=45056, which needs 11 slots"):
        OffloadConfig(host_capacity_bytes=11 * 4096).num_slots(4096)
    off = Offloader(OffloadConfig(host_capacity_blocks=10), 4096)  # all of it is allowed
    job = off.schedule_store("r", prefix_block_keys(np.arange(160), 16), range(10))
    assert job is not None and len(job.keys) == 10


def test_a_cuda_backend_for_cpu_tensors_is_refused_before_anything_is_built():
    """backend="staged" on CPU tensors used to raise ModuleNotFoundError: triton."""
    import numpy as np

    from kvoffload import KVLayout, build_local

    layout = KVLayout.from_tensors([np.zeros((4, 64), np.uint8)], block_size=16, block_dim=0)
    for backend in ("staged", "dma", "sm"):
        with pytest.raises(
            ValueError,
            match=rf"expected a CUDA layout for backend '{backend}' .*got tensors on 'cpu': use "
            "backend 'host' or 'auto' for CPU tensors",
        ):
            build_local(layout, OffloadConfig(backend=backend, host_capacity_blocks=2))
    local = build_local(layout, OffloadConfig(backend="host", host_capacity_blocks=2))
    local.close()


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
        # Values that used to pass here and fail later (or break a tier for good):
        ({"model_id": 123}, "model_id to be a string, got 123"),
        ({"host_capacity_blocks": True}, "host_capacity_blocks to be a positive int, got True"),
        ({"host_capacity_bytes": False}, "host_capacity_bytes to be a positive int, got False"),
        ({"tier_threads": True}, "tier_threads to be a positive int, got True"),
        ({"valkey_ttl_s": True}, "valkey_ttl_s to be an int >= 0, got True"),
        ({"valkey_timeout_s": True}, "valkey_timeout_s to be a number of seconds"),
        ({"valkey_timeout_s": float("inf")}, r"valkey_timeout_s .* in \(0, 86400\], got inf"),
        ({"valkey_timeout_s": 1e12}, r"valkey_timeout_s .* got 1000000000000.0"),
        ({"valkey_timeout_s": float("nan")}, "valkey_timeout_s"),
        ({"load_timeout_s": 0}, r"load_timeout_s to be a number of seconds in \(0, 86400\]"),
        ({"load_timeout_s": -1.0}, "load_timeout_s"),
        ({"load_timeout_s": 2e5}, "load_timeout_s"),
        ({"pin_memory": 1}, "pin_memory to be None, True or False, got 1"),
        ({"eviction_policy": ["lru"]}, "eviction_policy in"),
        ({"backend": None}, "backend in"),
        (
            {"valkey_url": "redis://", "model_id": "m"},
            r"expected a host in valkey_url, got 'redis://'",
        ),
        ({"valkey_url": "rediss://:6379/0", "model_id": "m"}, "expected a host in valkey_url"),
        (
            {"valkey_url": "unix://", "model_id": "m"},
            r"valkey_url unix:///path/to/socket, got 'unix://'",
        ),
        (
            {"valkey_url": "redis://h:port", "model_id": "m"},
            r"expected a port 1\.\.65535 in valkey_url",
        ),
        ({"valkey_url": "http://h:6379", "model_id": "m"}, "valkey_url like redis://"),
        # a password in the URL would show in logs: it comes from an env variable or a file
        (
            {"valkey_url": "rediss://u:pw@h/1", "model_id": "m"},
            r"without a password.*'rediss://u:\*\*\*@h/1'",
        ),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig.from_dict(options)


def test_good_tier_urls_and_timeouts_pass():
    urls = ("redis://localhost:6379/0", "rediss://user@cache.internal/1", "unix:///x.sock")
    for url in (*urls, "redis+cluster://a:7000,b:7001", "rediss+cluster://user@a:7000"):
        assert OffloadConfig(valkey_url=url, model_id="m").valkey_url == url
    assert OffloadConfig(valkey_timeout_s=86_400, load_timeout_s=0.001).load_timeout_s == 0.001


def test_disk_path_that_is_a_file(tmp_path):
    file = tmp_path / "slab"
    file.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"disk_path to be a directory.*not a directory"):
        OffloadConfig(disk_path=str(file), model_id="m")
    assert OffloadConfig(disk_path=str(tmp_path / "new"), model_id="m").disk_path  # made later


def test_pin_memory_true_needs_cuda(monkeypatch):
    import torch

    if torch.cuda.is_available():
        assert OffloadConfig(pin_memory=True).pin_memory is True
    else:
        with pytest.raises(ValueError, match=r"pin_memory=True .* without CUDA"):
            OffloadConfig(pin_memory=True)
    monkeypatch.setattr(
        "kvoffload.config.importlib.util.find_spec", lambda name: None if name == "torch" else 1
    )
    with pytest.raises(ValueError, match="pin_memory=True and no torch"):
        OffloadConfig(pin_memory=True)
    assert OffloadConfig(pin_memory=False).pin_memory is False


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


def test_an_arena_larger_than_the_machine_says_what_to_set():
    """The README's 64 GiB example on a machine with less RAM: a ValueError naming the option
    before anything is allocated. Within RAM but more than the process may map (address space
    capped here, as RAM without overcommit would): a MemoryError, not a raw OSError from mmap."""
    import numpy as np

    from kvoffload import KVLayout, build_local
    from kvoffload.config import physical_ram_bytes

    ram = physical_ram_bytes()
    assert ram is not None
    layout = KVLayout.from_tensors([np.zeros((4, 16, 8, 2048), np.float32)], block_size=16)
    if ram < 64 << 30:
        with pytest.raises(ValueError, match="got host_capacity_bytes=68719476736, which needs"):
            build_local(layout, OffloadConfig(host_capacity_bytes=64 << 30))
    if ram < 8 << 30:
        pytest.skip(f"the MemoryError case needs 8 GiB of RAM, this machine has {ram} bytes")
    code = """
import resource, numpy as np
from kvoffload import KVLayout, OffloadConfig, build_local
layout = KVLayout.from_tensors([np.zeros((4, 16, 8, 2048), np.float32)], block_size=16)
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.RLIM_INFINITY))
try:
    build_local(layout, OffloadConfig(host_capacity_bytes=8 << 30))
except MemoryError as err:
    print(err)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "8589934592 bytes (8.0 GiB) for 8192 slots of 1048576 bytes" in out.stdout
    assert "host_capacity_bytes or host_capacity_blocks" in out.stdout
    with pytest.raises(MemoryError, match="for 1048576 slots of 1073741824 bytes"):
        HostArena(1 << 20, 1 << 30)  # 1 PiB: more than any address space maps
