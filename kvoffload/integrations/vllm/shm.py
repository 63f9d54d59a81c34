"""A ``/dev/shm`` region per engine id that every process of one engine maps, that processes of
two engines never share, and that no exit, at any point, leaks past the processes using it.

What must hold, and why it is hard. vLLM's scheduler and its workers are separate processes that
learn nothing from each other before the region is needed; all they share is the configuration,
so they find the region by a name made from the engine id. Two things are then easy to get wrong:

- **Identity.** Users set engine ids (disaggregated set-ups do), so two engines on one host may
  use one id; containers run with the host's IPC namespace share ``/dev/shm`` but not pids, and a
  pid is reused. Neither a name nor a pid says which engine a file belongs to, and an engine has
  no channel of its own that runs before its workers map the region. So the rule here is one
  *live* region per engine id on a host, and each process of an engine takes a distinct *role*
  in it (vLLM: 0 for the scheduler, ``r + 1`` for worker rank ``r``). A second engine with the
  same id is then always caught: while the first region is still filling, the second engine's
  processes collide on a role that is taken; once it is full (its name gone), any newcomer for
  the id while a process of it lives is a latecomer. Both are refused with a ``ValueError`` that
  names the id and says to give each engine its own. Refusal is all-or-nothing per process (it
  changes nothing), and an engine with a refused process does not start, so no two engines ever
  run on one region and no engine runs split over two: the engines either get distinct regions
  (one after the other) or a refusal. The cost: an engine started while a previous one with the
  same id still has a live process (a restart that did not wait for the old one to exit) is
  refused too, with the same message.
- **Lifetime.** The memory must live exactly as long as some process maps it, whatever kills
  whom when. Locks, not pids, carry liveness: the kernel drops a lock when its holder dies, pid
  reuse cannot fake one, and containers in one IPC namespace see each other's locks on the
  shared ``/dev/shm`` whatever their pid namespaces.

The files, for an engine id named ``N`` (``region_name``: the id, or a readable prefix and a
digest of it when it is long or holds characters a file name cannot):

- ``kvoffload_N.id`` (0 bytes): the id's lock. An OFD write lock on its byte 0 serialises every
  open of the id (create, join, reclaim; polled for ``LOCK_TIMEOUT_S``). Every process mapping
  the region holds ``flock(LOCK_SH)`` on it for as long as it lives: "the id is live" is "someone
  holds it", which is exact (no pid is read).
- ``kvoffload_N.kv``: the memory, its ``nbytes`` followed by a role table (a byte per expected
  process) and a header (magic, a random 128-bit token naming this region, expected and joined
  counts). It is built under no name (``O_TMPFILE``: sized with ``posix_fallocate``, so a full
  ``/dev/shm`` fails at start, header written) and only then linked to its name, under the id
  lock: a named region is always complete, and a creator killed while creating leaves nothing.
  Each joiner marks its role and counts in; the one that completes the count unlinks the name,
  so from then on the memory goes with the last mapping, however the processes end.

Where ``O_TMPFILE`` is refused (some file systems, no ``/proc``), the region is built under a
temporary name ``kvoffload_N.<token>.tmp`` instead and linked to its final name; one left by a
killed creator is removed by the next open of any id, as it is never in use once the id lock is
free.

Reclaim (``reclaim_stale``, at every open): an id file whose lock is free and that nobody holds
``LOCK_SH`` on belongs to no live process; its region name, temporary files and the id file go.
A region file without an id file (an older kvoffload's; with or without a header) goes once
nobody holds ``flock`` on it: older versions held it while mapping. So a SIGKILL at any step of
creating or joining leaves at most names that no process can use, the next open on the host
removes them, and the next start with the same id works at once
(``tests/test_region_identity.py`` kills an opener at every step).

The token is not how processes find the region (the name is): it names one region for checks
and tests (``SharedRegion.token`` is equal in every process that maps it). Files are ``0600``
whatever the umask.

The count must be right: ``expected`` is every local process that maps the region (the spec passes
world size + 1), and each passes its own ``role`` in ``range(expected)``.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import signal
import struct
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX, SUFFIX, ID_SUFFIX, TMP_SUFFIX = "kvoffload_", ".kv", ".id", ".tmp"
MAGIC = b"KVOFFRG2"
HEADER = struct.Struct("<8s16sQQ")  # magic, token, expected openers, openers so far
TOKEN_BYTES = 16
LOCK_TIMEOUT_S = 60.0  # how long an opener waits for another opener of the id (a creator sizing)
NAME_CHARS = 100  # longer engine ids are shortened to a prefix and a digest (NAME_MAX is 255)
KILL_ENV = "KVOFFLOAD_SHM_KILL_AT"  # tests: SIGKILL this process at the named step
# struct flock for F_OFD_SETLK on Linux (x86-64 and aarch64): l_type, l_whence, l_start, l_len,
# l_pid (0 for OFD locks), padded to 32 bytes.
_FLOCK = struct.Struct("@hhqqi4x")
_TMP_TAIL = rf"\.[0-9a-f]{{{2 * TOKEN_BYTES}}}{re.escape(TMP_SUFFIX)}"  # .<token hex>.tmp
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
USE_TMPFILE = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")


@dataclass(frozen=True)
class ShmFile:
    """An open region: ``fd`` (held with ``LOCK_SH``), ``id_fd`` (the id's lock file, held with
    ``LOCK_SH`` while this process maps it), the region's ``token`` and whether this process
    created it."""

    path: Path
    fd: int
    id_fd: int
    nbytes: int
    token: bytes
    created: bool


def region_name(engine_id: str) -> str:
    """The file name stem of ``engine_id``'s region: the id itself when it is short and holds
    only ``[A-Za-z0-9_.-]``, else a readable prefix and a digest of the id, so that two ids never
    share a name and every name fits the file system."""
    if not isinstance(engine_id, str) or not engine_id:
        raise ValueError(f"expected a non-empty engine id string, got {engine_id!r}")
    safe = _UNSAFE.sub("_", engine_id)
    if safe == engine_id and len(safe) <= NAME_CHARS:
        return f"{PREFIX}{safe}"
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:32]
    return f"{PREFIX}{safe[:40]}-{digest}"


def id_path(path: Path) -> Path:
    """The id lock file of the region file ``path``."""
    return path.with_name(path.name.removesuffix(SUFFIX) + ID_SUFFIX)


def open_shared(path: Path, nbytes: int, expected: int, role: int) -> ShmFile:
    """Create or join the ``nbytes`` region at ``path`` as ``role`` of ``expected`` openers.

    ValueError: bad arguments; ``/dev/shm`` has no room (ENOSPC); the id is in use by another
    engine (a role taken, or a full region still mapped); a region there sized or counted for
    another configuration; the id lock held past ``LOCK_TIMEOUT_S``. Nothing changes then.
    """
    if expected < 1 or not 0 <= role < expected:
        raise ValueError(
            f"expected expected >= 1 processes mapping {path} and a role in [0, expected), got "
            f"{expected} and {role}"
        )
    reclaim_stale(path.parent)
    lock_fd = _lock_id(id_path(path))
    try:
        _kill_point("locked")
        shm = _open_locked(path, lock_fd, nbytes, expected, role)
    except BaseException:
        os.close(lock_fd)  # drops its locks too
        raise
    _unlock(lock_fd)
    return shm


def still_named(shm: ShmFile) -> bool:
    """Whether ``shm.path`` still names this file (some expected opener has not opened it)."""
    return _same_file(shm.path, shm.fd)


def close_shared(shm: ShmFile) -> None:
    """Release this opener's locks; the creator also removes a name still there (a clean stop
    before every expected opener came), and the last process out removes the id file."""
    if shm.created and _same_file(shm.path, shm.fd):
        shm.path.unlink(missing_ok=True)
    os.close(shm.fd)
    lock_path = id_path(shm.path)
    try:
        last = _try_lock(shm.id_fd) and _try_flock(shm.id_fd, fcntl.LOCK_EX)
        if last and _same_file(lock_path, shm.id_fd):
            lock_path.unlink()
    finally:
        os.close(shm.id_fd)


def reclaim_stale(directory: Path) -> list[Path]:
    """Unlink every region file in ``directory`` that no live process can use (module doc);
    returns what it removed. Never waits: an id being opened right now is left alone."""
    removed = []
    for path in sorted(directory.glob(f"{PREFIX}*{ID_SUFFIX}")):
        removed += _reclaim_id(path)
    for path in sorted(directory.glob(f"{PREFIX}*{SUFFIX}")):
        if not id_path(path).exists() and _reclaim_old(path):
            removed.append(path)
    for path in removed:
        log.warning("kvoffload: removed %s, left by an engine that is gone", path)
    return removed


def _open_locked(path: Path, lock_fd: int, nbytes: int, expected: int, role: int) -> ShmFile:
    """Under the id lock: create the region if no process of the id lives, join it if it is
    still filling, refuse otherwise."""
    if _try_flock(lock_fd, fcntl.LOCK_EX):  # nobody maps the id: whatever is named is stale
        if not _remove_dead(path):
            raise ValueError(
                f"expected {path} to be free, got it mapped by a running older kvoffload: stop "
                "that engine or give this one another engine_id"
            )
        fd, token = _create(path, nbytes, expected, role)
        fcntl.flock(lock_fd, fcntl.LOCK_SH)  # converted under the id lock: nobody can see it
        return ShmFile(path, fd, lock_fd, nbytes, token, created=True)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise ValueError(
            f"expected engine_id {_engine(path)!r} to be free on this host or its region still "
            f"filling, got a full region mapped by running processes ({expected} expected): "
            "another engine uses this engine_id, or the previous one has not exited yet; give "
            "each engine on a host its own engine_id (kv_transfer_config.engine_id)"
        ) from None
    try:
        token = _join(path, fd, nbytes, expected, role)
    except BaseException:
        os.close(fd)
        raise
    fcntl.flock(lock_fd, fcntl.LOCK_SH)
    return ShmFile(path, fd, lock_fd, nbytes, token, created=False)


def _create(path: Path, nbytes: int, expected: int, role: int) -> tuple[int, bytes]:
    token = os.urandom(TOKEN_BYTES)
    fd, tmp = _new_file(path, token)
    try:
        _kill_point("create:open")
        os.fchmod(fd, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.posix_fallocate(fd, 0, nbytes + expected + HEADER.size)
        _kill_point("create:sized")
        roles = bytearray(expected)
        roles[role] = 1
        os.pwrite(fd, bytes(roles) + HEADER.pack(MAGIC, token, expected, 1), nbytes)
        _kill_point("create:header")
        if expected > 1:  # the others find it by name; alone, it needs none
            _link(fd, tmp, path)
            _kill_point("create:linked")
    except BaseException as e:  # the file closed whatever stopped us, then raised
        os.close(fd)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise ValueError(
                f"expected room for {nbytes} bytes of host KV (cpu_bytes_to_use) in "
                f"{path.parent}, got ENOSPC: lower cpu_bytes_to_use or enlarge it "
                "(docker run --shm-size)"
            ) from e
        raise
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return fd, token


def _join(path: Path, fd: int, nbytes: int, expected: int, role: int) -> bytes:
    """Mark ``role`` in the region at ``fd`` and count this opener in; the one that completes the
    count unlinks the name. Returns the region's token."""
    fcntl.flock(fd, fcntl.LOCK_SH)
    _kill_point("join:open")
    size = os.fstat(fd).st_size
    header = _read_header(fd)
    if header is None or header[0] != MAGIC:
        raise ValueError(f"expected {path} to be a kvoffload region, got another file: remove it")
    _, token, want, joined = header
    if size != nbytes + want + HEADER.size:
        raise ValueError(
            f"expected {path} to hold {nbytes} bytes, got {size - want - HEADER.size}: another "
            f"engine with engine_id {_engine(path)!r} and another host tier size; give each "
            "engine on a host its own engine_id"
        )
    if want != expected:
        raise ValueError(
            f"expected {path} to be shared by {expected} processes as this one counts, got "
            f"{want} from its creator: two configurations for one engine_id?"
        )
    roles = bytearray(os.pread(fd, want, nbytes))
    if roles[role]:
        raise ValueError(
            f"expected engine_id {_engine(path)!r} to name one engine on this host, got a second "
            f"one: role {role} of {want} (0: the scheduler, r + 1: worker rank r) has already "
            "mapped its region; give each engine on a host its own engine_id "
            "(kv_transfer_config.engine_id)"
        )
    roles[role] = 1
    os.pwrite(fd, bytes(roles) + HEADER.pack(MAGIC, token, want, joined + 1), nbytes)
    _kill_point("join:counted")
    if joined + 1 >= want:
        path.unlink(missing_ok=True)
        _kill_point("join:unlinked")
    return bytes(token)


