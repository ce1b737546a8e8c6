"""A directory of ``.npy`` files streamed as an uncompressed ``.npz``, built as it is sent.

``neuroshard data put DIR`` uploads a directory (``x.npy``, ``y.npy``, ``x_test.npy``,
``y_test.npy``) as one ``.npz`` whose members are stored, not compressed, so the coordinator
can memory-map them. The archive is never held whole: ``zipfile`` writes it into a sink that
is drained after every chunk of a file (the archive is written for a stream that cannot
seek: each member's CRC and sizes follow its data, in a data descriptor). Its size, which the
upload declares first, is that of a dry run writing zeros of the same lengths (a stored
member's size does not depend on its bytes).
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, cast

ARRAY_FILES = ("x.npy", "y.npy", "x_test.npy", "y_test.npy")
READ_BYTES = 1 << 20


class _Sink:
    """A write-only, unseekable file object whose bytes are taken with ``drain``."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self.total = 0

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        self.total += len(data)
        return len(data)

    def flush(self) -> None:
        """Nothing buffered beyond ``drain``."""

    def drain(self) -> bytes:
        out = b"".join(self._parts)
        self._parts = []
        return out


def array_files(directory: Path) -> list[Path]:
    """The array files of a data set directory that exist, in ``ARRAY_FILES`` order."""
    return [directory / n for n in ARRAY_FILES if (directory / n).is_file()]


def _chunks(files: list[Path], dry: bool) -> Iterator[bytes]:
    sink = _Sink()
    with zipfile.ZipFile(cast(IO[bytes], sink), "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for file in files:
            size = file.stat().st_size
            info = zipfile.ZipInfo(file.name)  # fixed 1980 timestamp: the same bytes each run
            info.file_size = size
            with zf.open(info, "w", force_zip64=size > 0x7FFF_FFFF) as member:
                if dry:
                    for at in range(0, size, READ_BYTES):
                        member.write(bytes(min(READ_BYTES, size - at)))
                        yield sink.drain()
                else:
                    with file.open("rb") as f:
                        while data := f.read(READ_BYTES):
                            member.write(data)
                            yield sink.drain()
            yield sink.drain()
    yield sink.drain()


def npz_size(files: list[Path]) -> int:
    """Bytes of the archive ``npz_chunks`` streams for ``files`` (a dry run, nothing read)."""
    return sum(len(c) for c in _chunks(files, dry=True))


def npz_chunks(files: list[Path]) -> Iterator[bytes]:
    """The archive's bytes in order, about ``READ_BYTES`` at a time (reads each file once).

    Args:
        files: the ``.npy`` files, stored as members of their names.

    Raises:
        OSError: a file cannot be read.
    """
    for chunk in _chunks(files, dry=False):
        if chunk:
            yield chunk
