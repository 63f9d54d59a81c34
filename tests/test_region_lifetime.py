"""The shared host region outlives no process that maps it (region.py, shm.py), on CPU.

Mappers are real processes (``tests/region_child.py``) killed with SIGKILL or SIGTERM, as vLLM
kills its engine; the region lives in ``tmp_path`` except where ``/dev/shm`` usage is measured.
"""

from __future__ import annotations

import fcntl
import functools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvoffload.integrations.vllm.region import SHM_DIR, SharedRegion
from kvoffload.integrations.vllm.shm import HEADER, reclaim_stale

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


class Child:
    """A process mapping the region ``engine_id`` in ``directory`` (module doc)."""

    def __init__(
        self, directory: Path, engine_id: str, nbytes: int, mappers: int, fill: int, role: int
    ):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        args = [str(directory), engine_id, str(nbytes), str(mappers), str(fill), str(role)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.region_child", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert line[:1] == ["ready"], f"child did not start: {line}"
        self.created, self.first_byte = bool(int(line[1])), int(line[2])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(30)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    spawned: list[Child] = []
    yield spawned
    for child in spawned:
        if child.proc.poll() is None:
            child.kill()


def region_files(directory: Path, engine_id: str) -> list[Path]:
    """The region's memory files (its 0-byte id file lives as long as a mapper: shm.py)."""
    return list(directory.glob(f"kvoffload_{engine_id}*.kv"))


def test_the_name_goes_once_every_mapper_has_opened_it(tmp_path: Path) -> None:
    one = SharedRegion("e", MIB, tmp_path, mappers=3, role=0)
    two = SharedRegion("e", MIB, tmp_path, mappers=3, role=1)
    assert one.created and not two.created
    assert [r.named for r in (one, two)] == [True, True] and region_files(tmp_path, "e")
    three = SharedRegion("e", MIB, tmp_path, mappers=3, role=2)
    assert region_files(tmp_path, "e") == []
    assert [r.named for r in (one, two, three)] == [False, False, False]
    one.array[::4096] = 0x5A  # still one memory for all three
    assert (two.array[::4096] == 0x5A).all() and (three.array[::4096] == 0x5A).all()
    for region in (one, two, three):
        region.close()
    assert list(tmp_path.iterdir()) == []  # the last one out removed the id file


def test_bad_arguments_create_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expected mappers >= 1"):
        SharedRegion("e", MIB, tmp_path, mappers=0)
    with pytest.raises(ValueError, match="expected a shared region of > 0 bytes"):
        SharedRegion("e", 0, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_different_count_for_one_engine_id_is_refused(tmp_path: Path) -> None:
    one = SharedRegion("e", MIB, tmp_path, mappers=3, role=0)
    with pytest.raises(ValueError, match="shared by 2 processes as this one counts, got 3"):
        SharedRegion("e", MIB, tmp_path, mappers=2, role=1)
    assert one.named  # the refused opener was not counted
    one.close()
    assert region_files(tmp_path, "e") == []


def test_sigkill_and_sigterm_leave_no_file_and_give_the_memory_back(
    children: list[Child],
) -> None:
    """In /dev/shm itself: the used bytes there come back after the mappers are killed."""
    if not SHM_DIR.is_dir():
        pytest.skip("needs /dev/shm")
    nbytes = 64 * MIB
    for sig in (signal.SIGKILL, signal.SIGTERM):
        engine = f"test-{uuid.uuid4().hex[:12]}"
        before = shm_used()
        one = Child(SHM_DIR, engine, nbytes, mappers=2, fill=7, role=0)
        assert region_files(SHM_DIR, engine), "the name went before the second mapper came"
        two = Child(SHM_DIR, engine, nbytes, mappers=2, fill=9, role=1)
        children += [one, two]
        assert (one.created, two.created, two.first_byte) == (True, False, 7)
        assert region_files(SHM_DIR, engine) == []  # both have it: the name is gone
        held = shm_used()
        assert held - before >= nbytes * 0.9, "the region's pages were not in /dev/shm"
        one.kill(sig)
        two.kill(sig)
        assert wait_for(functools.partial(freed, held, nbytes)), (
            f"/dev/shm still holds the region after {signal.Signals(sig).name}"
        )


def test_a_name_left_by_a_killed_engine_is_reclaimed_at_the_next_start(
    tmp_path: Path, children: list[Child]
) -> None:
    child = Child(tmp_path, "dead", MIB, mappers=3, fill=1, role=0)  # the others never come
    children.append(child)
    child.kill()
    assert region_files(tmp_path, "dead")  # only a start can reclaim it
    fresh = SharedRegion("other", MIB, tmp_path, mappers=2, role=0)
    assert region_files(tmp_path, "dead") == []
    fresh.close()


def test_a_restart_with_the_same_engine_id_gets_a_fresh_region(
    tmp_path: Path, children: list[Child]
) -> None:
    child = Child(tmp_path, "same", 2 * MIB, mappers=2, fill=3, role=0)
    children.append(child)
    child.kill()
    region = SharedRegion("same", MIB, tmp_path, mappers=2, role=0)  # another size: a new file
    assert region.created and int(region.array.max()) == 0
    region.close()


def test_a_region_in_use_is_never_reclaimed(tmp_path: Path, children: list[Child]) -> None:
    creator = Child(tmp_path, "live", MIB, mappers=3, fill=0x42, role=0)
    joiner = Child(tmp_path, "live", MIB, mappers=3, fill=0, role=1)
    children += [creator, joiner]
    assert reclaim_stale(tmp_path) == []  # creator alive, both hold it
    creator.kill()  # the creator's pid is gone, the joiner still maps it
    assert reclaim_stale(tmp_path) == []
    third = SharedRegion("live", MIB, tmp_path, mappers=3, role=2)  # the last expected mapper
    assert not third.created and (third.array[::4096] == 0x42).all()
    assert region_files(tmp_path, "live") == []
    third.close()


def test_files_of_an_older_kvoffload_go_only_once_nobody_holds_them(tmp_path: Path) -> None:
    old = tmp_path / "kvoffload_old.kv"  # an older kvoffload's region, its creator gone
    old.write_bytes(b"\0" * 4096)
    stub = tmp_path / "kvoffload_new.kv"  # an older creator killed before sizing it (issue 24)
    stub.touch()
    held = tmp_path / "kvoffload_held.kv"  # an older kvoffload's region in use: it holds flock
    held.write_bytes(b"\1" * (HEADER.size + 1))
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        assert sorted(reclaim_stale(tmp_path)) == [stub, old]
        assert held.exists() and not old.exists() and not stub.exists()
    finally:
        os.close(fd)
    assert reclaim_stale(tmp_path) == [held]


def freed(held: int, nbytes: int) -> bool:
    return held - shm_used() >= nbytes * 0.9


def shm_used() -> int:
    st = os.statvfs(SHM_DIR)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())