def _remove_dead(path: Path) -> bool:
    """Unlink a region name that no process of its id maps; False when an older kvoffload (which
    holds ``flock`` on the region itself) still maps it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        if not _try_flock(fd, fcntl.LOCK_EX):
            return False
        if _same_file(path, fd):
            path.unlink()
        return True
    finally:
        os.close(fd)


def _reclaim_id(lock_path: Path) -> list[Path]:
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except OSError:
        return []  # gone meanwhile, or not ours to open
    try:
        if not _try_lock(fd) or not _try_flock(fd, fcntl.LOCK_EX):
            return []  # being opened, or mapped by a live process
        if not _same_file(lock_path, fd):
            return []
        stem = lock_path.name.removesuffix(ID_SUFFIX)
        pattern = re.compile(re.escape(stem) + _TMP_TAIL)
        removed = [p for p in lock_path.parent.iterdir() if pattern.fullmatch(p.name)]
        for tmp in removed:
            tmp.unlink(missing_ok=True)
        region = lock_path.with_name(stem + SUFFIX)
        if region.exists() and _remove_dead(region):
            removed.append(region)
        lock_path.unlink()
        return removed
    finally:
        os.close(fd)


def _reclaim_old(path: Path) -> bool:
    """A region file without an id file: an older kvoffload's, reclaimed once nobody holds it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        if not _try_flock(fd, fcntl.LOCK_EX) or not _same_file(path, fd):
            return False
        path.unlink()
        return True
    finally:
        os.close(fd)


