"""What a train job's ``task`` means: its per-sample loss, its batches, its metrics, its data.

One place for every task, so the trainer (``worker.training.trainer``), the allreduce replica
(``worker.allreduce.ddp_replica``) and evaluation (``coordinator.training.evaluation``) never
name a loss themselves:

- ``classification``: ``x`` float32 [N, ...], ``y`` int64 labels [N] in [0, C); loss the
  cross-entropy of the logits [B, C]; metric accuracy.
- ``regression``: ``x`` float32 [N, ...], ``y`` float32 [N] or [N, D]; the model outputs
  [B, D] (D = 1 for ``y`` [N]); loss ``mse`` (default) or ``huber`` (delta 1, as
  ``torch.nn.functional.huber_loss``), averaged over the D targets of a sample; metrics MSE,
  MAE and R^2 (1 - SSE / SST about the test targets' mean, over all target elements).
- ``language_model``: ``x`` int64 or int32 tokens [N, T]; without ``y`` the inputs are
  ``x[:, :-1]`` and the targets ``x[:, 1:]`` (next token), with ``y`` [N, T] the inputs are
  ``x`` and the targets ``y``; the model outputs logits [B, T', V]; the loss of a sample is the
  cross-entropy averaged over its T' positions; metrics perplexity (exp of the mean test loss)
  and tokens/s.

A task's loss is per sample ([B]): the framework takes the (sample-weighted) mean, so the sync
parameter server, DDP's all-reduce and DiLoCo's pseudo-gradients average the same quantity
as single-process training on the global batch. Every sample of a language-model set has the
same T', so the mean of the per-sample means is the mean over all tokens.

A user loss (``loss: {entry: NAME}``) is a callable ``loss(outputs, targets) -> [B]`` listed
by the operator in ``allowed_losses`` (``shared.training.entry_points``); it takes the place
of the task's built-in loss, the task still defines the batches, metrics and data checks.

Data checks raise ``DataError`` naming the array (and, for values, the first bad row).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from shared.config import TrainJobSpec
from shared.training.entry_points import EntryPointError, resolve_entry_point

TASKS = ("classification", "regression", "language_model")
TOKEN_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class DataError(ValueError):
    """A data set cannot be loaded or is malformed; the message names the array or file."""


@dataclass(frozen=True)
class Task:
    """A job's task: its name, loss and what it knows of its outputs.

    Attributes:
        name: one of ``TASKS``.
        loss: ``cross_entropy``, ``mse``, ``huber`` or ``entry`` (a user loss).
        user_loss: the user's ``loss(outputs, targets) -> [B]`` when ``loss == "entry"``.
    """

    name: str
    loss: str = "cross_entropy"
    user_loss: LossFn | None = field(default=None, compare=False)

    def per_sample_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of every sample of a batch, float32 [B].

        Args:
            outputs: the model's outputs for B samples ([B, C] logits, [B, D] or [B]
                regression outputs, [B, T, V] logits), any float dtype.
            targets: [B] int64 labels, [B] or [B, D] float32, or [B, T] int64 tokens.

        Raises:
            ValueError: the outputs' shape does not fit the targets (names both shapes), or
                a user loss that does not return [B] finite-shaped values.
        """
        b = targets.shape[0]
        if self.user_loss is not None:
            losses = self.user_loss(outputs, targets)
            if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (b,):
                got = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses)
                raise ValueError(
                    f"loss: the user loss must return per-sample losses [{b}], got {got}"
                )
            return losses.float()
        out = outputs.float()
        if self.name == "classification":
            return nn.functional.cross_entropy(out, targets, reduction="none")
        if self.name == "regression":
            out = _fit_regression(out, targets)
            if self.loss == "huber":
                each = nn.functional.huber_loss(out, targets, reduction="none")
            else:
                each = (out - targets) ** 2
            return each.reshape(b, -1).mean(dim=1)
        if out.ndim != 3 or out.shape[:2] != targets.shape:
            raise ValueError(
                f"model output {list(out.shape)} does not fit language_model targets "
                f"{list(targets.shape)}: expected [B, T, V]"
            )
        v = out.shape[-1]
        each = nn.functional.cross_entropy(
            out.reshape(-1, v), targets.reshape(-1), reduction="none"
        )
        return each.reshape(b, -1).mean(dim=1)

    def correct(self, outputs: torch.Tensor, targets: torch.Tensor) -> int:
        """Samples whose arg-max logit is the label (classification; 0 for other tasks)."""
        if self.name != "classification":
            return 0
        return int((outputs.argmax(dim=1) == targets).sum())

    @property
    def scored_by_accuracy(self) -> bool:
        """Whether the best model is the most accurate one (else: the lowest test loss)."""
        return self.name == "classification"


