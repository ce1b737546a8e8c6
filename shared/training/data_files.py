"""A data set's named arrays on disk, memory-mapped: an ``.npz`` or a directory of ``.npy``.

A training set is the arrays ``x``, ``y`` (optional for tokens), and optionally ``x_test``
and ``y_test``, of any numeric dtype (``check_dtype``). They are never read whole:

- a directory's ``NAME.npy`` files, and the members of an ``.npz`` stored uncompressed
  (``np.savez``), are memory-mapped read-only where their data starts (for a member: after
  its zip local header and its ``.npy`` header);
- a compressed member (``np.savez_compressed``) cannot be mapped: it is inflated into memory
  when it is at most ``max_compressed_bytes`` once inflated, else refused with a message
  that says how to save it instead.

Dtypes are checked by ``shared.training.tasks.check_dtype``. ``MappedArray.rows`` reads a
contiguous range through the mapping and drops the mapping's resident pages once more than
``RESIDENT_BYTES`` were read (``madvise(MADV_DONTNEED)``); ``MappedArray.take`` reads
scattered rows with ``pread`` instead (see its note). Either way the pages stay in the
kernel's page cache but leave the process's resident set, so a process that reads a whole
set larger than its memory keeps a bounded RSS. (``np.load(mmap_mode="r")`` maps the same bytes but
gives no handle on the mapping to drop its pages.)

``content_hash`` is the sha256 of the files' bytes, which names a data set's content for the
workers' shard caches.

Shapes: N rows, ``*S`` one row's shape.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import struct
import threading
import weakref
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from shared.npz import UNREADABLE
from shared.training.tasks import DataError, check_dtype

ARRAY_NAMES = ("x", "y", "x_test", "y_test")
RESIDENT_BYTES = 32 << 20  # bytes of a mapping touched before its pages are dropped
HASH_CHUNK_BYTES = 1 << 20
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length
_HEADER_READERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
    (3, 0): np.lib.format.read_array_header_2_0,
}


class MappedArray:
    """One array of a data set: a read-only view of its file's bytes, or an inflated copy."""

    def __init__(
        self,
        name: str,
        array: npt.NDArray[Any],
        mapping: mmap.mmap | None,
        fd: int | None = None,
        offset: int = 0,
    ) -> None:
        """Wrap ``array``, a view of ``mapping`` (None: an array in memory).

        Args:
            name: the array's name in the data set.
            array: [N, *S] the rows.
            mapping: the mapping ``array`` views, whose pages ``rows`` drops.
            fd: the file, open for reading (closed when this object goes); ``take`` reads
                scattered rows from it.
            offset: byte offset of row 0 in the file.
        """
        self.name, self.array, self._mapping = name, array, mapping
        self._fd, self._offset = fd, offset
        if fd is not None:
            weakref.finalize(self, os.close, fd)
        self._touched = 0
        self._lock = threading.Lock()

    @property
    def dtype(self) -> np.dtype[Any]:
        """The array's dtype as stored."""
        return self.array.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """[N, *S]."""
        return tuple(int(d) for d in self.array.shape)

    def __len__(self) -> int:
        """N."""
        return int(self.array.shape[0]) if self.array.ndim else 0

    def take(self, rows: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
        """Copy the given rows into memory, in their order.

        A file's rows are read with ``pread``, runs of consecutive rows at once, in
        ascending order, not through the mapping: on kernels that map a page-cache folio
        whole on a fault, a few scattered rows would map most of the file (measured on
        Linux 6.18: 1024 random 1 KiB rows of an 800 MiB file mapped 730 MiB). The pages
        stay in the page cache, outside the process's resident set.

        Args:
            rows: [R] int64 row indices in [0, N).

        Returns:
            [R, *S] in the stored dtype (a new array).
        """
        order = np.argsort(rows, kind="stable")
        sorted_rows = rows[order]
        if self._fd is None:
            out = np.empty((len(rows), *self.array.shape[1:]), self.array.dtype)
            out[order] = self.array[sorted_rows]
            return out
        got = np.empty((len(rows), *self.array.shape[1:]), self.array.dtype)
        row_bytes = got.itemsize * math.prod(got.shape[1:])
        view = got.reshape(-1).view(np.uint8).data if got.size else memoryview(b"")
        breaks = np.flatnonzero(np.diff(sorted_rows) != 1) + 1
        starts = np.concatenate([[0], breaks]).astype(np.int64)
        ends = np.concatenate([breaks, [len(rows)]]).astype(np.int64)
        for i, j in zip(starts.tolist(), ends.tolist(), strict=True):
            self._pread(view[i * row_bytes : j * row_bytes], int(sorted_rows[i]) * row_bytes)
        out = np.empty_like(got)
        out[order] = got
        return out

    def _pread(self, into: memoryview, at: int) -> None:
        """Fill ``into`` from byte ``at`` of the array's data.

        Raises:
            DataError: the file ends early (truncated since it was opened).
        """
        assert self._fd is not None
        done = 0
        while done < len(into):
            n = os.preadv(self._fd, [into[done:]], self._offset + at + done)
            if n <= 0:
                raise DataError(f"array {self.name!r}: the file ended early (truncated?)")
            done += n

    def rows(self, start: int, stop: int) -> npt.NDArray[Any]:
        """Copy rows [start, stop) into memory through the mapping.

        The mapping's pages are dropped once ``RESIDENT_BYTES`` were read since the last drop.
        """
        out = np.array(self.array[start:stop])
        self._count(out.nbytes)
        return out

    def _count(self, nbytes: int) -> None:
        if self._mapping is None:
            return
        with self._lock:
            self._touched += nbytes
            if self._touched < RESIDENT_BYTES:
                return
            self._touched = 0
        self.release()

    def release(self) -> None:
        """Drop the mapping's resident pages (they stay in the page cache); a no-op in memory."""
        if self._mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._mapping.madvise(mmap.MADV_DONTNEED)


def _read_header(f: Any, where: str) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    """The ``.npy`` header at ``f``'s position: shape, Fortran order, dtype.

    Raises:
        DataError: a bad magic, version or header (names ``where``).
    """
    try:
        version = np.lib.format.read_magic(f)
        if version not in _HEADER_READERS:
            raise ValueError(f"format version {version} is not supported")
        shape, fortran, dtype = _HEADER_READERS[version](f)
    except (ValueError, EOFError, struct.error) as exc:
        raise DataError(f"{where}: not a readable .npy header ({exc})") from None
    return tuple(int(d) for d in shape), bool(fortran), np.dtype(dtype)


def _check_header(
    name: str, shape: tuple[int, ...], fortran: bool, dtype: np.dtype[Any], have: int
) -> None:
    """Refuse a dtype, a Fortran-order array or a header claiming more bytes than stored."""
    check_dtype(name, dtype)
    if fortran and len(shape) > 1:
        raise DataError(
            f"array {name!r} is stored in Fortran order; save np.ascontiguousarray of it"
        )
    if not shape:
        raise DataError(f"array {name!r} is a scalar; a data set's arrays are [N, ...]")
    need = math.prod(shape) * dtype.itemsize
    if need > have:
        raise DataError(f"array {name!r} claims shape {shape} ({need} bytes) but holds {have}")


def _map(name: str, path: Path, offset: int, shape: tuple[int, ...], dtype: Any) -> MappedArray:
    """Map ``shape`` of ``dtype`` at byte ``offset`` of ``path`` read-only."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes == 0:
        return MappedArray(name, np.empty(shape, dtype), None)
    fd = os.open(path, os.O_RDONLY)
    try:
        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except BaseException:
        os.close(fd)
        raise
    array = np.ndarray(shape, dtype, buffer=mapping, offset=offset)
    return MappedArray(name, array, mapping, fd, offset)


def _open_npy(name: str, path: Path) -> MappedArray:
    with path.open("rb") as f:
        shape, fortran, dtype = _read_header(f, f"{path.name}")
        offset = f.tell()
    _check_header(name, shape, fortran, dtype, path.stat().st_size - offset)
    return _map(name, path, offset, shape, dtype)


def _member_data_offset(f: Any, info: zipfile.ZipInfo) -> int:
    """Byte offset in the archive where a member's (stored) bytes start."""
    f.seek(info.header_offset)
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
    if signature != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"member {info.filename!r}: bad local header")
    return int(info.header_offset) + _LOCAL_HEADER.size + int(name_len) + int(extra_len)