def _lock_id(lock_path: Path) -> int:
    """Open (creating) ``lock_path`` and take its byte-0 OFD write lock, polling up to
    ``LOCK_TIMEOUT_S``; starts over when a reclaim unlinked it under us."""
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            if os.fstat(fd).st_uid == os.geteuid():
                os.fchmod(fd, 0o600)  # whatever the umask: every process of the engine opens it
            while not _try_lock(fd):
                if time.monotonic() > deadline:
                    raise ValueError(
                        f"expected to take {lock_path} within {LOCK_TIMEOUT_S} s, got it held by "
                        "another process opening the same engine_id that neither finishes nor "
                        "dies"
                    )
                time.sleep(0.005)
            same = _same_file(lock_path, fd)
        except BaseException:  # closed whatever stopped us (an interrupt included), then raised
            os.close(fd)
            raise
        if same:
            return fd
        os.close(fd)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))
    except BlockingIOError:
        return False
    except PermissionError:  # EACCES: some systems' word for a lock held elsewhere
        return False
    return True


def _unlock(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 1, 0))


def _try_flock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _new_file(path: Path, token: bytes) -> tuple[int, Path | None]:
    """A new file for the region ``path``: unnamed (``O_TMPFILE``) where the file system allows,
    else under a temporary name (returned)."""
    if USE_TMPFILE:
        try:
            return os.open(path.parent, os.O_TMPFILE | os.O_RDWR, 0o600), None
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    tmp = path.with_name(f"{id_path(path).stem}.{token.hex()}{TMP_SUFFIX}")
    return os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600), tmp


def _link(fd: int, tmp: Path | None, path: Path) -> None:
    """Give the built file its name; never replaces one (the id lock says none is there)."""
    if tmp is not None:
        os.link(tmp, path)
        return
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:  # a dir fd makes os.link call linkat(AT_SYMLINK_FOLLOW), which /proc/self/fd needs
        os.link(f"/proc/self/fd/{fd}", path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _read_header(fd: int) -> tuple[bytes, bytes, int, int] | None:
    size = os.fstat(fd).st_size
    if size < HEADER.size:
        return None
    header: tuple[bytes, bytes, int, int] = HEADER.unpack(
        os.pread(fd, HEADER.size, size - HEADER.size)
    )
    return header


def _engine(path: Path) -> str:
    return path.name.removeprefix(PREFIX).removesuffix(SUFFIX)


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _kill_point(step: str) -> None:
    """Tests: die here, as SIGKILL or a crash would, when ``KVOFFLOAD_SHM_KILL_AT`` names ``step``
    (``locked``, ``create:open``, ``create:sized``, ``create:header``, ``create:linked``,
    ``join:open``, ``join:counted``, ``join:unlinked``)."""
    if os.environ.get(KILL_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)
