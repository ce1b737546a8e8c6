"""Training data: loading a job's data set and the deterministic per-shard batch order.

A worker trains on one contiguous shard of the training rows: a built-in set it makes whole
itself; a file set's rows it fetches shard by shard from the coordinator, which opens the files
mapped (``shared.training.file_sets``; ``load_dataset`` reads one whole, for references and
small sets, with the same split). The rows of a batch are a pure function of (seed, epoch,
shard, step), so a dead worker's shard can be handed to another worker, and a job can resume
from a checkpoint, without changing what the model sees.

Shapes: N samples, B batch size, C classes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from sklearn.datasets import load_digits

from shared.config import BuiltinData, FileData, TrainJobSpec
from shared.training.file_sets import open_file_set, split_rows
from shared.training.partition import allreduce_total_steps
from shared.training.tasks import (
    DataError,
    check_dtype,
    check_layout,
    check_names,
    output_width,
    task_arrays,
)

__all__ = ["DataError", "Dataset", "TrainSource", "load_dataset"]

# A class centre is this many noise standard deviations from the origin per feature, so that
# the synthetic blobs are learnable to high accuracy but not trivially by one feature.
_SYNTHETIC_SEPARATION = 1.0
_SYNTHETIC_BLOCK_ROWS = 4096  # rows of class centres gathered at a time while adding them


@dataclass
class Dataset:
    """A data set split into training and test rows.

    The arrays are as the job's task defines them (``shared.training.tasks``):
    classification x float32, y int64 labels in [0, C); regression x float32, y float32 [N]
    or [N, D]; language_model x and y int64 tokens [N, T'] (inputs and targets).

    Attributes:
        x_train: [N_train, *input_shape] the inputs.
        y_train: [N_train, ...] the targets.
        x_test: [N_test, *input_shape] the inputs.
        y_test: [N_test, ...] the targets.
        input_shape: shape of one sample, e.g. (1, 8, 8) for digits.
        num_classes: the model's output width: classes C, regression targets D, or
            vocabulary size V.
    """

    x_train: npt.NDArray[Any]
    y_train: npt.NDArray[Any]
    x_test: npt.NDArray[Any]
    y_test: npt.NDArray[Any]
    input_shape: tuple[int, ...]
    num_classes: int

    @property
    def n_train(self) -> int:
        """N_train, the training rows."""
        return len(self.y_train)

    def test_batches(self, batch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The test rows, ``batch`` at a time (as ``FileSet.test_batches``)."""
        for i in range(0, len(self.y_test), batch):
            yield self.x_test[i : i + batch], self.y_test[i : i + batch]


class TrainSource(Protocol):
    """What a job needs of its data set, in memory (``Dataset``) or mapped (``FileSet``)."""

    @property
    def n_train(self) -> int:
        """N_train, the training rows."""
        ...

    input_shape: tuple[int, ...]
    num_classes: int

    def test_batches(self, batch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The test rows in the task's dtypes, ``batch`` at a time."""
        ...


def load_dataset(
    spec: BuiltinData | FileData,
    seed: int,
    test_fraction: float,
    task: str = "classification",
    vocab_size: int | None = None,
) -> Dataset:
    """Load a data set and split it into training and test rows.

    ``digits`` is scikit-learn's bundled UCI handwritten digits (1797 8x8 images, no
    download), scaled to [0, 1] and shaped [N, 1, 8, 8] so the mlp and cnn take the same data.
    ``synthetic`` is seeded Gaussian blobs, [N, features]. A ``FileData`` is an ``.npz`` or a
    directory of ``.npy`` files, read whole here in the task's dtypes (what references and
    small sets use; a train job opens it mapped instead: ``file_sets.open_file_set``, whose
    split and rows this equals).

    Args:
        spec: the job's ``data`` field.
        seed: seeds the synthetic data and the split.
        test_fraction: share of the samples held out for testing, in (0, 1).
        task: the job's ``task``; built-in sets are classification data.
        vocab_size: the job's ``vocab_size`` (language_model), or None.

    Returns:
        The split data set; a classification split is stratified by label when every class
        has enough samples; the split is the same for the same (data, seed, test_fraction).

    Raises:
        DataError: the file is missing or unreadable, or an array is missing or malformed
            (INVALID_ARGUMENT).
    """
    if isinstance(spec, FileData):
        fs = open_file_set(Path(spec.path), task, vocab_size, seed, test_fraction)
        x_train, y_train = fs.train_batch(np.arange(fs.n_train, dtype=np.int64))
        tests = list(fs.test_batches(max(fs.n_test, 1)))
        x_test, y_test = tests[0]
        return Dataset(x_train, y_train, x_test, y_test, fs.input_shape, fs.num_classes)
    if task != "classification":
        raise DataError(f"data: the built-in sets are classification data, not {task}")
    elif spec.name == "digits":
        bunch = load_digits()
        x = (bunch.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
        y = bunch.target.astype(np.int64)
    else:
        x, y = _synthetic(spec.samples, spec.features, spec.classes, seed)
    num_classes = output_width(task, y, vocab_size, x)
    stratify = task == "classification"
    return _split(x, y, num_classes, seed, test_fraction, stratify)


def synthetic_peak_bytes(samples: int, features: int, classes: int) -> int:
    """Bytes ``load_dataset`` holds at once while it makes a synthetic set, at most.

    The float64 class centres (8 x C x F), the float64 samples and their float32 copy
    (12 x N x F), and the labels (8 x N); the split's copies come after the float64 samples
    are freed and take less. What admission checks against ``max_synthetic_bytes``.

    Args:
        samples: N.
        features: F.
        classes: C.
    """
    return 8 * classes * features + 12 * samples * features + 8 * samples


def _synthetic(
    samples: int, features: int, classes: int, seed: int
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """Gaussian blobs: class centres ~ N(0, s^2 I), samples ~ N(centre, I).

    The centres are added to the noise in place, a block of rows at a time, so no [N, F]
    temporary exists besides the samples (``synthetic_peak_bytes``); the values are those
    of ``centres_CF[y] + noise``.
    """
    rng = np.random.default_rng(seed)
    centres_CF = rng.normal(0.0, _SYNTHETIC_SEPARATION, size=(classes, features))
    y = np.arange(samples, dtype=np.int64) % classes
    rng.shuffle(y)
    x = rng.normal(0.0, 1.0, size=(samples, features))
    for start in range(0, samples, _SYNTHETIC_BLOCK_ROWS):
        rows = slice(start, start + _SYNTHETIC_BLOCK_ROWS)
        x[rows] += centres_CF[y[rows]]
    return x.astype(np.float32), y


def _split(
    x: npt.NDArray[Any],
    y: npt.NDArray[Any],
    num_classes: int,
    seed: int,
    test_fraction: float,
    stratify: bool = True,
) -> Dataset:
    """Hold out ``ceil(N * test_fraction)`` rows for testing, stratified when possible.

    Args:
        x: [N, ...] the inputs.
        y: [N, ...] the targets.
        num_classes: the output width (classes, when stratifying).
        seed: seeds the split.
        test_fraction: share of the rows held out, in (0, 1).
        stratify: ``y`` holds labels to stratify by (classification), when sklearn can.

    Raises:
        DataError: too few samples to leave at least one row on each side.
    """
    train, test = split_rows(len(y), y if stratify else None, num_classes, seed, test_fraction)
    x_tr, x_te, y_tr, y_te = x[train], x[test], y[train], y[test]
    return Dataset(
        x_train=np.ascontiguousarray(x_tr),
        y_train=np.ascontiguousarray(y_tr),
        x_test=np.ascontiguousarray(x_te),
        y_test=np.ascontiguousarray(y_te),
        input_shape=tuple(int(d) for d in x.shape[1:]),
        num_classes=num_classes,
    )


def load_training_npz(
    path: Path, task: str = "classification", vocab_size: int | None = None
) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """Read, check and convert every row of ``x`` and ``y`` of a data set for a task.

    Args:
        path: an ``.npz`` or a directory of ``.npy`` files.
        task: the job's ``task``.
        vocab_size: the job's ``vocab_size`` (language_model), or None.

    Returns:
        x and y of every row in the task's dtypes (``tasks.task_arrays``).

    Raises:
        DataError: missing or unreadable file, or an array missing or malformed (names it).
    """
    fs = open_file_set(path, task, vocab_size, 0, 0.5)
    rows = np.arange(len(fs.arrays["x"]), dtype=np.int64)
    y = fs.arrays["y"].take(rows) if "y" in fs.arrays else None
    return task_arrays(task, fs.arrays["x"].take(rows), y)


# The rules of a training set whose task is not known yet (an upload): the loader applies the
# task's rules (shared.training.tasks), upload validation (coordinator/datasets/dataset_check.py)
# these to the headers and to streamed pieces. Each raises DataError with a message naming the
# array but not the file: callers prefix it.


def check_training_names(names: Iterable[str], x_dtype: np.dtype[Any] | None = None) -> None:
    """Refuse a set of array names without ``x``, or without ``y`` beside a float ``x``.

    A token set (integer ``x``) needs no ``y``: its targets are ``x`` shifted by one.

    Args:
        names: the arrays an archive holds.
        x_dtype: the dtype of ``x`` when it is there.

    Raises:
        DataError: naming the missing array and the arrays found.
    """
    found = set(names)
    check_names(found, None)
    if x_dtype is not None and np.issubdtype(x_dtype, np.floating):
        check_names(found, "classification")


def layout_task(
    x_dtype: np.dtype[Any],
    y_dtype: np.dtype[Any] | None,
    x_shape: tuple[int, ...] = (),
    y_shape: tuple[int, ...] | None = None,
) -> str:
    """The task an upload's arrays most likely are for (its task is not known yet).

    Integer ``x`` [N, T] with no ``y``, or with ``y`` of its shape, is language_model;
    otherwise float ``y`` is regression and integer ``y`` classification.

    Raises:
        DataError: a dtype ``tasks.check_dtype`` refuses, or no ``y`` beside non-token ``x``.
    """
    check_dtype("x", x_dtype)
    if y_dtype is not None:
        check_dtype("y", y_dtype)
    tokens = np.issubdtype(x_dtype, np.integer) and len(x_shape) in (0, 2)
    if tokens and (y_shape is None or tuple(y_shape) == tuple(x_shape)):
        return "language_model"
    if y_dtype is None:
        raise DataError("missing array 'y' (inputs x need targets y)")
    return "regression" if np.issubdtype(y_dtype, np.floating) else "classification"


def check_training_layout(
    x_dtype: np.dtype[Any],
    x_shape: tuple[int, ...],
    y_dtype: np.dtype[Any] | None,
    y_shape: tuple[int, ...] | None,
) -> str:
    """Refuse dtypes and shapes that are no task's training set (the ``.npy`` headers suffice).

    Args:
        x_dtype: of ``x``.
        x_shape: of ``x``.
        y_dtype: of ``y``, or None without one.
        y_shape: of ``y``, or None without one.

    Returns:
        The task the layout fits (``layout_task``).

    Raises:
        DataError: naming the array and what is wrong with it.
    """
    task = layout_task(x_dtype, y_dtype, x_shape, y_shape)
    check_layout(task, x_dtype, x_shape, y_dtype, y_shape)
    return task


def shard_bounds(n: int, shard_index: int, shard_count: int) -> tuple[int, int]:
    """Return the half-open row range [start, stop) of one shard, split like ``np.array_split``.

    The first ``n % shard_count`` shards hold one row more than the others.

    Args:
        n: training rows N.
        shard_index: the shard, in [0, shard_count).
        shard_count: shards (the job's workers).

    Raises:
        ValueError: shard_count < 1, shard_index outside [0, shard_count) or n < 0.
    """
    if shard_count < 1 or not 0 <= shard_index < shard_count or n < 0:
        raise ValueError(f"bad shard {shard_index} of {shard_count} for {n} rows")
    size, extra = divmod(n, shard_count)
    start = shard_index * size + min(shard_index, extra)
    return start, start + size + (shard_index < extra)


def steps_per_epoch(
    n_train: int, shard_count: int, batch_size: int, grad_accum_steps: int = 1
) -> int:
    """Return the steps in one epoch: the largest shard's ceil(rows / (B * k)).

    A step consumes ``grad_accum_steps`` (k) micro-batches of ``batch_size`` (B) rows per
    shard. Shorter shards run out of rows first: their last step is smaller or empty.

    Args:
        n_train: training rows N.
        shard_count: shards (the job's workers).
        batch_size: B, rows per worker per micro-batch.
        grad_accum_steps: k, micro-batches per worker per optimizer step.
    """
    return math.ceil(math.ceil(n_train / shard_count) / (batch_size * grad_accum_steps))


def inner_total_steps(spec: TrainJobSpec, n_train: int) -> int:
    """Return the steps per shard of a sync or diloco job: ``spec.steps``, else epochs x P.

    P is ``steps_per_epoch``. For ``strategy: diloco`` these are the inner (local optimizer)
    steps each shard takes (its outer steps: ``outer_steps.outer_total_steps``); for ``sync``
    they are the optimizer steps. Global step g of a sync job is (epoch, step_in_epoch) =
    divmod(g, P).

    Args:
        spec: the job (its steps or epochs, workers, batch size and grad_accum_steps).
        n_train: training rows N of its data set.
    """
    if spec.steps is not None:
        return spec.steps
    epochs = spec.epochs if spec.epochs is not None else 1
    return epochs * steps_per_epoch(n_train, spec.workers, spec.batch_size, spec.grad_accum_steps)


def worker_steps(spec: TrainJobSpec, n_train: int) -> int:
    """Return the optimizer steps each worker takes over a job: what ``max_steps`` caps.

    sync: the job's steps (``inner_total_steps``); diloco: its inner steps per shard
    (``inner_total_steps``; its outer steps are fewer); allreduce: the job's steps
    (``partition.allreduce_total_steps``).

    Args:
        spec: the job (its steps or epochs, workers, batch size and grad_accum_steps).
        n_train: training rows N of its data set.
    """
    if spec.strategy == "allreduce":
        return allreduce_total_steps(spec, n_train)
    return inner_total_steps(spec, n_train)


def batch_indices(
    n_train: int,
    shard_index: int,
    shard_count: int,
    batch_size: int,
    epoch: int,
    step_in_epoch: int,
    seed: int,
    grad_accum_steps: int = 1,
) -> npt.NDArray[np.int64]:
    """Return the global training-row indices one shard consumes in one optimizer step.

    The shard's rows are permuted by ``np.random.default_rng((seed, epoch, shard_index))``
    and the step takes the slice [step * B * k, (step + 1) * B * k), k micro-batches of B
    rows in order. So ``grad_accum_steps`` k at ``batch_size`` B takes exactly the rows of
    k = 1 at batch_size k * B. Any process computes the same rows, so a shard can move to
    another worker, or a job resume, without changing them.

    Args:
        n_train: training rows N.
        shard_index: the shard, in [0, shard_count).
        shard_count: shards (the job's workers).
        batch_size: B, rows per worker per micro-batch.
        epoch: the epoch, from 0.
        step_in_epoch: the step within the epoch, from 0.
        seed: the job's seed.
        grad_accum_steps: k, micro-batches per optimizer step.

    Returns:
        [R] int64 row indices into x_train, R <= B * k; empty when the shard has no rows
        left at this step (shorter shards run out before the longest one).
    """
    start, stop = shard_bounds(n_train, shard_index, shard_count)
    perm = np.random.default_rng((seed, epoch, shard_index)).permutation(stop - start)
    per_step = batch_size * grad_accum_steps
    rows = perm[step_in_epoch * per_step : (step_in_epoch + 1) * per_step]
    return (rows + start).astype(np.int64)
