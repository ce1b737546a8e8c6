"""Files only the daemon's user may read: data dirs 0700, files 0600.

Journals hold payloads, ``coordinator.db`` every user's job specs, and models, checkpoints and
data sets are users' work: nothing a daemon keeps may be readable by group or others. The
daemons create their directories with ``private_dir`` and their files with ``open_private``
or ``write_private`` (explicit modes, whatever the process umask); ``restrict_umask``, called
by the daemons' entry points, makes anything created by a library (SQLite's WAL, torch.save)
private as well.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from shared.fsync import fsync_dir

DIR_MODE = 0o700
FILE_MODE = 0o600
UMASK = 0o077  # group and others get nothing


def restrict_umask() -> int:
    """Set the process umask to 077 (files 0600, directories 0700); return the previous one.

    Call once at a daemon's start, before it creates anything: it applies to the whole
    process, so in-process servers (tests) rely on the explicit modes instead.
    """
    return os.umask(UMASK)


def private_dir(path: Path) -> Path:
    """Create ``path`` and its missing parents 0700; make ``path`` itself 0700 if it exists.

    Only directories created here and ``path`` are changed: a parent that exists already
    (``/var/lib``) keeps its mode.

    Returns:
        ``path``.

    Raises:
        OSError: a directory cannot be created or changed.
    """
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:
            pass  # created meanwhile by another thread
        os.chmod(d, DIR_MODE)  # mkdir's mode is masked by the umask
    if path.is_dir() and (path.stat().st_mode & 0o777) != DIR_MODE:
        os.chmod(path, DIR_MODE)
    return path


def open_private(path: Path, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC) -> int:
    """``os.open`` a file with mode 0600, also when it existed with a wider mode.

    Returns:
        The file descriptor.
    """
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_private(path: Path) -> BinaryIO:
    """Open ``path`` for writing (truncated, created 0600) as a binary file object."""
    return os.fdopen(open_private(path), "wb")


def touch_private(path: Path) -> Path:
    """Create ``path`` empty 0600 if missing, or make it 0600 (e.g. before SQLite opens it).

    Returns:
        ``path``.
    """
    os.close(open_private(path, os.O_RDWR | os.O_CREAT))
    return path


def write_private(path: Path, data: bytes | Iterable[bytes]) -> None:
    """Durably replace ``path`` with ``data`` (0600): temporary file, fsync, rename, dir fsync.

    The one atomic whole-file write of the daemons (data set owners, training checkpoints,
    journal snapshots): a crash leaves the old file or the new one, never a torn one, and at
    most the temporary file ``.NAME.tmp`` beside it (replaced by the next write).

    Args:
        path: the file to replace; its directory must exist.
        data: the content, or its pieces in order (written as they come, never joined: a
            snapshot's arrays are not copied into one buffer).

    Raises:
        OSError: the disk refused the write or the fsync.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    with create_private(tmp) as f:
        for piece in (data,) if isinstance(data, bytes) else data:
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
