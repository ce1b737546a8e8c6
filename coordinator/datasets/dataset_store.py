"""Data sets in the coordinator's data roots.

Names, uploads (``neuroshard data put``) and the listing (``neuroshard data ls``). An upload
named ``NAME.pt`` is a state dict (``coordinator.datasets.state_dicts``), stored as NAME.pt for
a train job's ``init: {dataset: NAME}``; any other name is an ``.npz`` data set, NAME.npz.

An upload streams into a temporary file next to its target in the first data root, counted
against ``max_dataset_bytes`` as the bytes arrive; once complete it is validated
(``coordinator.datasets.dataset_check``), fsynced and renamed into place atomically, so a job never
sees a partial or invalid file under a data set's name, and a refused upload leaves nothing.
An ``UploadGate`` bounds the uploads in progress (``max_concurrent_uploads``) and the bytes of
the data root (``max_data_root_bytes``, uploads in progress counted at their declared size).

Under auth a data set has an owner: the subject of the token that stored it, kept beside it
in ``.NAME.npz.owner``. Only its owner or an admin may replace it; a data set without that
file (put there by the operator) only an admin. Files are created 0600 in a 0700 root.
The methods do blocking file I/O: the servicer calls them in a thread.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from coordinator.datasets.dataset_check import (
    ArrayInfo,
    DatasetInvalid,
    DatasetTooLarge,
    check_dataset,
)
from coordinator.datasets.state_dicts import WEIGHTS_SUFFIX, StateDictError, check_weights
from shared.fsync import fsync_dir
from shared.private_files import private_dir, write_private

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_NAME_CHARS = 128
LISTED_SUFFIXES = (".npz", ".npy", WEIGHTS_SUFFIX)
_PART_SUFFIX = ".part"  # a temporary upload: never listed, never a data set's name
_OWNER_SUFFIX = ".owner"  # ``.NAME.npz.owner``: the subject that stored NAME.npz


class DatasetNameError(ValueError):
    """A data set name that is not allowed (INVALID_ARGUMENT); the message names ``name``.

    Allowed: ``[A-Za-z0-9][A-Za-z0-9._-]*``, at most 128 characters, without ``..``.
    """


class DatasetExists(FileExistsError):
    """A data set of that name exists and the upload does not replace it (ALREADY_EXISTS)."""


class UploadError(ValueError):
    """An upload stream with more or fewer bytes than its header declared (INVALID_ARGUMENT)."""


class UploadLimit(Exception):
    """Too many uploads in progress, or a full data root (RESOURCE_EXHAUSTED).

    The message names the config key (``max_concurrent_uploads``, ``max_data_root_bytes``).
    """


class DatasetNotOwned(Exception):
    """The caller may not replace a data set another subject stored (PERMISSION_DENIED)."""


@dataclass(frozen=True)
class Uploader:
    """Who uploads: a token's subject, and whether its role is ``admin``."""

    subject: str
    admin: bool = False


def owner_path(dataset: Path) -> Path:
    """Where the owner of the data set file ``dataset`` is recorded (``.NAME.npz.owner``)."""
    return dataset.with_name(f".{dataset.name}{_OWNER_SUFFIX}")


def dataset_owner(dataset: Path) -> str | None:
    """The subject that stored ``dataset``, or None when nobody is recorded."""
    try:
        return owner_path(dataset).read_text(encoding="utf-8").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def check_may_replace(dataset: Path, label: str, uploader: Uploader | None) -> None:
    """Refuse to replace ``dataset`` unless ``uploader`` owns it or is an admin.

    Args:
        dataset: the existing data set file.
        label: its name in messages (``NAME.npz``).
        uploader: the caller; None without auth (anyone may replace).

    Raises:
        DatasetNotOwned: another subject's, or nobody's, and not an admin (PERMISSION_DENIED).
    """
    if uploader is None or uploader.admin:
        return
    owner = dataset_owner(dataset)
    if owner == uploader.subject:
        return
    whose = f"belongs to {owner!r}" if owner else "has no recorded owner"
    raise DatasetNotOwned(
        f"{label} {whose}; only its owner or an admin may replace it, not {uploader.subject!r}"
    )


