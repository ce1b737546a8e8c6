"""Data sets in the coordinator's data roots.

Names, uploads (``neuroshard data put``) and the listing (``neuroshard data ls``).

An upload streams into a temporary file next to its target in the first data root, counted
against ``max_dataset_bytes`` as the bytes arrive; once complete it is validated
(``coordinator.dataset_check``), fsynced and renamed into place atomically, so a job never
sees a partial or invalid file under a data set's name, and a refused upload leaves nothing.
The methods do blocking file I/O: the servicer calls them in a thread.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from coordinator.dataset_check import ArrayInfo, DatasetTooLarge, check_dataset
from shared.fsync import fsync_dir

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_NAME_CHARS = 128
LISTED_SUFFIXES = (".npz", ".npy")
_PART_SUFFIX = ".part"  # a temporary upload: never listed, never a data set's name


class DatasetNameError(ValueError):
    """A data set name that is not allowed (INVALID_ARGUMENT); the message names ``name``.

    Allowed: ``[A-Za-z0-9][A-Za-z0-9._-]*``, at most 128 characters, without ``..``.
    """


class DatasetExists(FileExistsError):
    """A data set of that name exists and the upload does not replace it (ALREADY_EXISTS)."""


class UploadError(ValueError):
    """An upload stream with more or fewer bytes than its header declared (INVALID_ARGUMENT)."""


def dataset_name(name: str) -> str:
    """The validated name of a data set, without a trailing ``.npz`` (stored as NAME.npz).

    Raises:
        DatasetNameError: empty, longer than 128 characters, characters outside
            ``[A-Za-z0-9._-]``, a first character that is not a letter or digit, or ``..``
            (INVALID_ARGUMENT).
    """
    stem = name.removesuffix(".npz")
    if not stem or len(stem) > MAX_NAME_CHARS:
        raise DatasetNameError(f"name: must be 1 to {MAX_NAME_CHARS} characters, got {len(stem)}")
    if not NAME_PATTERN.fullmatch(stem) or ".." in stem:
        raise DatasetNameError(
            f"name: {name!r} must match [A-Za-z0-9][A-Za-z0-9._-]* without '..' "
            "(no path separators)"
        )
    return stem


@dataclass(frozen=True)
class StoredDataset:
    """A data set as stored: ``path`` is relative to the data root (``NAME.npz``)."""

    name: str
    path: str
    bytes: int
    sha256: str
    kind: str
    arrays: list[ArrayInfo]


def _too_large(label: str, size: str, max_bytes: int) -> DatasetTooLarge:
    return DatasetTooLarge(
        f"{label}: {size} bytes exceed the coordinator's max_dataset_bytes {max_bytes} bytes"
    )


class Upload:
    """One data set being received into ``root``."""

    def __init__(
        self, root: Path, name: str, total_bytes: int, max_bytes: int, replace: bool
    ) -> None:
        """Check the name and the declared size, and open a temporary file next to the target.

        Args:
            root: the first data root (created if missing).
            name: the requested name (validated by :func:`dataset_name`).
            total_bytes: the file size the client declared, bytes.
            max_bytes: ``max_dataset_bytes``.
            replace: overwrite an existing data set of that name.

        Raises:
            DatasetNameError: a bad name (INVALID_ARGUMENT); nothing is created.
            DatasetTooLarge: ``total_bytes`` over ``max_bytes`` (RESOURCE_EXHAUSTED).
            DatasetExists: the name is taken and ``replace`` is false (ALREADY_EXISTS).
        """
        self.name = dataset_name(name)
        self.label = f"{self.name}.npz"
        if total_bytes > max_bytes:
            raise _too_large(self.label, str(total_bytes), max_bytes)
        self.target = root / self.label
        if not replace and self.target.exists():
            raise DatasetExists(f"{self.label} exists; pass --replace to overwrite it")
        self.total_bytes, self.max_bytes, self.replace = total_bytes, max_bytes, replace
        self.received = 0
        self.committed = False
        self._sha = hashlib.sha256()
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.label}.", suffix=_PART_SUFFIX, dir=root)
        self.tmp = Path(tmp)
        self._file: BinaryIO | None = os.fdopen(fd, "wb")

    def write(self, data: bytes) -> None:
        """Append the next bytes of the file.

        Raises:
            DatasetTooLarge: the bytes received exceed ``max_bytes`` (RESOURCE_EXHAUSTED).
            UploadError: more bytes than declared (INVALID_ARGUMENT).
            The upload is discarded on either.
        """
        received = self.received + len(data)
        if received > self.max_bytes:
            self.discard()
            raise _too_large(self.label, f"more than {self.max_bytes}", self.max_bytes)
        if received > self.total_bytes:
            self.discard()
            raise UploadError(f"{self.label}: more bytes than the {self.total_bytes} declared")
        assert self._file is not None, "write after commit or discard"
        self._file.write(data)
        self._sha.update(data)
        self.received = received

    def commit(self) -> StoredDataset:
        """Validate the complete file and move it into place (fsync, then atomic rename).

        Raises:
            UploadError: fewer bytes than declared (INVALID_ARGUMENT).
            DatasetInvalid: not a valid data set (INVALID_ARGUMENT).
            DatasetTooLarge: its arrays exceed ``max_bytes`` once loaded (RESOURCE_EXHAUSTED).
            DatasetExists: the name was taken meanwhile and ``replace`` is false.
            The upload is discarded on any of them.
        """
        try:
            if self.received != self.total_bytes:
                raise UploadError(
                    f"{self.label}: the stream ended after {self.received} of the "
                    f"{self.total_bytes} bytes declared"
                )
            assert self._file is not None, "commit after discard"
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            kind, arrays = check_dataset(self.tmp, self.label, self.max_bytes)
            self._place()
        except BaseException:
            self.discard()
            raise
        self.committed = True
        fsync_dir(self.target.parent)
        return StoredDataset(
            self.name, self.label, self.received, self._sha.hexdigest(), kind, arrays
        )

    def _place(self) -> None:
        if self.replace:
            os.replace(self.tmp, self.target)
            return
        try:  # a hard link never overwrites: atomic "create if absent"
            os.link(self.tmp, self.target)
        except FileExistsError:
            raise DatasetExists(f"{self.label} exists; pass --replace to overwrite it") from None
        self.tmp.unlink()

    def discard(self) -> None:
        """Close and remove the temporary file (idempotent; nothing once committed)."""
        if self.committed:
            return
        if self._file is not None:
            self._file.close()
            self._file = None
        self.tmp.unlink(missing_ok=True)


def remove_stale_uploads(root: Path) -> list[str]:
    """Remove the temporary files of uploads a previous process did not finish.

    Call at start, before any upload.

    Args:
        root: the data root uploads go to.

    Returns:
        The paths removed.
    """
    if not root.is_dir():
        return []
    stale = [p for p in root.glob(f".*{_PART_SUFFIX}") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return [p.name for p in stale]


@dataclass(frozen=True)
class DatasetEntry:
    """One listed file: ``path`` relative to data root number ``root`` ("/"-separated)."""

    path: str
    bytes: int
    modified_at: float
    root: int


def list_datasets(roots: Sequence[Path]) -> list[DatasetEntry]:
    """The ``.npz`` and ``.npy`` files in the data roots, sorted by root then path.

    Symlinked directories are not entered, and a symlinked file is listed only when its
    target lies inside the same root; temporary uploads are skipped. A missing root lists
    nothing.
    """
    out: list[DatasetEntry] = []
    for index, root in enumerate(roots):
        real_root = Path(os.path.realpath(root))
        for folder, dirs, files in os.walk(root, followlinks=False):
            dirs.sort()
            for name in sorted(files):
                path = Path(folder) / name
                if not name.endswith(LISTED_SUFFIXES) or name.startswith("."):
                    continue
                real = Path(os.path.realpath(path))
                if real_root not in real.parents or not real.is_file():
                    continue  # a symlink out of the root, or a dangling one
                st = real.stat()
                rel = path.relative_to(root).as_posix()
                out.append(DatasetEntry(rel, st.st_size, st.st_mtime, index))
    return out
