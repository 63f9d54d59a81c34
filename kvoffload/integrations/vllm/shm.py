"""A ``/dev/shm`` file that no engine exit can leak: its name lives only until every process that
needs it has it open, and a name left behind by a dead engine is reclaimed at the next start.

Every process that maps a region (vLLM's scheduler and each worker) opens it by name, so the name
must exist until the last of them has opened it; after that the mappings keep the memory, the
name only keeps it alive past the processes. So (``open_shared``):

- Each opener holds ``flock(LOCK_SH)`` on its descriptor for as long as it maps the file: the
  kernel drops it when the process ends, however it ends (SIGKILL and crashes included).
- A header after the region's bytes records the creator's pid, how many openers are expected and
  how many have opened it (updated under a POSIX record lock on the header). The opener that
  completes the count unlinks the name: from then on the memory goes with the last mapping.
- At every start, before opening, ``reclaim_stale`` removes ``kvoffload_*.kv`` files that nobody
  holds (``flock(LOCK_EX | LOCK_NB)`` succeeds) and whose creator pid is gone (``os.kill(pid,
  0)``): what an engine killed before all its processes had opened the region leaves. A file in
  use, one being created (no header yet) and one without our header (an older kvoffload) are
  never touched.

An opener that finds the name unlinked under it (a reclaim raced its open) starts over. The count
must be right: a process that opens the region after the name is gone creates a new, separate one,
so ``expected`` is every local process that maps it (the spec passes world size + 1).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX, SUFFIX = "kvoffload_", ".kv"
MAGIC = b"KVOFFRG1"
HEADER = struct.Struct("<8sQQQ")  # magic, creator pid, expected openers, openers so far
JOIN_TIMEOUT_S = 30.0  # how long an opener waits for the creator to size the file
OPEN_ATTEMPTS = 5  # starts over when a reclaim unlinked the name under an opener


@dataclass(frozen=True)
class ShmFile:
    """An open region file: ``fd`` (held with ``LOCK_SH``) and whether this process created it."""

    path: Path
    fd: int
    nbytes: int
    created: bool


def open_shared(path: Path, nbytes: int, expected: int) -> ShmFile:
    """Create or join the ``nbytes`` region at ``path``, counted as one of ``expected`` openers.

    ValueError: ``/dev/shm`` has no room (ENOSPC), or the file there was sized for another engine.
    """
    if expected < 1:
        raise ValueError(f"expected at least 1 process to map {path}, got {expected}")
    reclaim_stale(path.parent)
    for _ in range(OPEN_ATTEMPTS):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            joined = _join(path, nbytes, expected)
            if joined is not None:
                return joined
            continue
        return _create(path, fd, nbytes, expected)
    raise RuntimeError(f"expected to open {path}, got it unlinked under us {OPEN_ATTEMPTS} times")


def still_named(shm: ShmFile) -> bool:
    """Whether ``shm.path`` still names this file (some expected opener has not opened it)."""
    return _same_file(shm.path, shm.fd)


def close_shared(shm: ShmFile) -> None:
    """Release this opener's lock; the creator also removes a name still there (a clean stop
    before every expected opener came)."""
    if shm.created and _same_file(shm.path, shm.fd):
        shm.path.unlink(missing_ok=True)
    os.close(shm.fd)


def reclaim_stale(directory: Path) -> list[Path]:
    """Unlink every region file in ``directory`` that nobody maps and whose creator is gone;
    returns what it removed."""
    removed = []
    for path in directory.glob(f"{PREFIX}*{SUFFIX}"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile, or not ours to read
        try:
            if _stale(path, fd):
                path.unlink(missing_ok=True)
                removed.append(path)
                log.warning("kvoffload: removed %s, left by an engine that is gone", path)
        finally:
            os.close(fd)
    return removed


def _stale(path: Path, fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # mapped by a live process
    header = _read_header(fd)
    if header is None or _alive(header[1]):
        return False  # being created, an older format, or its creator lives
    return _same_file(path, fd)


def _create(path: Path, fd: int, nbytes: int, expected: int) -> ShmFile:
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # before anything a reclaim could see
        os.posix_fallocate(fd, 0, nbytes + HEADER.size)
        os.pwrite(fd, HEADER.pack(MAGIC, os.getpid(), expected, 1), nbytes)
    except OSError as e:
        path.unlink(missing_ok=True)
        os.close(fd)
        if e.errno == errno.ENOSPC:
            raise ValueError(
                f"expected room for {nbytes} bytes of host KV (cpu_bytes_to_use) in "
                f"{path.parent}, got ENOSPC: lower cpu_bytes_to_use or enlarge it "
                "(docker run --shm-size)"
            ) from e
        raise
    if expected == 1:
        path.unlink()
    return ShmFile(path, fd, nbytes, created=True)


def _join(path: Path, nbytes: int, expected: int) -> ShmFile | None:
    """Join the file at ``path``; None when it went away under us (the caller starts over)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if not _same_file(path, fd):
            os.close(fd)
            return None
        _wait_sized(path, fd, nbytes)
        _count_in(path, fd, nbytes, expected)
    except BaseException:
        os.close(fd)
        raise
    return ShmFile(path, fd, nbytes, created=False)


def _wait_sized(path: Path, fd: int, nbytes: int) -> None:
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while _read_header(fd) is None:
        if time.monotonic() > deadline:
            raise ValueError(
                f"expected {path} to be sized by its creator within {JOIN_TIMEOUT_S} s, got "
                f"{os.fstat(fd).st_size} bytes and no header; a file of an older kvoffload? "
                "remove it"
            )
        time.sleep(0.005)
    size = os.fstat(fd).st_size
    if size != nbytes + HEADER.size:
        raise ValueError(
            f"expected {path} to hold {nbytes} bytes (+{HEADER.size} of header), got {size}: a "
            "file of another engine with the same engine_id; remove it"
        )


def _count_in(path: Path, fd: int, nbytes: int, expected: int) -> None:
    """Count this opener in the header; the one that completes the count unlinks the name."""
    fcntl.lockf(fd, fcntl.LOCK_EX, HEADER.size, nbytes)
    try:
        header = _read_header(fd)
        assert header is not None  # _wait_sized saw it; a header is never cleared
        _, pid, want, joined = header
        if want != expected:
            raise ValueError(
                f"expected {path} to be shared by {expected} processes as this one counts, got "
                f"{want} from its creator (pid {pid}): two configurations for one engine_id?"
            )
        joined += 1
        os.pwrite(fd, HEADER.pack(MAGIC, pid, want, joined), nbytes)
        if joined >= want:
            path.unlink(missing_ok=True)
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN, HEADER.size, nbytes)


def _read_header(fd: int) -> tuple[bytes, int, int, int] | None:
    size = os.fstat(fd).st_size
    if size < HEADER.size:
        return None
    header: tuple[bytes, int, int, int] = HEADER.unpack(
        os.pread(fd, HEADER.size, size - HEADER.size)
    )
    return header if header[0] == MAGIC else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
