"""Validation of an uploaded data set (``neuroshard data put``) before the coordinator keeps it.

A data set is an ``.npz`` archive whose every member is an ``.npy`` array, of one of two kinds:

- ``train``: ``x`` [N, ...] and ``y`` of any numeric dtype (``shared.training.tasks``), finite
  floats, integer labels >= 0 with at least two classes, or integer tokens ``x`` [N, T] with or
  without ``y``: what a train job's ``data: {path}`` takes (``shared.training.file_sets``);
- ``memory``: ``ids`` [N] non-negative integers and ``strengths`` [N] numbers in [0, 1]: what a
  memory job's ``load`` needs (``shared.memory.files``).

Nothing is loaded whole: every member's header is read first (so an archive that would
decompress to more than ``max_dataset_bytes`` is refused before anything is inflated), then
the arrays a kind needs are streamed through ``zipfile`` in pieces of ``CHUNK_BYTES`` and
checked piece by piece, so validating a compressed archive costs a few chunks of memory
whatever it inflates to. A training set's rules and messages are the loader's own
(``shared.training.data``: ``check_training_names``, ``check_training_layout``;
``shared.training.file_sets.check_block``), applied to the headers and then to whole rows. No
pickle is ever read: an object dtype is refused from its header. A corrupt archive (bad zip
structure, a corrupt deflate stream, a CRC mismatch, a truncated member, an unsupported
compression method) is ``DatasetInvalid`` (INVALID_ARGUMENT).
"""

from __future__ import annotations

import math
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from shared.memory.validation import MemoryInputError, as_ids, validate_values
from shared.npz import UNREADABLE, NpzMember, npz_members, read_npy_header
from shared.training.data import DataError, check_training_layout, check_training_names
from shared.training.file_sets import Extremes, check_block, output_width_of

CHUNK_BYTES = 1 << 20  # bytes of one array inflated and checked at a time


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


def check_dataset(path: Path, label: str, max_bytes: int) -> tuple[str, list[ArrayInfo]]:
    """Validate a data set file; return its kind (``train`` or ``memory``) and its arrays.

    Memory used is a few ``CHUNK_BYTES`` whatever the archive inflates to.

    Args:
        path: the file as received (a temporary name).
        label: how messages name the data set (``NAME.npz``), never the coordinator's path.
        max_bytes: ``max_dataset_bytes``; also caps the arrays' total size once loaded.

    Raises:
        DatasetTooLarge: the arrays would take more than ``max_bytes`` once loaded
            (RESOURCE_EXHAUSTED).
        DatasetInvalid: unreadable or corrupt, pickled, or neither a training set nor a
            memory set (INVALID_ARGUMENT).
    """
    try:
        with zipfile.ZipFile(path) as zf:
            members = _headers(zf, label)
            arrays = [ArrayInfo(n, m.dtype.name, m.shape) for n, m in members.items()]
            loaded = sum(a.nbytes for a in arrays)
            if loaded > max_bytes:
                raise DatasetTooLarge(
                    f"{label}: its arrays take {loaded} bytes once loaded, over the "
                    f"coordinator's max_dataset_bytes {max_bytes} bytes"
                )
            if members.keys() & {"x", "y"}:
                _check_training(zf, label, members)
                return "train", arrays
            if members.keys() & {"ids", "strengths"}:
                _check_memories(zf, label, members)
                return "memory", arrays
    except (DatasetInvalid, DatasetTooLarge):
        raise
    except UNREADABLE as exc:  # zlib.error, BadZipFile (CRC), EOFError, OSError, ...
        detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise DatasetInvalid(
            f"{label}: not a readable .npz archive (as np.savez writes): {detail}"
        ) from None
    raise DatasetInvalid(
        f"{label}: expected arrays x and y (a training set) or ids and strengths (a memory "
        f"set), found {', '.join(sorted(members))}"
    )


def _headers(zf: zipfile.ZipFile, label: str) -> dict[str, NpzMember]:
    """Every member's ``.npy`` header, by array name (headers only: nothing inflated past them).

    Headers are read by ``shared.npz.npz_members``; a member that is not an ``.npy`` is
    refused before any is read.

    Raises:
        DatasetInvalid: a member that is not an ``.npy`` array, an object dtype (would need
            pickle), a member holding more or less data than its header claims, no arrays
            at all.
        NpyHeaderError and the other ``UNREADABLE`` errors: a corrupt member (the caller
            reports them).
    """
    for filename in zf.namelist():
        if not filename.endswith(".npy"):
            raise DatasetInvalid(f"{label}: member {filename!r} is not an .npy array")
    out: dict[str, NpzMember] = {}
    for m in npz_members(zf):
        if m.dtype.hasobject:
            raise DatasetInvalid(
                f"{label}: array {m.name!r} holds Python objects (pickles are refused)"
            )
        have = m.stored_bytes - m.header_bytes
        if have != m.data_bytes:  # np.save writes exactly the header and the data
            raise DatasetInvalid(
                f"{label}: array {m.name!r} claims shape {m.shape} ({m.data_bytes} "
                f"bytes) but its member holds {have} bytes of data"
            )
        out[m.name] = m
    if not out:
        raise DatasetInvalid(f"{label}: the archive holds no arrays")
    return out


