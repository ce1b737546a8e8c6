"""Headers of ``.npy`` arrays, alone or as members of an ``.npz`` archive, read without data.

The one reader of ``.npy`` headers: the coordinator's admission (shapes and dtypes before a
job is queued), the training data loader and the memory input files (a header claiming more
bytes than its member stores is refused before NumPy allocates the array it asks for).
Imports only NumPy and the standard library, so a user's client can use it.

Format: https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html
"""

from __future__ import annotations

import math
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

_Reader = Callable[..., tuple[tuple[int, ...], bool, "np.dtype[Any]"]]

# Version 3.0 has the layout of 2.0 (a 4-byte header length) with a UTF-8 header instead of
# latin-1; NumPy writes it only for structured dtypes with non-latin-1 field names. Read as
# 2.0, such names come out garbled but shapes and item sizes are exact.
_HEADER_READERS: dict[tuple[int, int], _Reader] = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
    (3, 0): np.lib.format.read_array_header_2_0,
}

# What reading a corrupt header raises (NumPy: ValueError for a bad magic or header text,
# EOFError/struct.error for a truncated one).
_HEADER_ERRORS = (ValueError, EOFError, struct.error)


class NpyHeaderError(ValueError):
    """An ``.npy`` header cannot be read; the message is the underlying error's.

    Callers report it as a malformed input (INVALID_ARGUMENT).
    """


# What reading a corrupt .npy/.npz raises: zipfile's BadZipFile, NotImplementedError for a
# compression method zipfile lacks, zlib.error for a corrupt deflate stream, struct.error for
# a truncated header, and NumPy's OSError/ValueError/EOFError.
UNREADABLE: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    EOFError,
    zipfile.BadZipFile,
    zlib.error,
    NotImplementedError,
    struct.error,
)


@dataclass(frozen=True)
class NpyHeader:
    """What an ``.npy`` header declares, and where its data starts."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    header_bytes: int  # magic, version and header: the offset of the data, bytes

    @property
    def data_bytes(self) -> int:
        """Bytes of data the header claims: the product of the shape times the item size."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class NpzMember(NpyHeader):
    """The header of one ``.npy`` member of an ``.npz`` archive."""

    name: str  # the array's name (the member's file name without ``.npy``)
    stored_bytes: int  # the member's uncompressed size, header included, bytes
    filename: str  # the member's file name in the archive (what ``ZipFile.open`` takes)


def read_npy_header(f: IO[bytes]) -> NpyHeader:
    """Read the header of the ``.npy`` starting at ``f``'s position, leaving ``f`` at its data.

    Args:
        f: a binary stream at the first byte of an ``.npy`` (a file or an archive member).

    Raises:
        NpyHeaderError: a bad magic string, a version other than 1.0, 2.0 and 3.0, or a
            truncated or malformed header.
    """
    start = f.tell()
    try:
        version = np.lib.format.read_magic(f)
        if version not in _HEADER_READERS:
            raise ValueError(f".npy format version {version} is not supported")
        shape, _, dtype = _HEADER_READERS[version](f)
    except _HEADER_ERRORS as exc:
        raise NpyHeaderError(str(exc)) from exc
    return NpyHeader(tuple(int(d) for d in shape), np.dtype(dtype), f.tell() - start)


def npz_members(zf: zipfile.ZipFile, names: Iterable[str] | None = None) -> Iterator[NpzMember]:
    """Yield the header of each ``.npy`` member of an open ``.npz`` archive.

    Only the headers are read (decompressing as much of each member as they take).

    Args:
        zf: the open archive.
        names: the arrays wanted, in this order; each is the member of that exact name if
            there is one (as ``np.load`` looks it up), else ``NAME.npy``; absent ones are
            skipped. None: every member whose name ends in ``.npy``, in archive order.

    Raises:
        NpyHeaderError: a member's header cannot be read.
        zipfile.BadZipFile, NotImplementedError, zlib.error, OSError: a member cannot be
            opened or decompressed.
    """
    if names is None:
        wanted = [(i.filename[: -len(".npy")], i) for i in zf.infolist()]
        wanted = [(n, i) for n, i in wanted if i.filename.endswith(".npy")]
    else:
        present = set(zf.namelist())
        keys = [(n, n if n in present else f"{n}.npy") for n in names]
        wanted = [(n, zf.getinfo(k)) for n, k in keys if k in present]
    for name, info in wanted:
        with zf.open(info) as f:
            h = read_npy_header(f)
        yield NpzMember(h.shape, h.dtype, h.header_bytes, name, info.file_size, info.filename)


__all__ = [
    "NpyHeader",
    "NpyHeaderError",
    "NpzMember",
    "npz_members",
    "read_npy_header",
]
