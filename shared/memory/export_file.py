"""The memory-store export file: a plain ``.npz`` that ``np.load(allow_pickle=False)`` reads.

Arrays (N memories, B payload bytes in all):

- ``format``: 0-d unicode, ``"neuroshard-memory-export"``; ``version``: 0-d uint32, 1;
- ``ids`` [N] uint64, unique; ``strengths`` [N] float32, finite, in [0, 1];
- only when some memory has a payload: ``payload_offsets`` [N+1] uint64 and
  ``payload_bytes`` [B] uint8: the payload of ``ids[i]`` is
  ``payload_bytes[payload_offsets[i]:payload_offsets[i+1]]`` (empty: none). Offsets into
  one byte array rather than an object array of ``bytes``: object arrays need pickle.

``ExportWriter`` writes the file as the memories stream in without holding them: each
array goes to a raw temporary file next to the destination, and ``finish`` copies them into
the archive's ``.npy`` members (the length is known only then) and renames it into place, so
a failed export leaves no file. Peak memory is one chunk; peak disk about twice the file.
``read_export`` reads and checks a file whole before anything is sent.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from shared.memory.files import MemoryFileError, read_npz
from shared.memory.validation import MemoryInputError, validate_values
from shared.npz import NpyHeaderError, npz_members

FORMAT = "neuroshard-memory-export"
VERSION = 1
IMPORT_BATCH = 100_000  # memories per upsert call of an import (default)
_COPY_BLOCK = 1 << 22  # bytes copied per read from a temporary file into the archive
_OFFSET_BLOCK = 1 << 20  # payload lengths turned into offsets per step


def _npy_header(dtype: str, n: int) -> bytes:
    """The ``.npy`` (1.0) header of a 1-D array of ``n`` items of ``dtype``."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": (n,)}
    )
    return buf.getvalue()


