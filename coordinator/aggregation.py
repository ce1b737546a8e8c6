"""Synchronous data-parallel training on the coordinator.

Gradient averaging and the parameter server that holds a job's authoritative model and
optimizer.

Shapes: W workers; each gradient dict maps a parameter name to an array of that parameter's
shape.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from shared.config import TrainJobSpec
from shared.training.controls import make_optimizer
from shared.training.data import Dataset
from shared.training.models import build_model, check_param_arrays, param_shapes

_EVAL_BATCH = 1024


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
    if len(grads) != len(samples):
        raise ValueError(f"{len(grads)} gradient sets but {len(samples)} sample counts")
    if any(n < 0 for n in samples):
        raise ValueError(f"sample counts must be >= 0, got {list(samples)}")
    total = sum(samples)
    if total == 0:
        raise ValueError("cannot average gradients: every worker reported 0 samples")
    expected = {name: tuple(np.shape(a)) for name, a in grads[0].items()}
    for g in grads[1:]:
        check_param_arrays(g, expected)
    out: dict[str, np.ndarray] = {}
    for name in expected:
        acc = np.zeros(expected[name], np.float64)
        for g, n in zip(grads, samples, strict=True):
            if n:
                acc += (n / total) * np.asarray(g[name], np.float64)
        out[name] = acc.astype(np.float32)
    return out


class ParameterServer:
    """The authoritative model and optimizer of one sync training job."""

    def __init__(
        self, spec: TrainJobSpec, dataset: Dataset, allowed_imports: Sequence[str] = ()
    ) -> None:
        """Build the model and its optimizer (in a thread: it may import and allocate).

        Args:
            spec: the job; the model is seeded with ``spec.seed``, the optimizer is
                ``spec.optimizer`` (sgd with momentum, or adam; lr; weight_decay).
            dataset: the job's data; the test split is used by ``evaluate``.
            allowed_imports: the operator's ``allowed_imports`` for a model given as
                ``package.module:callable``.

        Raises:
            ModelError: the model cannot be built (INVALID_ARGUMENT).
        """
        self.spec = spec
        self.dataset = dataset
        self.model: nn.Module = build_model(
            spec.model, dataset.input_shape, dataset.num_classes, spec.seed, allowed_imports
        )
        self.optimizer = make_optimizer(spec, self.model.parameters())
        self.version = 0
        self._shapes = param_shapes(self.model)

    @property
    def param_count(self) -> int:
        """Number of scalar parameters."""
        return sum(int(np.prod(s)) for s in self._shapes.values())

    def params(self) -> dict[str, np.ndarray]:
        """The current parameters: name -> float32 copy, ``named_parameters()`` order."""
        return {
            name: p.detach().to(torch.float32).numpy().copy()
            for name, p in self.model.named_parameters()
        }

    def step(self, grads: dict[str, np.ndarray]) -> None:
        """Apply one optimizer step with the averaged gradients and bump ``version``.

        Args:
            grads: name -> float32 array with every parameter's name and shape.

        Raises:
            ValueError: names or shapes differ from the model's; nothing is changed.
        """
        check_param_arrays(grads, self._shapes)
        for name, p in self.model.named_parameters():
            p.grad = torch.tensor(np.asarray(grads[name], dtype=np.float32))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Mean cross-entropy (nats) and accuracy in [0, 1] on the test split."""
        x_all = torch.from_numpy(self.dataset.x_test)
        y_all = torch.from_numpy(self.dataset.y_test)
        loss_sum, correct = 0.0, 0
        self.model.eval()
        try:
            for i in range(0, len(y_all), _EVAL_BATCH):
                x, y = x_all[i : i + _EVAL_BATCH], y_all[i : i + _EVAL_BATCH]
                logits = self.model(x)
                loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(dim=1) == y).sum())
        finally:
            self.model.train()
        n = max(len(y_all), 1)
        return loss_sum / n, correct / n

    def save(self, path: str | Path) -> None:
        """Write the model's ``state_dict`` with ``torch.save`` (load with weights_only)."""
        torch.save(self.model.state_dict(), Path(path))

    def state(self) -> bytes:
        """Serialize model, optimizer and version, for a checkpoint."""
        buf = io.BytesIO()
        torch.save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "version": self.version,
            },
            buf,
        )
        return buf.getvalue()

    def load_state(self, data: bytes) -> None:
        """Restore what ``state`` wrote (same spec).

        Raises:
            ValueError: the bytes are not a checkpoint of this model (FAILED_PRECONDITION).
        """
        try:
            state = torch.load(io.BytesIO(data), weights_only=True)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.version = int(state["version"])
        except (
            pickle.UnpicklingError,
            RuntimeError,
            KeyError,
            TypeError,
            ValueError,
            EOFError,
        ) as exc:
            raise ValueError(f"not a checkpoint of this job's model: {exc}") from None
