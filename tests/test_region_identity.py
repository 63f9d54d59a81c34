"""A region's identity cannot be confused, and no kill point leaks one (shm.py, issue 24).

Every opener is a real process (``tests/region_opener.py``); regions live in ``tmp_path`` except
where ``/dev/shm`` usage is measured. The first two tests are issue 24's "Why" 1 and 2 as they
were found; on the code before it they split the region and left the file behind.
"""

from __future__ import annotations

import itertools
import os
import signal
import stat
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvoffload.integrations.vllm import shm
from kvoffload.integrations.vllm.region import SHM_DIR, SharedRegion

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
CREATE_STEPS = ("locked", "create:open", "create:sized", "create:header", "create:linked")
JOIN_STEPS = ("locked", "join:open", "join:counted")


class Opener:
    """One process that opens a region on command (``tests/region_opener.py``)."""

    def __init__(self, kill_at: str | None = None, tmpfile: bool = True) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop(shm.KILL_ENV, None)
        if kill_at is not None:
            env[shm.KILL_ENV] = kill_at
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.region_opener", *([] if tmpfile else ["--no-tmpfile"])],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def open(self, directory: Path, engine_id: str, nbytes: int, mappers: int, role: int) -> str:
        return self.ask(f"open {directory} {engine_id} {nbytes} {mappers} {role}")

    def read(self, offset: int) -> int:
        return int(self.ask(f"read {offset}").split()[1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def spawn() -> Iterator[Callable[..., Opener]]:
    started: list[Opener] = []

    def start(kill_at: str | None = None, tmpfile: bool = True) -> Opener:
        started.append(Opener(kill_at, tmpfile))
        return started[-1]

    yield start
    for opener in started:
        opener.kill()


def token(answer: str) -> str:
    assert answer.startswith("ok "), answer
    return answer.split()[2]


def test_a_stale_region_whose_creator_pid_lives_again_is_not_joined(
    tmp_path: Path, spawn: Callable[..., Opener]
) -> None:
    """Issue 24, Why 1a: a stale file (older format: no lock held) whose creator pid now belongs
    to a live process. Before: openers 1 and 2 joined it, opener 3 made a new one, [1, 1, 0]."""
    stale = tmp_path / "kvoffload_e.kv"
    stale.write_bytes(b"\0" * MIB + struct.pack("<8sQQQ", b"KVOFFRG1", os.getpid(), 3, 1))
    openers = [spawn() for _ in range(3)]
    answers = [o.open(tmp_path, "e", MIB, 3, role) for role, o in enumerate(openers)]
    assert len({token(a) for a in answers}) == 1
    openers[0].ask("write 0 1")
    assert [o.read(0) for o in openers] == [1, 1, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kvoffload_e.id"]  # name gone
    for o in openers:
        assert o.ask("close") == "ok"
    assert list(tmp_path.iterdir()) == []


def test_a_region_whose_creator_was_killed_is_reclaimed_whatever_its_pid(
    tmp_path: Path, spawn: Callable[..., Opener]
) -> None:
    """The current format: a creator killed after naming the region, its pid free for reuse."""
    dead = spawn()
    dead_token = token(dead.open(tmp_path, "e", MIB, 3, 0))
    dead.kill()
    openers = [spawn() for _ in range(3)]
    tokens = {token(o.open(tmp_path, "e", MIB, 3, role)) for role, o in enumerate(openers)}
    assert len(tokens) == 1 and dead_token not in tokens
    openers[2].ask("write 4096 9")
    assert [o.read(4096) for o in openers] == [9, 9, 9]


def test_two_engines_with_one_id_in_every_opening_order(
    tmp_path: Path, spawn: Callable[..., Opener]
) -> None:
    """Issue 24, Why 1b: engines A and B, each a scheduler (role 0) and a worker (role 1), open
    one engine id in each of the 24 orders. No engine starts split, no two engines share a
    region; an engine with a refused process does not start, so every order ends with one engine
    running alone or both refused. Before: A's scheduler, B's scheduler, A's worker, B's worker
    gave the schedulers one region and the workers another, with no error."""
    procs = {(engine, role): spawn() for engine in "AB" for role in (0, 1)}
    outcomes = set()
    for order in itertools.permutations(procs):
        answers = {key: procs[key].open(tmp_path, "e", MIB, 2, key[1]) for key in order}
        started = [e for e in "AB" if all(answers[e, r].startswith("ok") for r in (0, 1))]
        for engine in started:
            a, b = (token(answers[engine, r]) for r in (0, 1))
            assert a == b, f"{order}: engine {engine} split over two regions"
        assert len(started) <= 1, f"{order}: two engines ran on one engine id"
        for answer in answers.values():
            if answer.startswith("refused"):
                assert "its own engine_id" in answer, answer
            else:
                token(answer)
        if started:  # the engine that runs sees its own bytes only
            engine = started[0]
            procs[engine, 0].ask("write 0 11")
            assert procs[engine, 1].read(0) == 11
        outcomes.add((tuple(started), tuple(a.split()[0] for a in answers.values())))
        for key in order:
            if answers[key].startswith("ok"):
                assert procs[key].ask("close") == "ok"
        assert list(tmp_path.iterdir()) == [], f"{order} left files"
    assert {started for started, _ in outcomes} == {("A",), ("B",), ()}


def test_the_issues_order_refuses_the_second_engine(
    tmp_path: Path, spawn: Callable[..., Opener]
) -> None:
    a_sched, b_sched, a_worker, b_worker = (spawn() for _ in range(4))
    assert token(a_sched.open(tmp_path, "e", MIB, 2, 0))
    assert "role 0 of 2" in b_sched.open(tmp_path, "e", MIB, 2, 0)
    assert token(a_worker.open(tmp_path, "e", MIB, 2, 1))
    assert "full region mapped by running processes" in b_worker.open(tmp_path, "e", MIB, 2, 1)
    a_worker.ask("write 0 22")
    assert a_sched.read(0) == 22


def test_a_new_engine_after_the_old_one_exited_starts_at_once(
    tmp_path: Path, spawn: Callable[..., Opener]
) -> None:
    old = [spawn(), spawn()]
    old_token = token(old[0].open(tmp_path, "e", MIB, 2, 0))
    assert token(old[1].open(tmp_path, "e", MIB, 2, 1)) == old_token
    for o in old:
        o.kill()
    new = [spawn(), spawn()]
    tokens = {token(o.open(tmp_path, "e", MIB, 2, role)) for role, o in enumerate(new)}
    assert len(tokens) == 1 and old_token not in tokens


@pytest.mark.parametrize("tmpfile", [True, False], ids=["O_TMPFILE", "temporary-name"])
@pytest.mark.parametrize("step", CREATE_STEPS)
def test_a_creator_killed_at_any_step_leaks_nothing(
    step: str, tmpfile: bool, spawn: Callable[..., Opener]
) -> None:
    """Issue 24, Why 2: before, a creator killed between sizing and the header left a file no
    start reclaimed, and the next open of the id waited 30 s and failed. In /dev/shm itself."""
    if not SHM_DIR.is_dir():
        pytest.skip("needs /dev/shm")
    engine, nbytes = f"test-{uuid.uuid4().hex[:12]}", 32 * MIB
    before = shm_used()
    dying = spawn(kill_at=step, tmpfile=tmpfile)
    assert dying.open(SHM_DIR, engine, nbytes, 2, 0) == ""  # killed: no answer
    restart_and_check(engine, nbytes, before, spawn)


@pytest.mark.parametrize("step", JOIN_STEPS)
def test_a_joiner_killed_at_any_step_leaks_nothing(step: str, spawn: Callable[..., Opener]) -> None:
    """The engine dies with its joiner (vLLM stops an engine whose worker died): the creator is
    killed too, then the same id starts at once and /dev/shm is back where it was."""
    if not SHM_DIR.is_dir():
        pytest.skip("needs /dev/shm")
    engine, nbytes = f"test-{uuid.uuid4().hex[:12]}", 32 * MIB
    before = shm_used()
    creator = spawn()
    token(creator.open(SHM_DIR, engine, nbytes, 3, 0))
    dying = spawn(kill_at=step)
    assert dying.open(SHM_DIR, engine, nbytes, 3, 1) == ""
    creator.kill()
    restart_and_check(engine, nbytes, before, spawn)


def restart_and_check(
    engine: str, nbytes: int, before: int, spawn: Callable[..., Opener], mappers: int = 2
) -> None:
    """The next start of ``engine`` works at once, and once it stops nothing of it is left."""
    start = time.monotonic()
    fresh = [spawn() for _ in range(mappers)]
    tokens = {token(o.open(SHM_DIR, engine, nbytes, mappers, r)) for r, o in enumerate(fresh)}
    assert len(tokens) == 1
    assert time.monotonic() - start < 10, "the restart waited on what the kill left"
    for o in fresh:
        o.kill()
    SharedRegion("another", MIB, SHM_DIR, mappers=1).close()  # a start reclaims what is left
    assert list(SHM_DIR.glob(f"{shm.region_name(engine)}*")) == []
    assert wait_for(lambda: shm_used() - before < nbytes // 2), (
        f"/dev/shm holds {shm_used() - before} more bytes than before"
    )


def test_long_and_unusual_engine_ids_get_names_of_their_own(tmp_path: Path) -> None:
    """Issue 24, Why 5: a 300-character id raised a raw ``OSError: File name too long``; and
    ``a/b`` and ``a_b`` shared one region."""
    regions = [SharedRegion(i, MIB, tmp_path) for i in ("x" * 300, "a/b", "a_b", "a b")]
    assert len({r.token for r in regions}) == 4 and all(r.created for r in regions)
    assert all(len(r.path.name) < 255 for r in regions)
    for region in regions:
        region.close()
    assert list(tmp_path.iterdir()) == []


def test_a_refused_open_changes_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"expected a role in \[0, 2\) \(one per mapper\), got 2"):
        SharedRegion("e", MIB, tmp_path, mappers=2, role=2)
    one = SharedRegion("e", MIB, tmp_path, mappers=3, role=1)
    before = sorted((p.name, p.stat().st_size) for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match="role 1 of 3"):
        SharedRegion("e", MIB, tmp_path, mappers=3, role=1)
    with pytest.raises(ValueError, match=f"hold {2 * MIB} bytes, got {MIB}"):
        SharedRegion("e", 2 * MIB, tmp_path, mappers=3, role=0)
    assert sorted((p.name, p.stat().st_size) for p in tmp_path.iterdir()) == before
    two, three = (SharedRegion("e", MIB, tmp_path, mappers=3, role=r) for r in (0, 2))
    assert one.token == two.token == three.token  # the refused ones were not counted
    for region in (one, two, three):
        region.close()


def test_an_id_held_too_long_by_another_opener_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shm, "LOCK_TIMEOUT_S", 0.2)
    holder = os.open(tmp_path / "kvoffload_e.id", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        assert shm._try_lock(holder)  # another opener, stuck while holding the id lock
        with pytest.raises(ValueError, match="neither finishes nor dies"):
            SharedRegion("e", MIB, tmp_path, mappers=2)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["kvoffload_e.id"]
    finally:
        os.close(holder)


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


def test_a_killed_opener_is_really_killed(spawn: Callable[..., Opener], tmp_path: Path) -> None:
    """The kill points fire (else the tests above would test nothing)."""
    dying = spawn(kill_at="create:sized")
    assert dying.open(tmp_path, "e", MIB, 2, 0) == ""
    assert dying.proc.wait(10) == -signal.SIGKILL


@pytest.mark.parametrize("mask", [0o000, 0o777])
def test_region_files_are_0600_whatever_the_umask(tmp_path: Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        one = SharedRegion("e", MIB, tmp_path, mappers=2, role=0)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"kvoffload_e.id": 0o600, "kvoffload_e.kv": 0o600}
    one.close()


@pytest.mark.parametrize("step", ["locked", "create:sized", "create:header"])
def test_an_interrupt_while_opening_leaves_no_descriptor_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """A KeyboardInterrupt (not an OSError) raised while the region file or its lock file is
    open closes them before it propagates; the same call then succeeds."""

    def interrupt(at: str) -> None:
        if at == step:
            raise KeyboardInterrupt

    def open_fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    path = tmp_path / f"kvoffload-{uuid.uuid4().hex}.region"
    before = open_fds()
    monkeypatch.setattr(shm, "_kill_point", interrupt)
    with pytest.raises(KeyboardInterrupt):
        shm.open_shared(path, 4096, 1, 0)
    assert open_fds() == before
    monkeypatch.undo()
    opened = shm.open_shared(path, 4096, 1, 0)
    try:
        assert opened.created
    finally:
        shm.close_shared(opened)