class ExportWriter:
    """Writes an export file from chunks of memories, holding one chunk at a time."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Prepare to write ``path`` (created or replaced by ``finish``).

        Raises:
            OSError: the destination's directory cannot hold temporary files.
        """
        self.path = Path(path)
        self._tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=self.path.parent))
        self._files: dict[str, IO[bytes]] = {
            n: (self._tmp / n).open("wb") for n in ("ids", "strengths", "lengths", "payloads")
        }
        self.memories = 0
        self.payload_bytes = 0

    def add(
        self,
        ids: npt.NDArray[np.uint64],
        strengths: npt.NDArray[np.float32],
        payloads: dict[int, bytes] | None = None,
    ) -> None:
        """Append memories.

        Args:
            ids: [n] uint64.
            strengths: [n] float32.
            payloads: id -> payload for those of ``ids`` that have one.
        """
        lengths = np.zeros(len(ids), np.uint32)
        if payloads:
            where = {i: k for k, i in enumerate(ids.tolist())}
            rows = sorted((where[i], p) for i, p in payloads.items() if p)
            for k, p in rows:
                lengths[k] = len(p)
                self._files["payloads"].write(p)
            self.payload_bytes += int(lengths.sum())
        self._files["ids"].write(ids.astype("<u8", copy=False).tobytes())
        self._files["strengths"].write(strengths.astype("<f4", copy=False).tobytes())
        self._files["lengths"].write(lengths.astype("<u4", copy=False).tobytes())
        self.memories += len(ids)

    def finish(self) -> int:
        """Write the archive, rename it into place, remove the temporary files.

        Returns:
            The file's size, bytes.
        """
        for f in self._files.values():
            f.close()
        part = self._tmp / "export.npz"
        n = self.memories
        with zipfile.ZipFile(part, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            zf.writestr("format.npy", _array_bytes(np.array(FORMAT)))
            zf.writestr("version.npy", _array_bytes(np.array(VERSION, np.uint32)))
            self._member(zf, "ids", "<u8", n)
            self._member(zf, "strengths", "<f4", n)
            if self.payload_bytes:
                with zf.open("payload_offsets.npy", "w", force_zip64=True) as out:
                    out.write(_npy_header("<u8", n + 1))
                    self._write_offsets(out)
                self._member(zf, "payloads", "|u1", self.payload_bytes, "payload_bytes")
        os.replace(part, self.path)
        self.abort()
        return self.path.stat().st_size

    def _member(
        self, zf: zipfile.ZipFile, name: str, dtype: str, n: int, array: str | None = None
    ) -> None:
        """Copy temporary file ``name`` into the archive as array ``array`` (default: name)."""
        with zf.open(f"{array or name}.npy", "w", force_zip64=True) as out:
            out.write(_npy_header(dtype, n))
            with (self._tmp / name).open("rb") as src:
                shutil.copyfileobj(src, out, _COPY_BLOCK)

    def _write_offsets(self, out: IO[bytes]) -> None:
        """Write [N+1] uint64 offsets: 0, then the running sum of the payload lengths."""
        out.write(np.zeros(1, "<u8").tobytes())
        total = 0
        with (self._tmp / "lengths").open("rb") as src:
            while block := src.read(4 * _OFFSET_BLOCK):
                ends = np.cumsum(np.frombuffer(block, "<u4"), dtype=np.uint64) + np.uint64(total)
                out.write(ends.astype("<u8").tobytes())
                total = int(ends[-1])

    def abort(self) -> None:
        """Remove the temporary files (and a half-written archive); the destination is kept."""
        for f in self._files.values():
            f.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


def _array_bytes(a: npt.NDArray[Any]) -> bytes:
    """A small array as ``.npy`` bytes."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array(buf, a, allow_pickle=False)
    return buf.getvalue()


@dataclass
class ExportData:
    """An export file's memories, checked.

    Attributes:
        ids: [N] uint64, unique.
        strengths: [N] float32 in [0, 1].
        offsets: [N+1] uint64 payload offsets into ``payload_bytes``, or None: no payloads.
        payload_bytes: [B] uint8, or None.
    """

    ids: npt.NDArray[np.uint64]
    strengths: npt.NDArray[np.float32]
    offsets: npt.NDArray[np.uint64] | None = None
    payload_bytes: npt.NDArray[np.uint8] | None = None

    def payloads(self, start: int, stop: int) -> list[bytes] | None:
        """The payloads of memories [start, stop) (b"": none), or None without payloads."""
        if self.offsets is None or self.payload_bytes is None:
            return None
        o, data = self.offsets[start : stop + 1].tolist(), self.payload_bytes
        return [data[a:b].tobytes() for a, b in zip(o[:-1], o[1:], strict=True)]


def read_export(path: str | os.PathLike[str], max_payload_bytes: int) -> ExportData:
    """Read an export file and check every array before anything is sent.

    Args:
        path: the ``.npz`` (``ExportWriter``'s format, module docstring).
        max_payload_bytes: the target cluster's largest payload, bytes.

    Raises:
        MemoryFileError: an unreadable file or a bad array, naming the file and the array
            (the CLI exits 2; the client reports INVALID_ARGUMENT).
    """
    p = Path(path)
    try:
        with p.open("rb"):
            pass
    except OSError as exc:
        raise MemoryFileError(f"{p}: cannot read it ({exc.strerror or exc})") from None
    try:
        with zipfile.ZipFile(p) as zf:
            present = {n.removesuffix(".npy") for n in zf.namelist()}
            pickled = [m.name for m in npz_members(zf) if m.dtype.hasobject]
    except (zipfile.BadZipFile, NpyHeaderError, OSError) as exc:
        raise MemoryFileError(f"{p}: not a readable .npz file ({exc})") from None
    if pickled:  # named before np.load would refuse it less clearly
        raise MemoryFileError(
            f"{p}: {pickled[0]}: dtype object (a pickled array) is refused: nothing is unpickled"
        )
    optional = ("payload_offsets", "payload_bytes")
    arrays = read_npz(p, ("format", "version", "ids", "strengths"))
    if any(n in present for n in optional):
        arrays |= read_npz(p, tuple(n for n in optional if n in present))
    try:
        return check_export(arrays, max_payload_bytes)
    except MemoryInputError as exc:
        raise MemoryFileError(f"{p}: {exc}") from None


def check_export(arrays: dict[str, npt.NDArray[Any]], max_payload_bytes: int) -> ExportData:
    """Check an export's arrays (module docstring); return them as ``ExportData``.

    Raises:
        MemoryInputError: the first bad array, by name, with what is wrong and where.
    """
    fmt, version = arrays["format"], arrays["version"]
    if fmt.shape != () or fmt.dtype.kind != "U" or str(fmt) != FORMAT:
        raise MemoryInputError(f"format: {fmt!r} is not {FORMAT!r}")
    if version.shape != () or version.dtype.kind not in "iu" or int(version) != VERSION:
        raise MemoryInputError(f"version: {version!r}; this client reads version {VERSION}")
    ids, strengths = arrays["ids"], arrays["strengths"]
    _check_1d(ids, "ids", np.dtype(np.uint64))
    _check_1d(strengths, "strengths", np.dtype(np.float32))
    values = validate_values(strengths, "strengths", ids, unit_range=True)
    _check_unique(ids)
    data = ExportData(ids, values)
    if "payload_offsets" in arrays or "payload_bytes" in arrays:
        data.offsets, data.payload_bytes = _check_payloads(arrays, len(ids), max_payload_bytes)
    return data


def _check_1d(a: npt.NDArray[Any], name: str, dtype: np.dtype[Any]) -> None:
    """Raises: MemoryInputError when ``a`` is not 1-D of exactly ``dtype``."""
    if a.dtype != dtype:
        raise MemoryInputError(f"{name}: dtype {a.dtype}, expected {dtype}")
    if a.ndim != 1:
        raise MemoryInputError(f"{name}: shape {a.shape}, expected 1-D")


def _check_unique(ids: npt.NDArray[np.uint64]) -> None:
    """Raises: MemoryInputError naming the first repeated id and two of its positions."""
    order = np.argsort(ids, kind="stable")
    same = np.flatnonzero(ids[order][1:] == ids[order][:-1])
    if len(same):
        a, b = sorted((int(order[same[0]]), int(order[same[0] + 1])))
        raise MemoryInputError(f"ids: id {ids[a]} repeats (ids[{a}] and ids[{b}])")


def _check_payloads(
    arrays: dict[str, npt.NDArray[Any]], n: int, max_payload_bytes: int
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint8]]:
    """Check ``payload_offsets`` [n+1] and ``payload_bytes``; return them.

    Raises:
        MemoryInputError: one missing, a wrong dtype or shape, offsets that do not start at
            0, decrease or end elsewhere than the byte count, or a payload over the limit.
    """
    for name in ("payload_offsets", "payload_bytes"):
        if name not in arrays:
            raise MemoryInputError(
                f"{name}: missing (payload_offsets and payload_bytes go together)"
            )
    offsets, data = arrays["payload_offsets"], arrays["payload_bytes"]
    _check_1d(offsets, "payload_offsets", np.dtype(np.uint64))
    _check_1d(data, "payload_bytes", np.dtype(np.uint8))
    if len(offsets) != n + 1:
        raise MemoryInputError(
            f"payload_offsets: {len(offsets)} entries for {n} ids (want {n + 1})"
        )
    if offsets[0] != 0:
        raise MemoryInputError(f"payload_offsets[0]: {offsets[0]}, expected 0")
    sizes = np.diff(offsets.astype(np.int64))
    bad = np.flatnonzero(sizes < 0)
    if len(bad):
        i = int(bad[0]) + 1
        raise MemoryInputError(f"payload_offsets[{i}]: {offsets[i]} is below the one before")
    if int(offsets[-1]) != len(data):
        raise MemoryInputError(
            f"payload_offsets[{n}]: {offsets[-1]} is not the payload_bytes length {len(data)}"
        )
    big = np.flatnonzero(sizes > max_payload_bytes)
    if len(big):
        i = int(big[0])
        raise MemoryInputError(
            f"payload of ids[{i}]: {sizes[i]} bytes, over the cluster's max_payload_bytes "
            f"{max_payload_bytes}"
        )
    return offsets, data
