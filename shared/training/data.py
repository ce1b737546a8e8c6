"""Training data: loading a job's data set and the deterministic per-shard batch order.

Every worker loads the whole data set and trains on one contiguous shard of the training rows.
The rows of a batch are a pure function of (seed, epoch, shard, step), so a dead worker's
shard can be handed to another worker, and a job can resume from a checkpoint, without
changing what the model sees.

Shapes: N samples, B batch size, C classes.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from shared.config import BuiltinData, FileData, TrainJobSpec
from shared.npz import UNREADABLE, npz_members
from shared.training.partition import allreduce_total_steps
from shared.training.tasks import (
    DataError,
    check_layout,
    check_names,
    check_values,
    output_width,
    split_tokens,
)

__all__ = ["DataError", "Dataset", "load_dataset"]

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
    ``synthetic`` is seeded Gaussian blobs, [N, features]. A ``FileData`` is an ``.npz`` with
    ``x`` and ``y`` as ``task`` needs them (``load_training_npz``).

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
        x, y = load_training_npz(Path(spec.path), task, vocab_size)
    elif task != "classification":
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
    n = len(y)
    n_test = math.ceil(n * test_fraction)
    if n_test < 1 or n - n_test < 1:
        raise DataError(f"y: {n} samples are too few to hold out test_fraction={test_fraction}")
    can_stratify = False
    if stratify:
        counts = np.bincount(y, minlength=num_classes)
        present = int((counts > 0).sum())
        # Stratify only when sklearn can: every class needs two rows, one per side of the split.
        can_stratify = counts[counts > 0].min() >= 2 and min(n_test, n - n_test) >= present
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=n_test, random_state=seed, stratify=y if can_stratify else None
    )
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
    """Read and validate ``x`` and ``y`` from an .npz file (no pickles) for a task.

    Headers are checked against the members' sizes before NumPy allocates anything, and the
    arrays' dtypes, shapes and values (``shared.training.tasks``: finiteness, labels, token
    ids, the first bad row named) before they are returned.

    Args:
        path: the file.
        task: the job's ``task``.
        vocab_size: the job's ``vocab_size`` (language_model), or None.

    Returns:
        classification: x [N, ...] float32 (finite), y [N] int64 labels in [0, C), C >= 2;
        regression: x [N, ...] float32, y [N] or [N, D] float32, finite; language_model:
        inputs and targets [N, T'] int64 (``x`` shifted by one when the file has no ``y``).

    Raises:
        DataError: missing or unreadable file, or an array missing or malformed (names it).
    """
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        _check_member_sizes(path)
        with np.load(path, allow_pickle=False) as npz:
            try:
                check_names(npz.files, task)
            except DataError as exc:
                raise DataError(f"{path}: {exc}") from None
            x = npz["x"]
            y = npz["y"] if "y" in npz.files else None
    except UNREADABLE as exc:
        if isinstance(exc, DataError):
            raise
        raise DataError(f"{path}: not a readable .npz file ({exc})") from None
    try:
        check_layout(
            task,
            x.dtype,
            x.shape,
            None if y is None else y.dtype,
            None if y is None else y.shape,
        )
        check_values(task, x, y, vocab_size)
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from None
    if task == "language_model":
        return split_tokens(x, y)
    assert y is not None  # check_names and check_layout require it
    return x, y


def _check_member_sizes(path: Path) -> None:
    """Refuse an archive whose ``x``/``y`` headers claim more bytes than the members hold.

    Checked before NumPy allocates what a header asks for.

    Raises:
        DataError: a claimed size beyond the member's uncompressed size.
        ValueError, zipfile.BadZipFile, ...: unreadable archive (the caller reports them).
    """
    with zipfile.ZipFile(path) as zf:
        for m in npz_members(zf, ("x", "y")):
            have = m.stored_bytes - m.header_bytes
            if m.data_bytes > have:
                raise DataError(
                    f"{path}: array {m.name!r} claims shape {m.shape} "
                    f"({m.data_bytes} bytes) but the archive holds {have}"
                )


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


def layout_task(x_dtype: np.dtype[Any], y_dtype: np.dtype[Any] | None) -> str:
    """The task an upload's dtypes fit (the dtypes of ``x`` and ``y``; None: no ``y``).

    float32 x with int64 y is classification, with float32 y regression; int64/int32 x is
    language_model.

    Raises:
        DataError: dtypes that fit no task (names the array and what each task takes).
    """
    if x_dtype == np.float32:
        if y_dtype is None:
            raise DataError("missing array 'y' (float32 x needs targets y)")
        return "regression" if y_dtype == np.float32 else "classification"
    if x_dtype in (np.dtype(np.int64), np.dtype(np.int32)):
        return "language_model"
    raise DataError(
        f"array 'x' must be float32 (classification, regression) or int64/int32 tokens "
        f"(language_model), got {x_dtype}"
    )


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
    task = layout_task(x_dtype, y_dtype)
    check_layout(task, x_dtype, x_shape, y_dtype, y_shape)
    return task


def check_features(x: npt.NDArray[Any], name: str = "x") -> None:
    """Refuse NaN or infinite values of a float array (integer arrays pass).

    Args:
        x: ``x`` or ``y`` whole, or any piece of it.
        name: the array's name, for the message.

    Raises:
        DataError: a value is NaN or infinite.
    """
    if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
        raise DataError(f"array {name!r} contains NaN or infinite values")


def check_labels(low: int, high: int) -> None:
    """Refuse labels that are not 0..C-1 with C >= 2, from their extremes.

    Args:
        low: the smallest label of ``y``.
        high: the largest label of ``y``.

    Raises:
        DataError: a negative label, or fewer than two classes.
    """
    if low < 0:
        raise DataError(f"array 'y' has labels out of range (min {low} < 0)")
    if high < 1:
        raise DataError("array 'y' needs at least 2 classes (labels 0..C-1)")


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
