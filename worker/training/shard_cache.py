"""Training rows fetched from the coordinator, kept on disk across jobs and memory-mapped.

A file data set's rows reach a worker through ``FetchShard`` and are written as they
arrive into ``DATA_DIR/shard_cache`` (directories 0700, files 0600), one entry per fetched
row range: ``KEY-START-STOP/NAME.npy`` for each array of a row (``x``, and ``y`` when the
set has one), in the dtype the data set stores. ``KEY`` is the job's ``data_key`` (a hash
of the data set's content and of its train split, ``shared.training.file_sets``), so rows
[START, STOP) of an entry are the same bytes for every job with that key: a second job on
the same data, or a shard handed over from another worker, fetches only the rows no entry
covers (``missing``).

An entry is written in a hidden temporary directory and renamed into place once complete,
so an entry that exists is whole; leftovers of a killed process are removed at start.
Entries a running job uses are pinned; past ``max_bytes`` the least recently used unpinned
entries are removed (an entry's use is its directory's mtime, so the order survives a
restart). Pinned entries are never removed: a job's own rows may take the cache past
``max_bytes`` while it runs.

Thread-safe: entries are written and read from the event loop's threads.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from shared.logging import get_logger
from shared.private_files import FILE_MODE, private_dir
from shared.training.data_files import MappedArray, open_arrays
from shared.training.tasks import DataError

log = get_logger(__name__)
_ENTRY = re.compile(r"^([0-9a-f]{8,64})-(\d+)-(\d+)$")
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class Layout:
    """One array of a row as the coordinator stores it: name, dtype, one row's shape."""

    name: str
    dtype: str
    row_shape: tuple[int, ...]


@dataclass
class Piece:
    """One cache entry: global training rows [start, stop) of ``key``, mapped."""

    key: str
    start: int
    stop: int
    path: Path
    nbytes: int
    arrays: dict[str, MappedArray] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The entry's directory name."""
        return self.path.name


