"""Who may see a tier's files: directories ``0700`` and files ``0600`` whatever the umask, and
the checks a tier runs on directories it is given (``disk.py``'s module docstring says why: the
blocks encode the users' prompts)."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("kvoffload.store.tiers.disk")


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents, each ``0700`` whatever the umask; OSError as
    ``os.makedirs`` raises it (NotADirectoryError for a file there)."""
    missing, parent = [], path
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = parent.parent
    for directory in reversed(missing):
        os.mkdir(directory, 0o700)
        os.chmod(directory, 0o700)
    if not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))


def check_private_dirs(root: Path, tier_dir: Path) -> None:
    """ValueError for a ``root`` (disk_path) or ``tier_dir`` (its fingerprint directory) other
    users can write into (no sticky bit) and for a ``tier_dir`` another user owns; a WARNING for
    one they can read or (sticky) write; ``tier_dir`` of ours is narrowed to ``0700``."""
    for directory in (root, tier_dir):
        try:
            st = os.stat(directory)
        except OSError:
            continue  # made by the tier (0700), or reported when it cannot be
        mode = stat.S_IMODE(st.st_mode)
        if directory == tier_dir and st.st_uid != os.geteuid():
            raise ValueError(
                f"expected the disk tier's directory {directory} to be owned by this process's "
                f"user (uid {os.geteuid()}), got uid {st.st_uid}: that user could replace its "
                "files; remove it or use another disk_path (docs/tiers.md, sharing a disk tier)"
            )
        if mode & 0o022 and not mode & stat.S_ISVTX:
            raise ValueError(
                f"expected disk_path directory {directory} to be writable by its owner only, got "
                f"mode {mode:#o} ({_who(mode, 0o020, 0o002)} can write into it): they could "
                "plant blocks there, served as KV, or replace the tier's files; run chmod go-w "
                f"{directory} (docs/tiers.md, sharing a disk tier)"
            )
        if directory == tier_dir and mode & 0o077:
            os.chmod(directory, 0o700)  # made by an older kvoffload: ours, narrowed
            continue
        if mode & 0o022:
            log.warning(
                "disk tier: %s (mode %#o) is writable by %s (sticky: our files stay ours, but "
                "they can fill it)",
                directory,
                mode,
                _who(mode, 0o020, 0o002),
            )
        elif mode & 0o044:
            log.warning(
                "disk tier: %s (mode %#o) is readable by %s: they can list the tier's files "
                "(not read them: 0600); chmod go-rwx %s to hide them",
                directory,
                mode,
                _who(mode, 0o040, 0o004),
                directory,
            )


def _who(mode: int, group_bit: int, other_bit: int) -> str:
    return " and ".join(
        name for name, bit in (("its group", group_bit), ("other users", other_bit)) if mode & bit
    )


def narrow(fd: int, path: Path) -> None:
    """A file of ours left more open by an older kvoffload becomes ``0600``."""
    st = os.fstat(fd)
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
        os.fchmod(fd, 0o600)
        log.info("disk tier: %s narrowed to 0600 (it held the KV of prompts)", path)
