"""Synchronous data-parallel training on the coordinator.

Gradient and buffer averaging, and the parameter server that holds a job's authoritative
model, optimizer, learning-rate schedule and loss scale (on the CPU).

Shapes: W workers; each gradient dict maps a parameter name to an array of that parameter's
shape, each buffer dict a buffer name (BatchNorm's running_mean, running_var,
num_batches_tracked) to an array of that buffer's shape and dtype.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from coordinator.training.evaluation import evaluate
from coordinator.training.loss_scale import LossScale
from shared.config import TrainJobSpec
from shared.training.controls import (
    UNLOADABLE,
    make_lr_scheduler,
    make_optimizer,
    make_outer_optimizer,
)
from shared.training.data import Dataset
from shared.training.models import buffer_shapes, build_model, check_param_arrays, param_shapes


def weighted_average(
    grads: Sequence[dict[str, np.ndarray]], samples: Sequence[int]
) -> dict[str, np.ndarray]:
    """Average per-worker gradients weighted by their sample counts.

    g = sum_w (n_w / N) * g_w with N = sum_w n_w. When each g_w is the gradient of the MEAN
    loss over worker w's n_w rows, g is the gradient of the mean loss over all N rows, i.e.
    single-process training on the concatenated batch (Goyal et al. 2017, "Accurate, Large
    Minibatch SGD", section 2). Workers with n_w = 0 contribute nothing. Accumulates in
    float64.

    Args:
        grads: W dicts name -> array, all with the same names and shapes.
        samples: W sample counts n_w >= 0.

    Returns:
        name -> float32 array, the weighted average.

    Raises:
        ValueError: len(grads) != len(samples), a count is negative, all counts are 0, or
            names/shapes disagree between workers (the message names the parameter).
    """
    expected = check_weighted(grads, samples)
    total = sum(samples)
    out: dict[str, np.ndarray] = {}
    for name in expected:
        acc = np.zeros(expected[name], np.float64)
        for g, n in zip(grads, samples, strict=True):
            if n:
                acc += (n / total) * np.asarray(g[name], np.float64)
        out[name] = acc.astype(np.float32)
    return out


def check_weighted(
    grads: Sequence[dict[str, np.ndarray]], samples: Sequence[int]
) -> dict[str, tuple[int, ...]]:
    """Check W gradient sets and their sample counts before they are combined.

    Args:
        grads: W dicts name -> array.
        samples: W sample counts.

    Returns:
        name -> shape of every parameter (those of ``grads[0]``).

    Raises:
        ValueError: len(grads) != len(samples), a count is negative, all counts are 0, or
            names/shapes disagree between workers (the message names the parameter).
    """
    if len(grads) != len(samples):
        raise ValueError(f"{len(grads)} gradient sets but {len(samples)} sample counts")
    if any(n < 0 for n in samples):
        raise ValueError(f"sample counts must be >= 0, got {list(samples)}")
    if sum(samples) == 0:
        raise ValueError("cannot combine gradients: every worker reported 0 samples")
    expected = {name: tuple(np.shape(a)) for name, a in grads[0].items()}
    for g in grads[1:]:
        check_param_arrays(g, expected)
    return expected


def average_buffers(
    buffers: Sequence[dict[str, np.ndarray]], samples: Sequence[int]
) -> dict[str, np.ndarray]:
    """Merge the workers' model buffers after one step: floats averaged, integers maxed.

    Float buffers (BatchNorm's running_mean and running_var) are averaged weighted by sample
    count, as ``weighted_average``: each worker updated them from the coordinator's values
    with its own batches' statistics, so the average of running_mean is the running mean of
    the global batch's mean. Integer buffers (num_batches_tracked) take the largest value
    among the workers that had samples: the forward passes of the step's longest shard.

    Args:
        buffers: W dicts name -> array, same names, shapes and dtypes; may be empty dicts.
        samples: W sample counts n_w >= 0, not all 0.

    Returns:
        name -> array of the buffer's dtype.

    Raises:
        ValueError: as ``weighted_average`` (counts, names, shapes).
    """
    if not buffers or not buffers[0]:
        return {}
    first = buffers[0]
    floats = [n for n, a in first.items() if np.issubdtype(np.asarray(a).dtype, np.floating)]
    out = weighted_average([{n: g[n] for n in floats} for g in buffers], samples)
    ints = [n for n in first if n not in out]
    contributed = [b for b, n in zip(buffers, samples, strict=True) if n > 0]
    for name in ints:
        out[name] = np.max([np.asarray(b[name]) for b in contributed], axis=0)
    return {n: out[n].astype(np.asarray(first[n]).dtype, copy=False) for n in first}


class ParameterServer:
    """The authoritative model, optimizer, lr schedule and loss scale of a sync or diloco job.

    On the CPU. For diloco the optimizer is the outer one and its state (Nesterov momentum)
    goes into checkpoints with the model.
    """

    def __init__(
        self,
        spec: TrainJobSpec,
        dataset: Dataset,
        allowed_models: Mapping[str, str] | None = None,
        total_steps: int = 1,
    ) -> None:
        """Build the model, optimizer and schedule (in a thread: it may import and allocate).

        Args:
            spec: the job; the model is seeded with ``spec.seed``; ``optimizer``,
                ``lr_schedule``, ``clip_grad_norm`` and ``precision`` (fp16: a loss scale).
                ``strategy: diloco``: the optimizer is the outer Nesterov SGD
                (``make_outer_optimizer``) at a constant ``outer_lr``, and ``step`` neither
                clips nor schedules (the workers' inner steps do).
            dataset: the job's data; the test split is used by ``evaluate``.
            allowed_models: the operator's ``allowed_models`` for a model given as
                ``{entry: NAME}``.
            total_steps: optimizer steps of the whole job, for the lr schedule (>= 1).

        Raises:
            EntryPointRefused: the model's entry is not listed (PERMISSION_DENIED).
            ModelError: the model cannot be built (INVALID_ARGUMENT).
        """
        self.spec = spec
        self.dataset = dataset
        self.model: nn.Module = build_model(
            spec.model, dataset.input_shape, dataset.num_classes, spec.seed, allowed_models
        )
        self.outer = spec.strategy == "diloco"
        if self.outer:  # the lr schedule and clipping are the workers' (inner steps)
            self.optimizer = make_outer_optimizer(spec, self.model.parameters())
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: 1.0)
        else:
            self.optimizer = make_optimizer(spec, self.model.parameters())
            self.scheduler = make_lr_scheduler(spec, self.optimizer, max(total_steps, 1))
        self.loss_scale = LossScale(enabled=spec.precision == "fp16")
        self.version = 0
        self.skipped_steps = 0
        self._shapes = param_shapes(self.model)
        self._buffer_shapes = buffer_shapes(self.model)

    @property
    def param_count(self) -> int:
        """Number of scalar parameters."""
        return sum(int(np.prod(s)) for s in self._shapes.values())

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        return float(self.optimizer.param_groups[0]["lr"])

    def params(self) -> dict[str, np.ndarray]:
        """The current parameters: name -> float32 copy, ``named_parameters()`` order."""
        return {
            name: p.detach().to(torch.float32).numpy().copy()
            for name, p in self.model.named_parameters()
        }

    def buffers(self) -> dict[str, np.ndarray]:
        """The current buffers: name -> copy in the buffer's dtype, ``named_buffers()`` order."""
        return {name: b.detach().numpy().copy() for name, b in self.model.named_buffers()}

    def step(self, grads: dict[str, np.ndarray] | None) -> bool:
        """Apply one optimizer step with the averaged gradients; bump ``version``.

        With ``strategy: diloco`` this is the outer step: ``grads`` is the averaged
        pseudo-gradient (start minus end parameters of the workers' local steps) and the
        Nesterov SGD step moves the parameters by it (Douillard et al. 2023, algorithm 1).

        The gradient's global L2 norm is clipped to ``clip_grad_norm`` first
        (``torch.nn.utils.clip_grad_norm_``). None skips the optimizer step: with fp16, a
        shard's gradients were not all finite, and the loss scale backs off
        (``coordinator.training.loss_scale``). The lr schedule advances once per call, skipped or
        not, as in torch's AMP recipe; ``version`` too (the buffers changed either way).

        Args:
            grads: name -> float32 array with every parameter's name and shape, unscaled;
                None: skip this step.

        Returns:
            True when the optimizer stepped, False when the step was skipped.

        Raises:
            ValueError: names or shapes differ from the model's; nothing is changed.
        """
        if grads is not None:
            check_param_arrays(grads, self._shapes)
            for name, p in self.model.named_parameters():
                p.grad = torch.tensor(np.asarray(grads[name], dtype=np.float32))
            if self.spec.clip_grad_norm is not None and not self.outer:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.clip_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.skipped_steps += 1
        self.loss_scale.update(finite=grads is not None)
        with warnings.catch_warnings():
            # A skipped first step: torch warns that the schedule steps before the optimizer,
            # which is what a skipped AMP step means (the schedule counts every step).
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            self.scheduler.step()
        self.version += 1
        return grads is not None

    def set_buffers(self, buffers: dict[str, np.ndarray]) -> None:
        """Overwrite the model's buffers (the workers' merged ones, ``average_buffers``).

        Raises:
            ValueError: names or shapes differ from the model's buffers; nothing is changed.
        """
        check_param_arrays(buffers, self._buffer_shapes, "buffer")
        with torch.no_grad():
            for name, b in self.model.named_buffers():
                b.copy_(torch.tensor(np.asarray(buffers[name]), dtype=b.dtype))

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Mean cross-entropy (nats) and accuracy in [0, 1] on the test split (eval mode)."""
        return evaluate(self.model, self.dataset.x_test, self.dataset.y_test)

    def state(self, run: dict[str, Any] | None = None) -> bytes:
        """Serialize model, optimizer, schedule, loss scale and version, for a checkpoint.

        Args:
            run: plain data (numbers, strings, lists, dicts) of the job's run to keep with
                it, returned by ``load_state``.
        """
        buf = io.BytesIO()
        torch.save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "loss_scale": self.loss_scale.state_dict(),
                "version": self.version,
                "run": run or {},
            },
            buf,
        )
        return buf.getvalue()

    def load_state(self, data: bytes) -> dict[str, Any]:
        """Restore what ``state`` wrote (same spec); return its ``run`` data.

        Raises:
            ValueError: the bytes are not a checkpoint of this model (FAILED_PRECONDITION).
        """
        try:
            state = torch.load(io.BytesIO(data), weights_only=True)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.loss_scale.load_state_dict(state["loss_scale"])
            self.version = int(state["version"])
            return dict(state["run"])
        except UNLOADABLE as exc:
            raise ValueError(f"not a checkpoint of this job's model: {exc}") from None