def _chunks(zf: zipfile.ZipFile, label: str, m: NpzMember) -> Iterator[npt.NDArray[Any]]:
    """Yield the array's items in storage order, at most ``CHUNK_BYTES`` of them at a time.

    Each piece is a 1-D view of bytes just inflated (``np.frombuffer``): checks on it cost
    about its size. The member holds exactly the header and the data (``_headers``), so
    reading it to its end inflates no more than the array, and makes ``zipfile`` check the
    member's CRC.

    Raises:
        DatasetInvalid: the member's stream ends before the data its header claims.
    """
    itemsize = m.dtype.itemsize
    left = m.data_bytes
    step = max(itemsize, CHUNK_BYTES // max(itemsize, 1) * itemsize)
    with zf.open(m.filename) as f:
        read_npy_header(f)  # leaves f at the data
        while left > 0:
            want = min(step, left)
            data = f.read(want)
            if len(data) != want:
                raise DatasetInvalid(
                    f"{label}: array {m.name!r} claims shape {m.shape} "
                    f"({m.data_bytes} bytes) but the archive holds fewer"
                )
            left -= want
            yield np.frombuffer(data, m.dtype)
        f.read(1)  # at the end (b""): zipfile checks the member's CRC there


def _rows(zf: zipfile.ZipFile, label: str, m: NpzMember) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (first row, [b, *S] rows) of an array, whole rows of about ``CHUNK_BYTES``."""
    row_items = math.prod(m.shape[1:])
    at, carry = 0, np.empty(0, m.dtype)
    for piece in _chunks(zf, label, m):
        items = np.concatenate([carry, piece]) if len(carry) else piece
        whole = len(items) // row_items * row_items if row_items else 0
        if whole:
            rows = items[:whole].reshape(-1, *m.shape[1:])
            yield at, rows
            at += len(rows)
        carry = items[whole:]


def _check_training(zf: zipfile.ZipFile, label: str, members: dict[str, NpzMember]) -> None:
    """Refuse what is no task's training set: arrays, dtypes, shapes, NaN/inf, labels.

    The rules and messages are the loader's (``shared.training.file_sets.check_block``),
    applied to the headers and then to the arrays whole rows at a time. The task is not
    known yet: the arrays pick the one the set most likely is (``layout_task``); the job's
    own rules (token ids against its vocab_size, ...) are checked when a job opens it.

    Raises:
        DatasetInvalid: naming the array and what is wrong with it (its first bad row).
    """
    try:
        names = set(members) & {"x", "y"}  # the arrays a job reads (file_sets)
        check_training_names(names, members["x"].dtype if "x" in members else None)
        x, y = members["x"], members.get("y")
        task = check_training_layout(
            x.dtype, x.shape, None if y is None else y.dtype, None if y is None else y.shape
        )
        high = -1
        for m in (x, y):
            if m is None:
                continue
            ext = Extremes()
            for at, rows in _rows(zf, label, m):
                check_block(m.name, rows, at, task, None, ext)
            if ext.high is not None and (m.name == "y" or task == "language_model"):
                high = max(high, ext.high)
        if task == "classification":
            output_width_of({"y": y}, task, None, high)
    except DataError as exc:
        raise DatasetInvalid(f"{label}: {exc}") from None


_INDEXED = re.compile(r"^(\w+)\[(\d+)\]")


def _check_memories(zf: zipfile.ZipFile, label: str, members: dict[str, NpzMember]) -> None:
    """Refuse what is not a memory set: ids non-negative integers, strengths in [0, 1].

    The checks are ``shared.memory.validation``'s, applied piece by piece; an error names the
    index in the whole array.

    Raises:
        DatasetInvalid: naming the array, and the first bad index.
    """
    for name in ("ids", "strengths"):
        if name not in members:
            has = ", ".join(members) or "no arrays"
            raise DatasetInvalid(f"{label}: no array {name!r} (has: {has})")
    ids, strengths = members["ids"], members["strengths"]
    for name, h in (("ids", ids), ("strengths", strengths)):
        if len(h.shape) != 1:
            raise DatasetInvalid(f"{label}: {name}: expected a 1-D array, got shape {h.shape}")
    if ids.shape != strengths.shape:
        raise DatasetInvalid(
            f"{label}: ids and strengths differ in length ({ids.shape[0]} != {strengths.shape[0]})"
        )
    offset = 0
    try:
        for piece in _chunks(zf, label, ids):
            as_ids(piece)
            offset += len(piece)
        offset = 0
        for piece in _chunks(zf, label, strengths):
            validate_values(piece, "strengths", piece, unit_range=True)
            offset += len(piece)
    except MemoryInputError as exc:
        at = offset
        message = _INDEXED.sub(lambda m: f"{m[1]}[{int(m[2]) + at}]", str(exc))
        raise DatasetInvalid(f"{label}: {message}") from None