def _open_member(
    name: str, path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo, max_compressed_bytes: int
) -> MappedArray:
    if info.flag_bits & 0x1:
        raise DataError(f"array {name!r} is encrypted in the archive")
    if info.compress_type == zipfile.ZIP_STORED:
        with path.open("rb") as f:
            start = _member_data_offset(f, info)
            f.seek(start)
            shape, fortran, dtype = _read_header(f, f"member {info.filename!r}")
            offset = f.tell()
        _check_header(name, shape, fortran, dtype, info.file_size - (offset - start))
        return _map(name, path, offset, shape, dtype)
    with zf.open(info) as f:
        shape, fortran, dtype = _read_header(f, f"member {info.filename!r}")
        header_bytes = f.tell()
        _check_header(name, shape, fortran, dtype, info.file_size - header_bytes)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > max_compressed_bytes:
            raise DataError(
                f"array {name!r} is compressed in the .npz ({nbytes} bytes once inflated, over "
                f"the coordinator's max_compressed_array_bytes {max_compressed_bytes}); save "
                "it uncompressed (np.savez, not np.savez_compressed) or as a directory of .npy "
                "files, which are memory-mapped instead"
            )
        data = f.read(nbytes)
    if len(data) != nbytes:
        raise DataError(f"array {name!r}: the archive holds fewer bytes than its header claims")
    return MappedArray(name, np.frombuffer(data, dtype).reshape(shape), None)