def _fit_regression(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The regression outputs shaped as the targets ([B, 1] fits [B]).

    Raises:
        ValueError: naming both shapes when they do not fit.
    """
    if out.shape == targets.shape:
        return out
    if targets.ndim == 1 and out.shape == (targets.shape[0], 1):
        return out.reshape(targets.shape)
    raise ValueError(
        f"model output {list(out.shape)} does not fit regression targets {list(targets.shape)}"
    )


def make_task(
    name: str,
    loss: str | None = None,
    loss_entry: str | None = None,
    allowed_losses: Mapping[str, str] | None = None,
    daemon: str = "coordinator",
    loss_args: Mapping[str, Any] | None = None,
) -> Task:
    """The task a spec names, resolving a user loss through ``allowed_losses``.

    Args:
        name: the spec's ``task``.
        loss: the spec's built-in loss (``mse``, ``huber``), or None for the task's default.
        loss_entry: the entry name of a user loss factory, or None: ``factory(**loss_args)``
            returns the callable ``loss(outputs, targets) -> [B]``.
        allowed_losses: this daemon's ``allowed_losses`` (entry name -> ``module:attribute``).
        daemon: ``coordinator`` or ``worker NAME``, for a refusal's message.
        loss_args: the spec's ``loss.args``.

    Raises:
        EntryPointRefused: the loss entry is not listed (PERMISSION_DENIED).
        EntryPointError: the listed module cannot be imported, the args do not fit, or the
            factory returned no callable (INVALID_ARGUMENT).
    """
    if loss_entry is not None:
        factory = resolve_entry_point(
            "loss", loss_entry, allowed_losses or {}, loss_args or {}, daemon, "allowed_losses"
        )
        fn = factory()
        if not callable(fn):
            raise EntryPointError(
                f"loss.entry: {loss_entry!r} returned {type(fn).__name__}, not a callable "
                "loss(outputs, targets) -> [B]"
            )
        return Task(name, "entry", fn)
    default = "cross_entropy" if name != "regression" else "mse"
    return Task(name, loss or default)


def task_of(
    spec: TrainJobSpec, allowed_losses: Mapping[str, str] | None = None, daemon: str = ""
) -> Task:
    """The task of a ``TrainJobSpec`` (its ``task`` and ``loss``).

    Raises:
        EntryPointRefused, EntryPointError: as ``make_task``.
    """
    loss = spec.loss
    if isinstance(loss, str):
        return make_task(spec.task, None if loss == "default" else loss)
    return make_task(
        spec.task, None, loss.entry, allowed_losses, daemon or "coordinator", loss.args
    )


# --- data ---------------------------------------------------------------------------------


def check_names(names: list[str] | set[str] | Any, task: str | None) -> None:
    """Refuse a set of array names that lacks what the task needs.

    ``x`` always; ``y`` too unless the task is ``language_model`` (targets from ``x``);
    ``task`` None (an upload, whose task is unknown) needs only ``x``.

    Raises:
        DataError: naming the first missing array and the arrays found.
    """
    found = sorted(names)
    needed = ["x"] if task in (None, "language_model") else ["x", "y"]
    missing = [k for k in needed if k not in found]
    if missing:
        raise DataError(f"missing array {missing[0]!r} (found: {found})")


def check_dtype(name: str, dtype: np.dtype[Any]) -> None:
    """Refuse an array dtype that is not a plain number: ints of any width, float16/32/64.

    Args:
        name: the array (``x``, ``y``, ``x_test``, ``y_test``), named in the message.
        dtype: its dtype (either byte order).

    Raises:
        DataError: bool, complex, float128, object, string, datetime or structured dtypes
            (INVALID_ARGUMENT), naming the array and the dtype.
    """
    if np.issubdtype(dtype, np.integer) or (
        np.issubdtype(dtype, np.floating) and dtype.itemsize <= 8
    ):
        return
    hint = " (save it as uint8)" if dtype == np.bool_ else ""
    raise DataError(
        f"array {name!r} has dtype {dtype}; a data set takes integers of any width or "
        f"float16/32/64{hint}"
    )


def check_layout(
    task: str,
    x_dtype: np.dtype[Any],
    x_shape: tuple[int, ...],
    y_dtype: np.dtype[Any] | None,
    y_shape: tuple[int, ...] | None,
    x_name: str = "x",
    y_name: str = "y",
) -> None:
    """Refuse dtypes and shapes that are not the task's data (the ``.npy`` headers suffice).

    Any numeric dtype (``check_dtype``) is taken and converted batch by batch
    (``task_arrays``): classification ``x`` any number, ``y`` integer labels; regression
    ``x`` and ``y`` any number; language_model ``x`` (and ``y``) integer tokens.

    Args:
        task: one of ``TASKS``.
        x_dtype: of ``x``.
        x_shape: of ``x``.
        y_dtype: of ``y``, or None when the set has no ``y`` (language_model only).
        y_shape: of ``y``, or None when the set has no ``y``.
        x_name: the inputs' array name in messages (``x_test`` for the test arrays).
        y_name: the targets' array name in messages.

    Raises:
        DataError: naming the array, what the task needs and what was found.
    """
    check_dtype(x_name, x_dtype)
    if y_dtype is not None:
        check_dtype(y_name, y_dtype)
    if task == "language_model":
        _check_tokens_layout(x_dtype, x_shape, y_dtype, y_shape, x_name, y_name)
        return
    if len(x_shape) < 2:
        raise DataError(f"array {x_name!r} must be [N, ...] with ndim >= 2, got {x_shape}")
    if y_dtype is None or y_shape is None:
        raise DataError(f"missing array {y_name!r} (task {task} needs targets)")
    if task == "classification":
        if not np.issubdtype(y_dtype, np.integer):
            raise DataError(
                f"array {y_name!r} must be integer labels for task classification, got {y_dtype}"
            )
        if len(y_shape) != 1:
            raise DataError(f"array {y_name!r} must be [N], got shape {y_shape}")
    elif len(y_shape) not in (1, 2) or (len(y_shape) == 2 and y_shape[1] < 1):
        raise DataError(
            f"array {y_name!r} must be [N] or [N, D] for task regression, got {y_shape}"
        )
    _same_rows(x_shape, y_shape, x_name, y_name)


def _check_tokens_layout(
    x_dtype: np.dtype[Any],
    x_shape: tuple[int, ...],
    y_dtype: np.dtype[Any] | None,
    y_shape: tuple[int, ...] | None,
    x_name: str = "x",
    y_name: str = "y",
) -> None:
    if not np.issubdtype(x_dtype, np.integer):
        raise DataError(
            f"array {x_name!r} must be integer tokens for task language_model, got {x_dtype}"
        )
    if len(x_shape) != 2:
        raise DataError(
            f"array {x_name!r} must be tokens [N, T] for task language_model, got {x_shape}"
        )
    if y_shape is None:
        if x_shape[1] < 2:
            raise DataError(
                f"array {x_name!r} needs T >= 2 tokens a row (targets are x shifted by one), "
                f"got {x_shape}"
            )
        if x_shape[0] == 0:
            raise DataError(f"array {x_name!r} is empty")
        return
    if y_dtype is None or not np.issubdtype(y_dtype, np.integer):
        raise DataError(
            f"array {y_name!r} must be integer tokens for task language_model, got {y_dtype}"
        )
    if tuple(y_shape) != tuple(x_shape):
        raise DataError(
            f"array {y_name!r} must be [N, T] as {x_name!r} {list(x_shape)}, got {list(y_shape)}"
        )
    _same_rows(x_shape, y_shape, x_name, y_name)


def task_arrays(
    task: str, x: npt.NDArray[Any], y: npt.NDArray[Any] | None
) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """Rows as stored, converted to what the task's model and loss take (one batch at a time).

    Args:
        task: one of ``TASKS``.
        x: [R, ...] the inputs in their stored dtype.
        y: [R, ...] the targets in their stored dtype; None for tokens without targets.

    Returns:
        classification: x float32, y int64 labels; regression: x float32, y float32;
        language_model: inputs and targets int64 [R, T'] (``split_tokens``).
    """
    if task == "language_model":
        return split_tokens(x, y)
    assert y is not None  # check_layout requires it for these tasks
    y_dtype = np.int64 if task == "classification" else np.float32
    return (
        np.ascontiguousarray(x, dtype=np.float32),
        np.ascontiguousarray(y, dtype=y_dtype),
    )


def _same_rows(
    x_shape: tuple[int, ...], y_shape: tuple[int, ...], x_name: str = "x", y_name: str = "y"
) -> None:
    if x_shape[0] != y_shape[0]:
        raise DataError(
            f"arrays {x_name!r} and {y_name!r} differ in length ({x_shape[0]} != {y_shape[0]})"
        )
    if y_shape[0] == 0:
        raise DataError(f"arrays {x_name!r} and {y_name!r} are empty")


def first_bad_row(bad_N: Any) -> int:
    """The index of the first True of a [N] mask (the caller knows one is True)."""
    return int(np.flatnonzero(bad_N)[0])


def check_values(
    task: str, x: npt.NDArray[Any], y: npt.NDArray[Any] | None, vocab_size: int | None
) -> None:
    """Refuse values the task's loss cannot take, naming the array and its first bad row.

    classification and regression: finite ``x``, then ``check_targets``; language_model:
    ``x`` (and ``y``) token ids as ``check_targets`` checks them.

    Raises:
        DataError: e.g. "array 'y' row 17 is NaN or infinite (task regression)".
    """
    if task == "language_model":
        check_targets(task, x, vocab_size, "x")
        if y is not None:
            check_targets(task, y, vocab_size)
        return
    if not np.isfinite(x).all():  # worded as the upload check, which sees x in pieces
        raise DataError("array 'x' contains NaN or infinite values")
    assert y is not None  # check_layout requires it for these tasks
    check_targets(task, y, vocab_size)


def check_targets(
    task: str, y: npt.NDArray[Any], vocab_size: int | None = None, name: str = "y"
) -> None:
    """Refuse targets the task's loss cannot take, naming the array and its first bad row.

    classification: labels >= 0 and at least two classes. regression: finite.
    language_model: token ids in [0, vocab_size) (>= 0 when no vocab_size).

    Args:
        task: one of ``TASKS``.
        y: the targets ([N] labels, [N] or [N, D] float32, [N, T] tokens).
        vocab_size: the spec's ``vocab_size`` (language_model), or None.
        name: the array's name in the file, for the message.

    Raises:
        DataError: naming the array, the first bad row and the rule.
    """
    if len(y) == 0:
        return
    if task == "regression":
        ok = np.isfinite(y.reshape(len(y), -1)).all(axis=1)
        if not ok.all():
            raise DataError(
                f"array {name!r} row {first_bad_row(~ok)} is NaN or infinite (task regression)"
            )
    elif task == "language_model":
        bad = (y < 0).any(axis=1)
        if vocab_size is not None:
            bad |= (y >= vocab_size).any(axis=1)
        if bad.any():
            row = first_bad_row(bad)
            limit = f"[0, vocab_size {vocab_size})" if vocab_size is not None else ">= 0"
            raise DataError(
                f"array {name!r} row {row} has a token id outside {limit} "
                f"(min {int(y[row].min())}, max {int(y[row].max())})"
            )
    else:
        if int(y.min()) < 0:  # worded as the upload check, which sees y in pieces
            raise DataError(f"array {name!r} has labels out of range (min {int(y.min())} < 0)")
        if int(y.max()) < 1:
            raise DataError(f"array {name!r} needs at least 2 classes (labels 0..C-1)")


def output_width(
    task: str,
    y: npt.NDArray[Any],
    vocab_size: int | None = None,
    x: npt.NDArray[Any] | None = None,
) -> int:
    """The model's output width: classes C, regression targets D, or vocabulary size V.

    Args:
        task: one of ``TASKS``.
        y: the targets.
        vocab_size: the spec's ``vocab_size`` (language_model), or None: the largest token
            id of ``y`` and ``x`` + 1.
        x: language_model: the input tokens.
    """
    if task == "regression":
        return 1 if y.ndim == 1 else int(y.shape[1])
    if task == "language_model":
        if vocab_size is not None:
            return vocab_size
        high = int(y.max()) if y.size else 0
        if x is not None and x.size:
            high = max(high, int(x.max()))
        return high + 1
    return max(int(y.max()) + 1, 2)


def split_tokens(
    x: npt.NDArray[Any], y: npt.NDArray[Any] | None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """A language model's inputs and targets: ``(x[:, :-1], x[:, 1:])`` without ``y``.

    Returns:
        inputs [N, T'] int64 and targets [N, T'] int64 (T' = T - 1 without ``y``, else T).
    """
    if y is None:
        return (
            np.ascontiguousarray(x[:, :-1], dtype=np.int64),
            np.ascontiguousarray(x[:, 1:], dtype=np.int64),
        )
    return x.astype(np.int64, copy=False), y.astype(np.int64, copy=False)


# --- metrics ------------------------------------------------------------------------------


def evaluate(
    task: Task, model: nn.Module, x: npt.NDArray[Any], y: npt.NDArray[Any], batch: int = 1024
) -> dict[str, float]:
    """The task's metrics of ``model`` on test rows in memory (``evaluate_batches``).

    Args:
        task: the job's task.
        model: on CPU, float32.
        x: [T, ...] the test inputs (float32, or int64 tokens).
        y: [T, ...] the test targets.
        batch: rows per forward pass.
    """
    pieces = ((x[i : i + batch], y[i : i + batch]) for i in range(0, len(y), batch))
    return evaluate_batches(task, model, pieces)


@torch.no_grad()
def evaluate_batches(
    task: Task, model: nn.Module, batches: Iterable[tuple[npt.NDArray[Any], npt.NDArray[Any]]]
) -> dict[str, float]:
    """The task's metrics of ``model`` (eval mode) on test batches; the model is put back in train.

    The batches are read one at a time, so the test rows need not fit in memory; R^2's
    total sum of squares is merged batch by batch in float64 (Chan et al. 1979's pairwise
    update of the mean and the sum of squared deviations).

    Args:
        task: the job's task.
        model: on CPU, float32.
        batches: (x [b, ...], y [b, ...]) in the task's dtypes (``task_arrays``).

    Returns:
        ``test_loss`` (the mean per-sample loss) and: classification ``test_accuracy``;
        regression ``test_mse``, ``test_mae``, ``test_r2``; language_model
        ``test_perplexity`` (exp of the mean per-token cross-entropy, nats).
    """
    n, loss_sum, correct, se, ae = 0, 0.0, 0, 0.0, 0.0
    elems, mean, m2 = 0, 0.0, 0.0  # regression targets: count, mean, squared deviations
    model.eval()
    try:
        for x, y in batches:
            xb, yb = (
                torch.from_numpy(np.ascontiguousarray(x)),
                torch.from_numpy(np.ascontiguousarray(y)),
            )
            out = model(xb)
            n += len(yb)
            loss_sum += float(task.per_sample_loss(out, yb).sum())
            correct += task.correct(out, yb)
            if task.name == "regression":
                diff = _fit_regression(out.float(), yb) - yb
                se += float((diff**2).sum())
                ae += float(diff.abs().sum())
                y64 = np.asarray(y, np.float64).reshape(-1)
                if y64.size:
                    b_mean = float(y64.mean())
                    b_m2 = float(((y64 - b_mean) ** 2).sum())
                    total = elems + y64.size
                    delta = b_mean - mean
                    m2 += b_m2 + delta * delta * elems * y64.size / total
                    mean += delta * y64.size / total
                    elems = total
    finally:
        model.train()
    metrics = {"test_loss": loss_sum / max(n, 1)}
    if task.name == "classification":
        metrics["test_accuracy"] = correct / max(n, 1)
    elif task.name == "regression":
        count = max(elems, 1)
        metrics |= {
            "test_mse": se / count,
            "test_mae": ae / count,
            "test_r2": 1.0 - se / m2 if m2 > 0 else math.nan,
        }
    else:
        metrics["test_perplexity"] = math.exp(min(metrics["test_loss"], 700.0))
    return metrics
