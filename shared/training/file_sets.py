"""A file data set opened for one train job: its split, checks and batches, never read whole.

The arrays stay memory-mapped (``shared.training.data_files``); what a job holds in memory
is the split's row indices (8 bytes a row) and, for a classification split, the labels it
is stratified by. Everything else is read block by block:

- ``open_file_set`` checks the layout from the headers, then every value the task's loss
  would take (finite inputs, labels, token ids, finite regression targets) in blocks of
  ``BLOCK_BYTES``, naming the array and its first bad row;
- the training rows are those of ``x``/``y`` in the order of today's split
  (``shared.training.data``: ``ceil(N * test_fraction)`` rows held out, stratified by
  label when sklearn can) unless ``x_test``/``y_test`` are given: then every row of ``x`` is
  a training row, in file order, and the test rows are ``x_test``/``y_test``;
- ``native_blocks`` yields training rows as stored (what ``FetchShard`` sends),
  ``train_batch`` and ``test_batches`` in the task's dtypes (``tasks.task_arrays``).

Shapes: N rows of ``x``, N_train training rows, T test rows, ``*S`` one row's shape.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from sklearn.model_selection import train_test_split

from shared.training.data_files import MappedArray, open_arrays, row_blocks
from shared.training.tasks import (
    DataError,
    check_layout,
    check_names,
    first_bad_row,
    task_arrays,
)

BLOCK_BYTES = 8 << 20  # bytes of one array read at a time by checks and batches


@dataclass
class FileSet:
    """A file data set opened for a task.

    Attributes:
        task: the job's task.
        arrays: the mapped arrays by name (``x``, maybe ``y``, ``x_test``, ``y_test``).
        train_rows: [N_train] int64 rows of ``x``/``y`` in training order.
        test_rows: [T] int64 rows of ``x``/``y`` held out; None when ``x_test`` is given.
        input_shape: one sample's model input (language_model: ``(T',)``).
        num_classes: the model's output width (classes, regression targets, vocabulary).
        data_key: names the training rows' content: a sha256 of the data set's content
            hash and ``train_rows``; rows [a, b) of two sets of the same key are the same.
    """

    task: str
    arrays: dict[str, MappedArray]
    train_rows: npt.NDArray[np.int64]
    test_rows: npt.NDArray[np.int64] | None
    input_shape: tuple[int, ...]
    num_classes: int
    data_key: str = ""

    @property
    def n_train(self) -> int:
        """N_train, the training rows."""
        return len(self.train_rows)

    @property
    def streamed(self) -> tuple[str, ...]:
        """The arrays a training row is made of (``x``, and ``y`` when the set has one)."""
        return ("x", "y") if "y" in self.arrays else ("x",)

    def set_content_hash(self, digest: str) -> None:
        """Derive ``data_key`` from the data set's content hash (``data_files.content_hash``)."""
        h = hashlib.sha256(digest.encode())
        h.update(np.ascontiguousarray(self.train_rows, "<i8").tobytes())
        self.data_key = h.hexdigest()[:40]

    def native_blocks(
        self, start: int, stop: int, block_bytes: int = BLOCK_BYTES
    ) -> Iterator[tuple[str, int, npt.NDArray[Any]]]:
        """Training rows [start, stop) as stored, array by array, a block at a time.

        Yields:
            (array name, first row of the block relative to ``start``, [b, *S] rows).
        """
        for name in self.streamed:
            arr = self.arrays[name]
            row_bytes = math.prod(arr.shape[1:]) * arr.dtype.itemsize
            for a, b in row_blocks(stop - start, row_bytes, block_bytes):
                yield name, a, arr.take(self.train_rows[start + a : start + b])

    def train_batch(self, rows: npt.NDArray[np.int64]) -> tuple[np.ndarray, np.ndarray]:
        """Training rows (indices into the split) in the task's dtypes."""
        file_rows = self.train_rows[rows]
        y = self.arrays["y"].take(file_rows) if "y" in self.arrays else None
        return task_arrays(self.task, self.arrays["x"].take(file_rows), y)

    @property
    def n_test(self) -> int:
        """T, the test rows."""
        return len(self.test_rows) if self.test_rows is not None else len(self.arrays["x_test"])

    def test_batches(self, batch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The test rows in the task's dtypes, ``batch`` rows at a time."""
        x_name, y_name = ("x", "y") if self.test_rows is not None else ("x_test", "y_test")
        for a in range(0, self.n_test, batch):
            b = min(self.n_test, a + batch)
            rows = (
                self.test_rows[a:b]
                if self.test_rows is not None
                else np.arange(a, b, dtype=np.int64)
            )
            y = self.arrays[y_name].take(rows) if y_name in self.arrays else None
            yield task_arrays(self.task, self.arrays[x_name].take(rows), y)


def _check_test_arrays(arrays: dict[str, MappedArray], task: str) -> None:
    """Refuse ``x_test``/``y_test`` that do not come together or do not match ``x``/``y``."""
    if "y_test" in arrays and "x_test" not in arrays:
        raise DataError("array 'y_test' is given without 'x_test'")
    if "x_test" not in arrays:
        return
    if "y" in arrays and "y_test" not in arrays:
        raise DataError("missing array 'y_test' (x_test is given and the set has y)")
    x, xt = arrays["x"], arrays["x_test"]
    yt = arrays.get("y_test")
    check_layout(
        task,
        xt.dtype,
        xt.shape,
        None if yt is None else yt.dtype,
        None if yt is None else yt.shape,
        "x_test",
        "y_test",
    )
    if xt.shape[1:] != x.shape[1:]:
        raise DataError(
            f"array 'x_test' rows are {list(xt.shape[1:])}, 'x' rows {list(x.shape[1:])}"
        )
    y_rows = arrays["y"].shape[1:] if "y" in arrays else ()
    if yt is not None and yt.shape[1:] != y_rows:
        raise DataError(f"array 'y_test' rows are {list(yt.shape[1:])}, 'y' rows {list(y_rows)}")


def check_file_layout(arrays: dict[str, MappedArray], task: str) -> None:
    """Refuse arrays whose names, dtypes or shapes are not the task's data (headers only).

    Raises:
        DataError: naming the array, what the task needs and what was found.
    """
    check_names(set(arrays) & {"x", "y"}, task)
    x, y = arrays["x"], arrays.get("y")
    check_layout(
        task, x.dtype, x.shape, None if y is None else y.dtype, None if y is None else y.shape
    )
    _check_test_arrays(arrays, task)


@dataclass
class Extremes:
    """The smallest and largest integer values seen so far (None: none yet)."""

    low: int | None = None
    high: int | None = None

    def add(self, piece: np.ndarray) -> None:
        """Take a block's values into account."""
        if piece.size:
            lo, hi = int(piece.min()), int(piece.max())
            self.low = lo if self.low is None else min(self.low, lo)
            self.high = hi if self.high is None else max(self.high, hi)


def check_block(
    name: str,
    piece: np.ndarray,
    offset: int,
    task: str,
    vocab_size: int | None,
    extremes: Extremes,
) -> None:
    """Check one block of an array's rows as the task would take them.

    Float values must stay finite once converted to float32 (classification, regression);
    labels and token ids must be >= 0 (and token ids < vocab_size); the extremes of integer
    values are gathered for the output width.

    Args:
        name: the array (``x``, ``y``, ``x_test``, ``y_test``).
        piece: [b, *S] rows ``offset`` .. ``offset + b`` of it, as stored.
        offset: the block's first row in the array.
        task: the job's task.
        vocab_size: the job's ``vocab_size``, or None.
        extremes: updated with the block's integer values.

    Raises:
        DataError: naming the array and its first bad row.
    """
    role = "inputs" if name in ("x", "x_test") else "targets"
    if np.issubdtype(piece.dtype, np.floating) and task != "language_model":
        # finite once converted: a float64 beyond float32's range becomes inf
        with np.errstate(over="ignore"):
            as32 = piece.astype(np.float32).reshape(len(piece), -1)
        ok = np.isfinite(as32).all(axis=1)
        if not ok.all():
            raise DataError(
                f"array {name!r} row {offset + first_bad_row(~ok)} is NaN or infinite (task {task})"
            )
    if np.issubdtype(piece.dtype, np.integer) and (role == "targets" or task == "language_model"):
        as64 = piece.astype(np.int64).reshape(len(piece), -1)
        _check_ints(name, as64, offset, task, role, vocab_size)
        extremes.add(as64)


def _scan(arr: MappedArray, task: str, vocab_size: int | None) -> Extremes:
    """Check one array's values block by block (``check_block``)."""
    row_bytes = math.prod(arr.shape[1:]) * arr.dtype.itemsize
    ext = Extremes()
    for a, b in row_blocks(len(arr), row_bytes, BLOCK_BYTES):
        check_block(arr.name, arr.rows(a, b), a, task, vocab_size, ext)
    return ext


def _check_ints(
    name: str, piece: np.ndarray, offset: int, task: str, role: str, vocab_size: int | None
) -> None:
    """Refuse negative labels or token ids, or token ids >= vocab_size, naming the row."""
    if task == "regression" or (task == "classification" and role == "inputs"):
        return
    bad = (piece < 0).any(axis=1)
    if task == "language_model" and vocab_size is not None:
        bad |= (piece >= vocab_size).any(axis=1)
    if bad.any():
        row = first_bad_row(bad)
        if task == "language_model":
            limit = f"[0, vocab_size {vocab_size})" if vocab_size is not None else ">= 0"
            raise DataError(
                f"array {name!r} row {offset + row} has a token id outside {limit} "
                f"(min {int(piece[row].min())}, max {int(piece[row].max())})"
            )
        raise DataError(
            f"array {name!r} row {offset + row} has a label out of range "
            f"({int(piece[row].min())} < 0)"
        )


def check_values(
    arrays: dict[str, MappedArray],
    task: str,
    vocab_size: int | None,
    targets_only: bool = False,
) -> int:
    """Check the values the task takes, block by block; return the model's output width.

    Args:
        arrays: the data set's arrays (layout already checked: ``check_file_layout``).
        task: the job's task.
        vocab_size: the job's ``vocab_size`` (language_model), or None.
        targets_only: check only what the width depends on (``y``, ``y_test``, and token
            inputs), as admission does; the inputs' finiteness is checked when the job opens
            the set.

    Raises:
        DataError: naming the array and its first bad row.
    """
    high = -1
    for name, arr in arrays.items():
        if targets_only and name in ("x", "x_test") and task != "language_model":
            continue
        ext = _scan(arr, task, vocab_size)
        if ext.high is not None and (name in ("y", "y_test") or task == "language_model"):
            high = max(high, ext.high)
    return output_width_of(arrays, task, vocab_size, high)


def output_width_of(arrays: dict[str, Any], task: str, vocab_size: int | None, high: int) -> int:
    """The model's output width from the largest label or token id seen (``high``).

    Raises:
        DataError: fewer than two classes (classification).
    """
    if task == "regression":
        y = arrays["y"]
        return 1 if len(y.shape) == 1 else int(y.shape[1])
    if task == "language_model":
        return vocab_size if vocab_size is not None else high + 1
    if high < 1:
        raise DataError("array 'y' needs at least 2 classes (labels 0..C-1)")
    return high + 1


def split_rows(
    n: int,
    labels: npt.NDArray[np.int64] | None,
    num_classes: int,
    seed: int,
    test_fraction: float,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Row indices of the training and test split: ``ceil(n * test_fraction)`` held out.

    The split of ``shared.training.data``'s in-memory sets, on row indices: stratified by
    ``labels`` when every present class has two rows and both sides can hold them all
    (sklearn's ``train_test_split``, shuffled by ``seed``).

    Args:
        n: rows N.
        labels: [N] int64 labels to stratify by (classification), or None.
        num_classes: C.
        seed: seeds the shuffle.
        test_fraction: share held out, in (0, 1).

    Returns:
        train [N - T] and test [T] int64 row indices, in sklearn's shuffled order.

    Raises:
        DataError: too few rows to leave at least one on each side.
    """
    n_test = math.ceil(n * test_fraction)
    if n_test < 1 or n - n_test < 1:
        raise DataError(f"y: {n} samples are too few to hold out test_fraction={test_fraction}")
    can_stratify = False
    if labels is not None:
        counts = np.bincount(labels, minlength=num_classes)
        present = int((counts > 0).sum())
        can_stratify = counts[counts > 0].min() >= 2 and min(n_test, n - n_test) >= present
    train, test = train_test_split(
        np.arange(n, dtype=np.int64),
        test_size=n_test,
        random_state=seed,
        stratify=labels if can_stratify else None,
    )
    return np.asarray(train, np.int64), np.asarray(test, np.int64)


def open_file_set(
    path: Path,
    task: str,
    vocab_size: int | None,
    seed: int,
    test_fraction: float,
    max_compressed_bytes: int | None = None,
) -> FileSet:
    """Open a file data set for a task: layout, values, split; nothing read whole.

    Args:
        path: an ``.npz`` or a directory of ``.npy`` files (``data_files.open_arrays``).
        task: the job's ``task``.
        vocab_size: the job's ``vocab_size`` (language_model), or None.
        seed: seeds the split.
        test_fraction: share of ``x`` held out when no ``x_test`` is given, in (0, 1).
        max_compressed_bytes: ``max_compressed_array_bytes`` (None: no cap).

    Returns:
        The set; ``data_key`` is empty until ``set_content_hash``.

    Raises:
        DataError: missing or unreadable files, a layout or value the task cannot take
            (INVALID_ARGUMENT); the message names the file and the array (and first bad row).
    """
    try:
        arrays = open_arrays(path, max_compressed_bytes)
        check_file_layout(arrays, task)
        width = check_values(arrays, task, vocab_size)
    except DataError as exc:
        raise DataError(f"{path.name}: {exc}") from None
    x = arrays["x"]
    if "x_test" in arrays:
        train_rows, test_rows = np.arange(len(x), dtype=np.int64), None
    else:
        labels = None
        if task == "classification":
            y = arrays["y"]
            blocks = row_blocks(len(y), 8, BLOCK_BYTES)
            labels = np.concatenate([y.rows(a, b).astype(np.int64) for a, b in blocks])
        train_rows, test_rows = split_rows(len(x), labels, width, seed, test_fraction)
    input_shape = x.shape[1:]
    if task == "language_model" and "y" not in arrays:
        input_shape = (x.shape[1] - 1,)
    return FileSet(task, arrays, train_rows, test_rows, input_shape, width)