def _members(zf: zipfile.ZipFile) -> dict[str, zipfile.ZipInfo]:
    """The members of the training arrays, by array name (``NAME`` or ``NAME.npy``)."""
    present = {i.filename: i for i in zf.infolist()}
    out = {}
    for name in ARRAY_NAMES:
        info = present.get(f"{name}.npy", present.get(name))
        if info is not None:
            out[name] = info
    return out


def open_arrays(path: Path, max_compressed_bytes: int | None = None) -> dict[str, MappedArray]:
    """Open a data set's arrays (``ARRAY_NAMES`` that are present) without reading their data.

    Args:
        path: an ``.npz`` file, or a directory holding ``x.npy`` (``y.npy``, ``x_test.npy``,
            ``y_test.npy``); symlinked ``.npy`` files in a directory are refused.
        max_compressed_bytes: the most bytes a compressed ``.npz`` member may inflate to
            (``max_compressed_array_bytes``); None: no cap.

    Returns:
        The arrays by name, in ``ARRAY_NAMES`` order.

    Raises:
        DataError: missing path, unreadable file, a dtype ``check_dtype`` refuses, a
            Fortran-order or scalar array, a header claiming more bytes than stored, or a
            compressed member over the cap (INVALID_ARGUMENT); each names the array.
    """
    cap = max_compressed_bytes if max_compressed_bytes is not None else math.inf
    try:
        if path.is_dir():
            out = {}
            for name in ARRAY_NAMES:
                file = path / f"{name}.npy"
                if file.is_symlink():
                    raise DataError(f"{name}.npy is a symlink; a data set's files are its own")
                if file.is_file():
                    out[name] = _open_npy(name, file)
            return out
        if not path.is_file():
            raise DataError(f"{path.name}: no such file or directory")
        with zipfile.ZipFile(path) as zf:
            return {
                name: _open_member(name, path, zf, info, int(min(cap, 1 << 62)))
                for name, info in _members(zf).items()
            }
    except DataError:
        raise
    except UNREADABLE as exc:
        raise DataError(f"{path.name}: not a readable .npz or .npy directory ({exc})") from None


@dataclass(frozen=True)
class FileVersion:
    """What identifies a version of a data set's files: each one's name, size and mtime."""

    path: str
    files: tuple[tuple[str, int, int], ...]  # (name, bytes, mtime_ns)


def data_files(path: Path) -> list[Path]:
    """The files whose bytes make a data set: the ``.npz``, or the directory's array files."""
    if path.is_dir():
        return [path / f"{n}.npy" for n in ARRAY_NAMES if (path / f"{n}.npy").is_file()]
    return [path]


def file_version(path: Path) -> FileVersion:
    """The version of a data set's files now (``os.stat`` of each).

    Raises:
        OSError: a file cannot be read.
    """
    stats = [(f.name, os.stat(f)) for f in data_files(path)]
    return FileVersion(str(path), tuple((n, s.st_size, s.st_mtime_ns) for n, s in stats))


def content_hash(path: Path) -> str:
    """The sha256 (hex) of a data set's arrays: each array's name and ``.npy`` bytes, in order.

    The ``.npy`` bytes (header and data) are those of the directory's files or of the
    archive's members once inflated, so a set saved again, or as a directory instead of an
    ``.npz``, has the same hash (a zip's timestamps are not hashed). Read in chunks of
    ``HASH_CHUNK_BYTES`` (a bounded amount of memory).

    Raises:
        OSError: a file cannot be read.
        DataError: an archive cannot be read.
    """
    digest = hashlib.sha256()

    def add(name: str, f: Any) -> None:
        digest.update(f"{name}\0".encode())
        for chunk in iter(lambda: f.read(HASH_CHUNK_BYTES), b""):
            digest.update(chunk)

    if path.is_dir():
        for file in data_files(path):
            with file.open("rb") as f:
                add(file.stem, f)
        return digest.hexdigest()
    try:
        with zipfile.ZipFile(path) as zf:
            for name, info in _members(zf).items():
                with zf.open(info) as member:
                    add(name, member)
    except UNREADABLE as exc:
        raise DataError(f"{path.name}: not a readable .npz ({exc})") from None
    return digest.hexdigest()


def row_blocks(n: int, row_bytes: int, block_bytes: int) -> Iterator[tuple[int, int]]:
    """Half-open ranges covering [0, n), each of at most ``block_bytes`` (at least one row)."""
    step = max(1, block_bytes // max(row_bytes, 1))
    for start in range(0, n, step):
        yield start, min(n, start + step)


__all__ = [
    "ARRAY_NAMES",
    "FileVersion",
    "MappedArray",
    "check_dtype",
    "content_hash",
    "file_version",
    "open_arrays",
    "row_blocks",
]