def root_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root`` (symlinks not followed), uploads excluded.

    Temporary uploads are left out: the gate counts them at their declared size.
    """
    total = 0
    for folder, _dirs, files in os.walk(root, followlinks=False):
        for name in files:
            if name.startswith(".") and name.endswith(_PART_SUFFIX):
                continue
            try:
                st = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:
                continue  # removed meanwhile
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


class UploadGate:
    """The uploads in progress into one data root: their number and their declared bytes.

    Thread-safe: uploads are admitted from the servicer's worker threads.
    """

    def __init__(self, root: Path, max_concurrent: int, max_root_bytes: int) -> None:
        """Guard ``root``.

        Args:
            root: the first data root.
            max_concurrent: ``max_concurrent_uploads``.
            max_root_bytes: ``max_data_root_bytes``, bytes.
        """
        self.root = root
        self.max_concurrent, self.max_root_bytes = max_concurrent, max_root_bytes
        self._lock = threading.Lock()
        self.active = 0  # uploads admitted and not yet ended
        self.reserved = 0  # their declared bytes

    def enter(self, label: str, declared: int, replaced: int) -> None:
        """Admit one upload of ``declared`` bytes, or refuse it; ``leave`` ends it.

        Args:
            label: the data set in messages (``NAME.npz``).
            declared: the file's declared size, bytes.
            replaced: bytes of the file it replaces (0 for a new name), freed at its commit.

        Raises:
            UploadLimit: ``max_concurrent_uploads`` uploads in progress, or the root would
                hold more than ``max_data_root_bytes`` (RESOURCE_EXHAUSTED).
        """
        with self._lock:
            if self.active >= self.max_concurrent:
                raise UploadLimit(
                    f"{label}: {self.active} uploads are in progress, the coordinator's "
                    f"max_concurrent_uploads {self.max_concurrent}; retry when one has ended"
                )
            used = root_bytes(self.root) if self.root.is_dir() else 0
            after = used + self.reserved + declared - replaced
            if after > self.max_root_bytes:
                raise UploadLimit(
                    f"{label}: {declared} bytes would bring the data root to {after} bytes "
                    f"({used} stored, {self.reserved} being uploaded), over the coordinator's "
                    f"max_data_root_bytes {self.max_root_bytes} bytes"
                )
            self.active += 1
            self.reserved += declared

    def leave(self, declared: int) -> None:
        """End an upload ``enter`` admitted (stored or not)."""
        with self._lock:
            self.active -= 1
            self.reserved -= declared


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
    owner: str = ""  # the uploader's subject ("" without auth)


def _too_large(label: str, size: str, max_bytes: int) -> DatasetTooLarge:
    return DatasetTooLarge(
        f"{label}: {size} bytes exceed the coordinator's max_dataset_bytes {max_bytes} bytes"
    )


class Upload:
    """One data set being received into ``root``."""

    def __init__(
        self,
        root: Path,
        name: str,
        total_bytes: int,
        max_bytes: int,
        replace: bool,
        *,
        gate: UploadGate | None = None,
        uploader: Uploader | None = None,
    ) -> None:
        """Check the name, the declared size, the owner and the gate; open a temporary file.

        Args:
            root: the first data root (created 0700 if missing).
            name: the requested name (validated by :func:`dataset_name`).
            total_bytes: the file size the client declared, bytes.
            max_bytes: ``max_dataset_bytes``.
            replace: overwrite an existing data set of that name.
            gate: counts this upload against ``max_concurrent_uploads`` and
                ``max_data_root_bytes`` until it is committed or discarded; None: no limits.
            uploader: the caller, recorded as the owner; None without auth (no owner).

        Raises:
            DatasetNameError: a bad name (INVALID_ARGUMENT); nothing is created.
            DatasetTooLarge: ``total_bytes`` over ``max_bytes`` (RESOURCE_EXHAUSTED).
            DatasetExists: the name is taken and ``replace`` is false (ALREADY_EXISTS).
            DatasetNotOwned: replacing a data set of another subject (PERMISSION_DENIED).
            UploadLimit: the gate refused (RESOURCE_EXHAUSTED); nothing is created.
        """
        # NAME.pt: a state dict (a job's ``init: {dataset: NAME}``); else an .npz data set
        self.suffix = WEIGHTS_SUFFIX if name.endswith(WEIGHTS_SUFFIX) else ".npz"
        self.name = dataset_name(name.removesuffix(WEIGHTS_SUFFIX))
        self.label = f"{self.name}{self.suffix}"
        if total_bytes > max_bytes:
            raise _too_large(self.label, str(total_bytes), max_bytes)
        self.target = root / self.label
        replaced = self.target.stat().st_size if self.target.is_file() else 0
        if not replace and self.target.exists():
            raise DatasetExists(f"{self.label} exists; pass --replace to overwrite it")
        if self.target.exists():
            check_may_replace(self.target, self.label, uploader)
        self.total_bytes, self.max_bytes, self.replace = total_bytes, max_bytes, replace
        self.uploader = uploader
        self.received = 0
        self.committed = False
        self._sha = hashlib.sha256()
        self._file: BinaryIO | None = None
        self._gate: UploadGate | None = None
        if gate is not None:
            gate.enter(self.label, total_bytes, replaced)
            self._gate = gate
        try:
            private_dir(root)
            # mkstemp creates the file 0600
            fd, tmp = tempfile.mkstemp(prefix=f".{self.label}.", suffix=_PART_SUFFIX, dir=root)
        except BaseException:
            self._leave()
            raise
        self.tmp = Path(tmp)
        self._file = os.fdopen(fd, "wb")

    def _leave(self) -> None:
        """Release this upload's place in the gate (once)."""
        if self._gate is not None:
            self._gate.leave(self.total_bytes)
            self._gate = None

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
            kind, arrays = self._check()
            self._place()
        except BaseException:
            self.discard()
            raise
        self.committed = True
        self._leave()
        fsync_dir(self.target.parent)
        owner = self.uploader.subject if self.uploader is not None else ""
        return StoredDataset(
            self.name, self.label, self.received, self._sha.hexdigest(), kind, arrays, owner
        )

    def _check(self) -> tuple[str, list[ArrayInfo]]:
        """Validate the complete file by its kind. Raises: DatasetInvalid, DatasetTooLarge."""
        if self.suffix != WEIGHTS_SUFFIX:
            return check_dataset(self.tmp, self.label, self.max_bytes)
        try:
            return check_weights(self.tmp, self.label, self.max_bytes)
        except StateDictError as exc:
            raise DatasetInvalid(str(exc)) from None

    def _place(self) -> None:
        """Move the file into place and record its owner.

        Replacing: the new owner is recorded first (a crash between leaves the new owner on
        the old file: the owner or an admin, never someone with fewer rights). Creating: the
        file first (a crash leaves a file without owner: an admin's to replace).
        """
        if self.replace and self.target.exists():
            check_may_replace(self.target, self.label, self.uploader)  # again: it may be new
        if self.replace:
            self._record_owner()
            os.replace(self.tmp, self.target)
            return
        try:  # a hard link never overwrites: atomic "create if absent"
            os.link(self.tmp, self.target)
        except FileExistsError:
            raise DatasetExists(f"{self.label} exists; pass --replace to overwrite it") from None
        self.tmp.unlink()
        self._record_owner()

    def _record_owner(self) -> None:
        """Write ``.NAME.npz.owner`` (0600), or remove it when uploaded without auth."""
        path = owner_path(self.target)
        if self.uploader is None:
            path.unlink(missing_ok=True)
            return
        write_private(path, self.uploader.subject.encode())

    def discard(self) -> None:
        """Close and remove the temporary file (idempotent; nothing once committed)."""
        if self.committed:
            return
        self._leave()
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
    owner: str = ""  # the subject that uploaded it; "" when put there otherwise


def list_datasets(roots: Sequence[Path]) -> list[DatasetEntry]:
    """The ``.npz``, ``.npy`` and ``.pt`` files in the data roots, sorted by root then path.

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
                owner = dataset_owner(path) or ""
                out.append(DatasetEntry(rel, st.st_size, st.st_mtime, index, owner))
    return out
