"""The disk tier on real files: restart, fingerprints, capacity, corruption, full and read-only
filesystems (real tmpfs mounts where this machine allows them)."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

from kvoffload.store.tiers.disk import HEAD_AREA, DiskTier, record_bytes_for
from tests.tiers_support import remount, tmpfs

FP = "0123456789abcdef0123456789abcdef"
OTHER_FP = "fedcba9876543210fedcba9876543210"
B = 8192  # block bytes
REC = record_bytes_for(B)


def blocks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, B), dtype=np.uint8)


def keys(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(4, "little") * 3 + b"key" for i in range(n)]


def views(arr: np.ndarray) -> list[memoryview]:
    return [memoryview(row) for row in arr]


def read(tier: DiskTier, ks: list[bytes]) -> tuple[list[bool], np.ndarray]:
    out = np.zeros((len(ks), B), dtype=np.uint8)
    return tier.get(ks, views(out)), out


def slab(tier: DiskTier, n: int = 0) -> Path:
    return tier.dir / f"slab-{n:05d}.kvs"


def test_put_get_and_restart(tmp_path):
    data, ks = blocks(10), keys(10)
    tier = DiskTier(tmp_path, FP, B, capacity_bytes=64 * REC)
    assert tier.put(ks, views(data)) == [True] * 10
    assert tier.contains([*ks, b"missing"]) == [True] * 10 + [False]
    ok, out = read(tier, ks)
    assert ok == [True] * 10 and np.array_equal(out, data)
    assert tier.put(ks[:2], views(data[:2])) == [True, True]  # already held: not rewritten
    s = tier.stats.snapshot()
    assert (s["puts"], s["put_skipped"], s["gets"], s["get_bytes"]) == (10, 2, 10, 10 * B)
    tier.close()

    again = DiskTier(tmp_path, FP, B, capacity_bytes=64 * REC)  # a new process would do this
    assert again.num_blocks == 10
    ok, out = read(again, ks)
    assert ok == [True] * 10 and np.array_equal(out, data)
    again.close()


def test_other_fingerprint_never_matches(tmp_path):
    tier = DiskTier(tmp_path, FP, B, capacity_bytes=8 * REC)
    tier.put(keys(3), views(blocks(3)))
    tier.close()
    other = DiskTier(tmp_path, OTHER_FP, B, capacity_bytes=8 * REC)
    assert other.num_blocks == 0 and read(other, keys(3))[0] == [False] * 3
    other.close()
    # Even a slab copied under the other fingerprint's directory is not read: headers carry it.
    (tmp_path / OTHER_FP / "slab-00000.kvs").write_bytes(
        (tmp_path / FP / "slab-00000.kvs").read_bytes()
    )
    copied = DiskTier(tmp_path, OTHER_FP, B, capacity_bytes=8 * REC)
    assert copied.num_blocks == 0 and copied.contains(keys(3)) == [False] * 3
    copied.close()


def test_capacity_evicts_least_recently_used(tmp_path):
    data, ks = blocks(8), keys(8)
    tier = DiskTier(tmp_path, FP, B, capacity_bytes=5 * REC + REC // 2)
    assert tier.capacity_records == 5
    tier.put(ks[:5], views(data[:5]))
    read(tier, ks[:1])  # key 0 becomes the most recently used
    tier.put(ks[5:8], views(data[5:8]))
    assert tier.contains(ks) == [True, False, False, False, True, True, True, True]
    assert tier.stats.evictions == 3
    ok, out = read(tier, [ks[0], *ks[4:]])
    assert all(ok) and np.array_equal(out, data[[0, 4, 5, 6, 7]])
    used = sum(p.stat().st_blocks * 512 for p in tier.dir.glob("slab-*"))
    assert used <= 5 * REC
    tier.close()


def test_corrupt_payload_byte_is_a_miss_with_a_warning(tmp_path, caplog):
    data, ks = blocks(4), keys(4)
    tier = DiskTier(tmp_path, FP, B, capacity_bytes=8 * REC)
    tier.put(ks, views(data))
    record = tier._where[ks[2]]
    with open(slab(tier), "r+b") as f:  # flip one payload byte of block 2, as a bad disk would
        f.seek(record * REC + HEAD_AREA + 1234)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    with caplog.at_level(logging.WARNING):
        ok, out = read(tier, ks)
    assert ok == [True, True, False, True]
    assert np.array_equal(out[[0, 1, 3]], data[[0, 1, 3]])
    assert tier.stats.corrupt == 1 and "checksum" in caplog.text
    assert tier.contains(ks[2:3]) == [False]  # freed: the next read is a plain miss
    assert read(tier, ks[2:3])[0] == [False] and tier.stats.misses == 1
    tier.close()


def test_corrupt_header_byte_is_dropped_at_restart(tmp_path):
    data, ks = blocks(3), keys(3)
    tier = DiskTier(tmp_path, FP, B, capacity_bytes=8 * REC)
    tier.put(ks, views(data))
    record = tier._where[ks[1]]
    tier.close()
    with open(slab(tier), "r+b") as f:
        f.seek(record * REC + 40)  # inside the fixed header
        f.write(b"\xff")
    again = DiskTier(tmp_path, FP, B, capacity_bytes=8 * REC)
    assert again.contains(ks) == [True, False, True]
    ok, out = read(again, ks)
    assert ok == [True, False, True] and np.array_equal(out[[0, 2]], data[[0, 2]])
    again.close()


def test_slab_truncated_under_the_tier_is_extended_back(tmp_path, caplog):
    data, ks = blocks(4), keys(4)
    tier = DiskTier(tmp_path, FP, B, capacity_bytes=4 * REC)
    tier.put(ks, views(data))
    cut = 2 * REC + HEAD_AREA + 100  # in the middle of record 2's payload
    os.truncate(slab(tier), cut)
    with caplog.at_level(logging.WARNING):
        ok, out = read(tier, ks)
    assert ok == [True, True, False, False]  # 2 cut short, 3 gone: misses
    assert np.array_equal(out[:2], data[:2])
    assert tier.contains(ks) == [True, True, False, False]  # the damaged blocks were dropped
    assert tier.stats.corrupt == 1 and "short read" in caplog.text
    assert "truncated to 2 of 4 records; extended back" in caplog.text
    assert next(r for r in caplog.records if "truncated" in r.message).levelno == logging.WARNING
    assert slab(tier).stat().st_size == 4 * REC  # the space is the tier's again
    more, more_keys = blocks(2, seed=9), keys(2, tag=9)
    assert tier.put(more_keys, views(more)) == [True, True] and tier.num_blocks == 4
    got, out = read(tier, [*ks[:2], *more_keys])
    assert all(got) and np.array_equal(out, np.concatenate([data[:2], more]))
    tier.close()


def test_slab_truncated_before_a_restart_does_not_cap_the_tier(tmp_path, caplog):
    """Issue 13.6: a slab truncated to 10 records capped the tier at 10 blocks for good (200 writes
    with room for all of them left 10), logged at INFO only."""
    data, ks = blocks(200, seed=4), keys(200, tag=4)
    tier = DiskTier(tmp_path, FP, B, capacity_bytes=256 * REC)
    assert tier.put(ks[:20], views(data[:20])) == [True] * 20
    tier.close()
    os.truncate(slab(tier), 10 * REC)
    with caplog.at_level(logging.WARNING):
        again = DiskTier(tmp_path, FP, B, capacity_bytes=256 * REC)
    assert "truncated to 10 of 256 records; extended back" in caplog.text
    assert again.num_blocks == 10 and slab(again).stat().st_size == 256 * REC
    assert again.put(ks, views(data)) == [True] * 200
    assert again.num_blocks == 200 and again.stats.evictions == 0
    ok, out = read(again, ks)
    assert all(ok) and np.array_equal(out, data)
    again.close()


def test_second_process_on_the_same_directory_gets_a_disabled_tier(tmp_path, caplog):
    first = DiskTier(tmp_path, FP, B, capacity_bytes=8 * REC)
    first.put(keys(2), views(blocks(2)))
    with caplog.at_level(logging.WARNING):
        second = DiskTier(tmp_path, FP, B, capacity_bytes=8 * REC)  # flock: a second opener
    assert "in use by another process" in caplog.text
    assert second.num_blocks == 0 and second.put(keys(1, 5), views(blocks(1))) == [False]
    second.close()
    first.close()


def test_threads_put_and_get_consistently(tmp_path):
    tier = DiskTier(tmp_path, FP, B, capacity_bytes=24 * REC)
    data = blocks(64, seed=3)
    ks = keys(64, tag=3)
    bad: list[int] = []

    def worker(part: int) -> None:
        for i in range(part, 64, 4):
            tier.put([ks[i]], [memoryview(data[i])])
            ok, out = read(tier, [ks[i - 1]])
            if ok[0] and not np.array_equal(out[0], data[i - 1]):
                bad.append(i - 1)

    threads = [threading.Thread(target=worker, args=(p,)) for p in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []
    held = [k for k in ks if tier.contains([k])[0]]
    assert 0 < len(held) <= 24
    ok, out = read(tier, held)
    assert all(ok) and all(np.array_equal(out[j], data[ks.index(k)]) for j, k in enumerate(held))
    tier.close()


def test_full_filesystem_shrinks_the_tier_and_write_errors_are_misses(caplog):
    with tmpfs("4m") as root:
        with caplog.at_level(logging.WARNING):
            tier = DiskTier(root, FP, B, capacity_bytes=64 << 20)  # far more than 4 MiB
            data, ks = blocks(400, seed=1), keys(400, tag=1)
            ok = tier.put(ks, views(data))  # no exception, whatever fits
        assert "disk full" in caplog.text
        assert all(ok) and 0 < tier.num_blocks < 400  # older blocks evicted to make room
        held = [i for i, k in enumerate(ks) if tier.contains([k])[0]]
        got, out = read(tier, [ks[i] for i in held])
        assert all(got) and np.array_equal(out, data[held])

        # A write into space the filesystem no longer has: the slab lost its reservation (as if
        # someone truncated it) and another file took every free byte.
        os.truncate(slab(tier), 0)
        filler = root / "filler"
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True, check=False
        )
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert tier.put(keys(3, tag=2), views(blocks(3, seed=2))) == [False] * 3
        assert tier.stats.put_failures == 3 and "No space left" in caplog.text
        assert tier.contains(keys(3, tag=2)) == [False] * 3
        tier.close()


def test_read_only_directory_serves_reads_and_skips_writes(caplog):
    with tmpfs("16m") as root:
        data, ks = blocks(4), keys(4)
        tier = DiskTier(root, FP, B, capacity_bytes=8 * REC)
        tier.put(ks, views(data))
        tier.close()
        remount(root, "ro")
        with caplog.at_level(logging.WARNING):
            ro = DiskTier(root, FP, B, capacity_bytes=8 * REC)
            assert not ro.writable and ro.num_blocks == 4
            ok, out = read(ro, ks)
            assert ok == [True] * 4 and np.array_equal(out, data)
            assert ro.put(keys(2, tag=7), views(blocks(2))) == [False, False]
        assert ro.stats.put_skipped == 2
        ro.close()
        remount(root, "rw")


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="at least one block record"):
        DiskTier(tmp_path, FP, B, capacity_bytes=REC - 1)
    with pytest.raises(ValueError, match="32 hex digits"):
        DiskTier(tmp_path, "model", B, capacity_bytes=4 * REC)
    tier = DiskTier(tmp_path, FP, B, capacity_bytes=4 * REC)
    with pytest.raises(ValueError, match=f"buffers of {B} bytes"):
        tier.put(keys(1), [memoryview(bytearray(B - 1))])
    tier.close()


def test_a_directory_deleted_under_the_tier_is_recreated_and_said_once(
    tmp_path, monkeypatch, caplog
):
    """The tier used to keep writing into files whose directory was gone, with no word."""
    import shutil

    from kvoffload.store.tiers import disk

    monkeypatch.setattr(disk, "CHECK_FILES_EVERY_S", 0.0)
    caplog.set_level(logging.WARNING, logger="kvoffload.store.tiers.disk")
    data, ks = blocks(4, seed=5), keys(4)
    tier = DiskTier(tmp_path, FP, B, capacity_bytes=8 * REC)
    assert tier.put(ks[:2], views(data[:2])) == [True, True]
    shutil.rmtree(tier.dir)
    assert tier.put(ks[2:3], views(data[2:3])) == [True]
    assert slab(tier).is_file() and (tier.dir / "LOCK").is_file()
    said = [r.getMessage() for r in caplog.records if "deleted under the tier" in r.getMessage()]
    assert len(said) == 1 and "2 block(s) are gone" in said[0]
    ok, out = read(tier, ks[:3])
    assert ok == [False, False, True] and np.array_equal(out[2], data[2])  # misses, not garbage
    assert tier.contains(ks[:3]) == [False, False, True]

    shutil.rmtree(tier.dir)  # again: reopened again, not said again (rate-limited)
    assert tier.put(ks[3:], views(data[3:])) == [True]
    assert len([r for r in caplog.records if "deleted under" in r.getMessage()]) == 1
    assert tier.stats.snapshot()["reconnects"] == 2
    tier.close()
    again = DiskTier(tmp_path, FP, B, capacity_bytes=8 * REC)  # the files are real: a restart
    ok, out = read(again, ks)
    assert ok == [False, False, False, True] and np.array_equal(out[3], data[3])
    again.close()


def test_files_are_checked_at_most_once_per_interval(tmp_path, monkeypatch):
    import shutil

    from kvoffload.store.tiers import disk

    monkeypatch.setattr(disk, "CHECK_FILES_EVERY_S", 1e9)  # an interval that never ends here
    tier = DiskTier(tmp_path, FP, B, capacity_bytes=8 * REC)
    tier.put(keys(1), views(blocks(1)))
    shutil.rmtree(tier.dir)
    tier.put(keys(2)[1:], views(blocks(1, seed=1)))  # within the interval: not checked yet
    assert not tier.dir.exists() and tier.stats.snapshot()["reconnects"] == 0
    tier.close()
