"""Durable renames: the one helper both daemons' atomic writes end with.

A file written to a temporary name, fsynced and renamed into place survives a power cut only
once its directory is fsynced too (POSIX leaves the rename in the page cache until then).
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Fsync a directory, so that a file created or renamed in it survives a power cut.

    Args:
        path: the directory.

    Raises:
        OSError: it cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
