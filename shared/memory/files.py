"""Memory-store input files, read and validated whole before anything is sent.

Used by the ``neuroshard memory`` commands and by the coordinator's ``memory`` job:

- memories ``.npz``: arrays ``ids`` [N] uint64 (any non-negative integer type) and
  ``strengths`` [N] float32 in [0, 1];
- reinforcements ``.npz``: arrays ``ids`` [K] and ``boosts`` [K] (finite, >= 0);
- access traces ``.npy``: ids [I, B] (one row per iteration) or [B] (reused every iteration).

Every error is one line naming the file and the array (``MemoryFileError``); the CLI exits 2
with it and the job fails with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from shared.memory.validation import MemoryInputError, as_ids, validate_values
from shared.npz import UNREADABLE, NpyHeader, NpyHeaderError, npz_members, read_npy_header


class MemoryFileError(ValueError):
    """A memory input file is missing or malformed; the message names the file and array.

    The CLI exits 2 with it; a memory job fails with it.
    """


_MAGIC = (b"PK", b"\x93NUMPY")  # a zip archive (.npz), the NumPy array format (.npy)
_WRITER = {".npz": "np.savez", ".npy": "np.save"}


@contextmanager
def _opened(path: Path, suffix: str) -> Iterator[npt.NDArray[Any] | np.lib.npyio.NpzFile]:
    """``np.load`` of ``path`` (an ndarray, or an open NpzFile) with the file open meanwhile.

    The file is opened here, not by NumPy, so that it is closed whatever happens: NumPy leaks
    the file it opened itself when a corrupt archive fails to parse.
    """
    if not path.is_file():
        raise MemoryFileError(f"{path}: no such file")
    with path.open("rb") as f:
        head = f.read(6)
        if head.startswith(_MAGIC[1]):
            f.seek(0)
            _check_npy_size(path, f, path.stat().st_size)
        if not head.startswith(_MAGIC):
            raise MemoryFileError(f"{path}: not a {suffix} file (as {_WRITER[suffix]} writes)")
        f.seek(0)
        try:
            data = np.load(f, allow_pickle=False)
        except UNREADABLE as exc:
            raise MemoryFileError(
                f"{path}: not a readable {suffix} file ({_detail(exc)})"
            ) from None
        try:
            yield data
        finally:
            if isinstance(data, np.lib.npyio.NpzFile):
                data.close()


def _detail(exc: BaseException) -> str:
    """The first line of an exception's message (at most 200 characters), or its type."""
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


def _check_npy_size(path: Path, f: IO[bytes], size: int) -> None:
    """Refuse a lone .npy whose header claims more data than the ``size`` bytes it holds.

    ``f`` is at the start of the .npy.

    Raises:
        MemoryFileError: an unreadable header, or a claimed size beyond the data.
    """
    try:
        header = read_npy_header(f)
    except NpyHeaderError as exc:
        raise MemoryFileError(f"{path}: unreadable .npy header ({_detail(exc)})") from None
    _check_claim(path, "", header, size)


def _check_claim(path: Path, what: str, header: NpyHeader, size: int) -> None:
    """Refuse an .npy whose header claims more data than the ``size`` bytes it holds.

    Checked before NumPy allocates the array the header asks for, so a 100-byte file cannot
    make the process allocate terabytes.

    Raises:
        MemoryFileError: a claimed size beyond the data.
    """
    have = size - header.header_bytes
    if header.data_bytes > have:
        raise MemoryFileError(
            f"{path}: {what}header claims shape {header.shape} ({header.data_bytes} bytes) "
            f"but {have} bytes follow"
        )