class PieceWriter:
    """Writes one entry's arrays as their chunks arrive, then places it (``commit``)."""

    def __init__(self, cache: ShardCache, key: str, start: int, stop: int, layouts: list[Layout]):
        """Create the temporary directory and each array's file with its ``.npy`` header.

        Raises:
            OSError: the cache directory cannot be written.
        """
        self._cache, self.key, self.start, self.stop = cache, key, start, stop
        self.tmp = private_dir(cache.root / f"{_TMP_PREFIX}{uuid.uuid4().hex}")
        self._files: dict[str, BinaryIO] = {}
        self._left: dict[str, int] = {}
        self._written: dict[str, int] = {}
        rows = stop - start
        for lay in layouts:
            dtype = np.dtype(lay.dtype).newbyteorder("<")
            fd = os.open(
                self.tmp / f"{lay.name}.npy", os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE
            )
            f = os.fdopen(fd, "wb")
            header = {
                "descr": np.lib.format.dtype_to_descr(dtype),
                "fortran_order": False,
                "shape": (rows, *lay.row_shape),
            }
            np.lib.format.write_array_header_2_0(f, header)
            self._files[lay.name] = f
            self._left[lay.name] = (
                rows * dtype.itemsize * int(np.prod(lay.row_shape, dtype=np.int64))
            )
            self._written[lay.name] = 0

    def write(self, name: str, offset: int, data: bytes) -> None:
        """Append the bytes of array ``name`` at byte ``offset`` of its data.

        Raises:
            DataError: an unknown array, bytes out of order, or more than its size
                (INVALID_ARGUMENT).
        """
        if name not in self._files:
            raise DataError(f"shard rows: unexpected array {name!r}")
        if offset != self._written[name] or len(data) > self._left[name]:
            raise DataError(
                f"shard rows: array {name!r} bytes at {offset} out of order or past its end"
            )
        self._files[name].write(data)
        self._written[name] += len(data)
        self._left[name] -= len(data)

    def commit(self) -> Piece:
        """Close the files and place the entry; return it opened (pinned by the caller).

        Raises:
            DataError: an array is incomplete (INVALID_ARGUMENT); the entry is discarded.
        """
        incomplete = [n for n, left in self._left.items() if left]
        for f in self._files.values():
            f.close()
        if incomplete:
            self.abort()
            raise DataError(f"shard rows: array {incomplete[0]!r} is incomplete")
        return self._cache.place(self)

    def abort(self) -> None:
        """Discard the temporary entry (idempotent)."""
        for f in self._files.values():
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class ShardCache:
    """The entries under ``root``, their pins and the size bound."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        """Index the entries under ``root`` (created 0700), removing unfinished ones.

        Args:
            root: ``DATA_DIR/shard_cache``.
            max_bytes: ``shard_cache_bytes``.
        """
        self.root, self.max_bytes = private_dir(root), max_bytes
        self._lock = threading.Lock()
        self._entries: dict[str, Piece] = {}
        self._pins: dict[str, int] = {}
        for p in self.root.iterdir():
            m = _ENTRY.match(p.name)
            if p.name.startswith(_TMP_PREFIX) or not m or not p.is_dir():
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                continue
            size = sum(f.stat().st_size for f in p.iterdir())
            self._entries[p.name] = Piece(m[1], int(m[2]), int(m[3]), p, size)

    @property
    def used_bytes(self) -> int:
        """Bytes of the entries on disk."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def covering(self, key: str, start: int, stop: int) -> list[Piece]:
        """Entries of ``key`` overlapping [start, stop), longest first."""
        with self._lock:
            found = [
                e
                for e in self._entries.values()
                if e.key == key and e.start < stop and e.stop > start
            ]
        return sorted(found, key=lambda e: (e.start - e.stop, e.start))

    def missing(self, key: str, start: int, stop: int) -> list[tuple[int, int]]:
        """The sub-ranges of [start, stop) that no entry of ``key`` holds, in order."""
        gaps, at = [], start
        for e in sorted(self.covering(key, start, stop), key=lambda e: e.start):
            if e.start > at:
                gaps.append((at, e.start))
            at = max(at, e.stop)
        if at < stop:
            gaps.append((at, stop))
        return gaps

    def writer(self, key: str, start: int, stop: int, layouts: list[Layout]) -> PieceWriter:
        """A new entry for rows [start, stop) of ``key``; room is made first (``_fit``)."""
        self._fit(sum((stop - start) * _row_bytes(lay) for lay in layouts))
        return PieceWriter(self, key, start, stop, layouts)

    def place(self, w: PieceWriter) -> Piece:
        """Rename a complete entry into place and index it (``PieceWriter.commit``)."""
        final = self.root / f"{w.key}-{w.start}-{w.stop}"
        with self._lock:
            if final.exists():  # written meanwhile by another fetch: keep the first
                shutil.rmtree(w.tmp, ignore_errors=True)
            else:
                os.rename(w.tmp, final)
            size = sum(f.stat().st_size for f in final.iterdir())
            piece = self._entries.setdefault(final.name, Piece(w.key, w.start, w.stop, final, size))
        return piece

    def pin(self, pieces: Iterable[Piece]) -> list[Piece]:
        """Pin entries for a job and open their arrays; mark them used now.

        Raises:
            DataError: an entry's files cannot be read (it is removed; fetch again).
        """
        out = []
        for p in pieces:
            with self._lock:
                self._pins[p.name] = self._pins.get(p.name, 0) + 1
            try:
                if not p.arrays:
                    p.arrays = open_arrays(p.path)
                os.utime(p.path)
            except (DataError, OSError) as exc:
                self.unpin([p])
                self._remove(p.name)
                raise DataError(f"shard cache entry {p.name}: {exc}") from None
            out.append(p)
        return out

    def unpin(self, pieces: Iterable[Piece]) -> None:
        """Release a job's pins; entries past ``max_bytes`` may go now."""
        with self._lock:
            for p in pieces:
                left = self._pins.get(p.name, 0) - 1
                if left > 0:
                    self._pins[p.name] = left
                else:
                    self._pins.pop(p.name, None)
        self._fit(0)

    def _fit(self, incoming: int) -> None:
        """Remove least recently used unpinned entries until ``incoming`` more bytes fit."""
        with self._lock:
            free = [e for n, e in self._entries.items() if n not in self._pins]
            used = sum(e.nbytes for e in self._entries.values())
        free.sort(key=lambda e: _mtime(e.path))
        for e in free:
            if used + incoming <= self.max_bytes:
                break
            self._remove(e.name)
            used -= e.nbytes
            log.info("shard_cache_evicted", entry=e.name, bytes=e.nbytes)

    def _remove(self, name: str) -> None:
        with self._lock:
            entry = self._entries.pop(name, None)
        if entry is not None:
            shutil.rmtree(entry.path, ignore_errors=True)


def _row_bytes(lay: Layout) -> int:
    return int(np.prod(lay.row_shape, dtype=np.int64)) * np.dtype(lay.dtype).itemsize


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return 0
