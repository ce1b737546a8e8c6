"""Validation of an uploaded data set (``neuroshard data put``) before the coordinator keeps it.

A data set is an ``.npz`` archive whose every member is an ``.npy`` array, read without
pickles (``np.load(allow_pickle=False)``), of one of two kinds:

- ``train``: ``x`` [N, ...] float32 and ``y`` [N] int64, checked by
  ``shared.training.data.load_training_npz`` (what a train job's ``data: {path}`` needs);
- ``memory``: ``ids`` [N] uint64 and ``strengths`` [N] float32 in [0, 1], checked by
  ``shared.memory.files.load_memories`` (what a memory job's ``load`` needs).

Every member's header is read before any array is loaded, so an archive that would
decompress to more than ``max_dataset_bytes`` (a zip bomb) is refused without allocating it.
"""

from __future__ import annotations

import math
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.memory.files import MemoryFileError, load_memories
from shared.training.data import DataError, load_training_npz


class DatasetInvalid(ValueError):
    """The file is not a readable data set of a known kind (INVALID_ARGUMENT).

    The message names the data set and the array.
    """


class DatasetTooLarge(Exception):
    """A data set over ``max_dataset_bytes`` (RESOURCE_EXHAUSTED).

    The message names the cap and the size.
    """


@dataclass(frozen=True)
class ArrayInfo:
    """One array of a data set, from its ``.npy`` header."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the array once loaded."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def array_headers(path: Path, label: str) -> list[ArrayInfo]:
    """Name, dtype and shape of every member of an ``.npz``, from the headers only.

    Args:
        path: the archive.
        label: how messages name the data set (``NAME.npz``), never the coordinator's path.

    Raises:
        DatasetInvalid: not a zip archive, a member that is not an ``.npy`` array, an
            unreadable header, or an object dtype (would need pickle).
    """
    out: list[ArrayInfo] = []
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    raise DatasetInvalid(f"{label}: member {info.filename!r} is not an .npy array")
                with zf.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                    else:
                        shape, _, dtype = np.lib.format.read_array_header_2_0(f)
                name = info.filename[: -len(".npy")]
                if dtype.hasobject:
                    raise DatasetInvalid(
                        f"{label}: array {name!r} holds Python objects (pickles are refused)"
                    )
                out.append(ArrayInfo(name, dtype.name, tuple(int(d) for d in shape)))
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        if isinstance(exc, DatasetInvalid):
            raise
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DatasetInvalid(
            f"{label}: not a readable .npz archive (as np.savez writes): {detail}"
        ) from None
    if not out:
        raise DatasetInvalid(f"{label}: the archive holds no arrays")
    return out


def check_dataset(path: Path, label: str, max_bytes: int) -> tuple[str, list[ArrayInfo]]:
    """Validate a data set file; return its kind (``train`` or ``memory``) and its arrays.

    Args:
        path: the file as received (a temporary name).
        label: how messages name the data set (``NAME.npz``).
        max_bytes: ``max_dataset_bytes``; also caps the arrays' total size once loaded.

    Raises:
        DatasetTooLarge: the arrays would take more than ``max_bytes`` once loaded
            (RESOURCE_EXHAUSTED).
        DatasetInvalid: unreadable, pickled, or neither a training set nor a memory set
            (INVALID_ARGUMENT).
    """
    arrays = array_headers(path, label)
    loaded = sum(a.nbytes for a in arrays)
    if loaded > max_bytes:
        raise DatasetTooLarge(
            f"{label}: its arrays take {loaded} bytes once loaded, over the coordinator's "
            f"max_dataset_bytes {max_bytes} bytes"
        )
    names = {a.name for a in arrays}
    try:
        if names & {"x", "y"}:
            load_training_npz(path)
            return "train", arrays
        if names & {"ids", "strengths"}:
            load_memories(path)
            return "memory", arrays
    except (DataError, MemoryFileError) as exc:
        raise DatasetInvalid(str(exc).replace(str(path), label)) from None
    raise DatasetInvalid(
        f"{label}: expected arrays x and y (a training set) or ids and strengths (a memory "
        f"set), found {', '.join(sorted(names))}"
    )
