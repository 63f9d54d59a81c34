"""The disk tier's files are its user's alone (disk.py, issue 24 "Why" 7): every directory it
creates is 0700 and every file 0600 whatever the umask, and a directory other users can write
into is refused or warned about, one they can read warned about.

Before issue 24: slabs were created 0644 and directories with the umask's mode (0755), and
nothing looked at who could write into the directory.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvoffload.store.tiers.disk import DiskTier, record_bytes_for

FP = "0123456789abcdef0123456789abcdef"
B = 4096
REC = record_bytes_for(B)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def put_two(tier: DiskTier) -> None:
    data = np.random.default_rng(0).integers(0, 256, (2, B), dtype=np.uint8)
    assert tier.put([b"key-0", b"key-1"], [memoryview(r) for r in data]) == [True, True]


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.parametrize("mask", [0o000, 0o002, 0o022, 0o077])
def test_files_0600_and_directories_0700_whatever_the_umask(
    tmp_path: Path, umask: None, mask: int
) -> None:
    os.umask(mask)
    root = tmp_path / "cache" / "kv"  # two directories the tier makes, then its fingerprint one
    tier = DiskTier(root, FP, B, capacity_bytes=4 * REC)
    put_two(tier)
    made = [tmp_path / "cache", root, tier.dir]
    files = sorted(tier.dir.iterdir())
    assert [f.name for f in files] == ["LOCK", "slab-00000.kvs"]
    assert [oct(mode(d)) for d in made] == ["0o700"] * 3
    assert [oct(mode(f)) for f in files] == ["0o600"] * 2
    tier.close()


def test_files_an_older_kvoffload_left_open_are_narrowed(tmp_path: Path, umask: None) -> None:
    tier = DiskTier(tmp_path, FP, B, capacity_bytes=4 * REC)
    put_two(tier)
    tier.close()
    for f in tier.dir.iterdir():
        f.chmod(0o644)  # as the code before issue 24 made them
    tier.dir.chmod(0o755)
    again = DiskTier(tmp_path, FP, B, capacity_bytes=4 * REC)
    assert again.num_blocks == 2
    assert mode(again.dir) == 0o700
    assert {f.name: mode(f) for f in again.dir.iterdir()} == {
        "LOCK": 0o600,
        "slab-00000.kvs": 0o600,
    }
    again.close()


@pytest.mark.parametrize(
    ("bits", "who"),
    [(0o777, "its group and other users"), (0o775, "its group"), (0o757, "other users")],
)
def test_a_directory_others_can_write_into_is_refused(
    tmp_path: Path, umask: None, bits: int, who: str
) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(bits)
    with pytest.raises(ValueError, match=f"got mode {bits:#o} \\({who} can write into it\\)"):
        DiskTier(root, FP, B, capacity_bytes=4 * REC)
    assert list(root.iterdir()) == []  # refused before creating anything


def test_a_fingerprint_directory_others_can_write_into_is_refused(
    tmp_path: Path, umask: None
) -> None:
    (tmp_path / FP).mkdir()
    (tmp_path / FP).chmod(0o777)
    with pytest.raises(ValueError, match="writable by its owner only"):
        DiskTier(tmp_path, FP, B, capacity_bytes=4 * REC)
    assert list((tmp_path / FP).iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_fingerprint_directory_of_another_user_is_refused(tmp_path: Path, umask: None) -> None:
    (tmp_path / FP).mkdir(mode=0o700)
    os.chown(tmp_path / FP, 12345, 12345)
    with pytest.raises(ValueError, match="owned by this process's user \\(uid 0\\), got uid 12345"):
        DiskTier(tmp_path, FP, B, capacity_bytes=4 * REC)


def test_a_sticky_or_readable_directory_is_warned_about(
    tmp_path: Path, umask: None, caplog: pytest.LogCaptureFixture
) -> None:
    sticky, readable = tmp_path / "sticky", tmp_path / "readable"
    for directory, bits in ((sticky, 0o1777), (readable, 0o755)):
        directory.mkdir()
        directory.chmod(bits)
    with caplog.at_level(logging.WARNING, logger="kvoffload.store.tiers.disk"):
        DiskTier(sticky, FP, B, capacity_bytes=4 * REC).close()
        assert "is writable by its group and other users (sticky" in caplog.text
        caplog.clear()
        tier = DiskTier(readable, FP, B, capacity_bytes=4 * REC)
        assert "is readable by its group and other users: they can list" in caplog.text
        put_two(tier)  # works, its own files private all the same
        assert mode(tier.dir) == 0o700 and mode(tier.dir / "slab-00000.kvs") == 0o600
        tier.close()
        caplog.clear()
        private = tmp_path / "private"
        DiskTier(private, FP, B, capacity_bytes=4 * REC).close()
        assert caplog.text == ""  # one it makes itself says nothing