def read_npz(path: str | Path, names: tuple[str, ...]) -> dict[str, npt.NDArray[Any]]:
    """Read the named arrays of an ``.npz`` file (other arrays are ignored).

    Nothing is unpickled (``allow_pickle=False``), and each array's header is checked
    against its member's size before it is loaded.

    Args:
        path: the ``.npz`` file.
        names: the arrays to read.

    Returns:
        ``{name: array}`` as stored (dtype and shape unchecked).

    Raises:
        MemoryFileError: missing or unreadable file, or an array is absent or not loadable.
    """
    p = Path(path)
    with _opened(p, ".npz") as data:
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise MemoryFileError(f"{p}: expected an .npz archive of arrays, got a single array")
        archive = data.zip
        assert archive is not None  # an open NpzFile holds its archive
        out = {}
        for name in names:
            if name not in data.files:
                has = ", ".join(data.files) or "no arrays"
                raise MemoryFileError(f"{p}: no array {name!r} (has: {has})")
            what = f"array {name!r}: "
            try:
                for member in npz_members(archive, (name,)):
                    _check_claim(p, what, member, member.stored_bytes)
                out[name] = data[name]
            except NpyHeaderError as exc:
                raise MemoryFileError(
                    f"{p}: {what}unreadable .npy header ({_detail(exc)})"
                ) from None
            except MemoryFileError:
                raise  # _check_claim's, complete already (it is a ValueError too)
            except UNREADABLE as exc:  # e.g. an object array, refused without pickle
                raise MemoryFileError(f"{p}: array {name!r}: {_detail(exc)}") from None
    return out


def load_memories(path: str | Path) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]:
    """Read memories to upsert: ``(ids [N] uint64, strengths [N] float32 in [0, 1])``.

    Raises:
        MemoryFileError: as :func:`read_npz`, or a bad value, naming the array and index.
    """
    arrays = read_npz(path, ("ids", "strengths"))
    try:
        ids = as_ids(arrays["ids"])
        return ids, validate_values(arrays["strengths"], "strengths", ids, unit_range=True)
    except MemoryInputError as exc:
        raise MemoryFileError(f"{path}: {exc}") from None


def load_reinforcements(
    path: str | Path,
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]:
    """Read a reinforcement batch: ``(ids [K] uint64, boosts [K] float32 >= 0)``.

    Raises:
        MemoryFileError: as :func:`read_npz`, or a bad value, naming the array and index.
    """
    arrays = read_npz(path, ("ids", "boosts"))
    try:
        ids = as_ids(arrays["ids"])
        return ids, validate_values(arrays["boosts"], "boosts", ids)
    except MemoryInputError as exc:
        raise MemoryFileError(f"{path}: {exc}") from None


def load_trace(path: str | Path, iterations: int) -> npt.NDArray[np.uint64]:
    """Read an access trace of ids: [iterations, B] (one row per iteration) or [B] (reused).

    Args:
        path: the ``.npy`` file.
        iterations: I, the memory job's iterations; a 2-D trace needs at least I rows.

    Returns:
        [I, B] uint64 with I = iterations, or [1, B] for a 1-D trace; B >= 1.

    Raises:
        MemoryFileError: unreadable file, an archive instead of one array, a non-integer or
            negative id, a shape other than 1-D or 2-D, no ids, or fewer rows than iterations.
    """
    p = Path(path)
    with _opened(p, ".npy") as trace:
        if not isinstance(trace, np.ndarray):
            raise MemoryFileError(f"{p}: expected one .npy array of ids, got an .npz archive")
    if trace.ndim not in (1, 2):
        raise MemoryFileError(
            f"{p}: trace must be 1-D [batch] or 2-D [iterations, batch], got shape {trace.shape}"
        )
    if trace.size == 0:
        raise MemoryFileError(f"{p}: trace has no ids (shape {trace.shape})")
    if trace.ndim == 2 and trace.shape[0] < iterations:
        raise MemoryFileError(
            f"{p}: trace has {trace.shape[0]} rows but the job runs {iterations} iterations"
        )
    rows = trace.reshape(1, -1) if trace.ndim == 1 else trace[:iterations]
    try:
        ids = as_ids(rows.reshape(-1), "trace")
    except MemoryInputError as exc:
        msg = _row_col(str(exc), rows.shape[1]) if trace.ndim == 2 else str(exc)
        raise MemoryFileError(f"{p}: {msg}") from None
    return ids.reshape(rows.shape)


def _row_col(message: str, width: int) -> str:
    """Turn ``trace[i]: ...`` of the flattened trace into ``trace[row, col]: ...``."""
    head, sep, rest = message.partition("]: ")
    if not sep or not head.startswith("trace["):
        return message
    flat = int(head.removeprefix("trace["))
    return f"trace[{flat // width}, {flat % width}]: {rest}"
