"""The parameter server of a sync or diloco job: the authoritative model on the coordinator.

It holds the model, the optimizer, the learning-rate schedule and clipping (``StepControls``:
the spec's for sync, ``coordinator.training.diloco.outer_controls`` for diloco), the fp16 loss
scale and the parameter version; each step it applies the workers' combined gradients
(``coordinator.training.aggregation``, ``coordinator.training.robust_aggregation``) and the
merged buffers, on the CPU. Its state is what a checkpoint holds.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from coordinator.training.evaluation import evaluate
from coordinator.training.loss_scale import LossScale
from shared.config import TrainJobSpec
from shared.training.controls import UNLOADABLE, make_lr_scheduler, make_optimizer
from shared.training.data import TrainSource
from shared.training.models import buffer_shapes, build_model, check_param_arrays, param_shapes
from shared.training.tasks import task_of


@dataclass(frozen=True)
class StepControls:
    """What the parameter server's step applies to the combined gradients.

    Attributes:
        optimizer: steps the model's parameters; its state goes into checkpoints.
        scheduler: the optimizer's lr schedule, stepped once per step (skipped or not).
        clip_grad_norm: the gradients' global L2 norm is clipped to this first; None: never.
    """

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    clip_grad_norm: float | None


def spec_controls(spec: TrainJobSpec, model: nn.Module, total_steps: int) -> StepControls:
    """The spec's ``optimizer``, ``lr_schedule`` over ``total_steps`` and ``clip_grad_norm``.

    Args:
        spec: the job.
        model: the parameter server's model, float32 on the CPU.
        total_steps: optimizer steps of the whole job, for the lr schedule (>= 1).
    """
    optimizer = make_optimizer(spec, model.parameters())
    scheduler = make_lr_scheduler(spec, optimizer, max(total_steps, 1))
    return StepControls(optimizer, scheduler, spec.clip_grad_norm)


class ParameterServer:
    """The authoritative model, optimizer, lr schedule and loss scale of a sync or diloco job.

    On the CPU. The optimizer's state (diloco: the outer Nesterov momentum) goes into
    checkpoints with the model.
    """

    def __init__(
        self,
        spec: TrainJobSpec,
        dataset: TrainSource,
        allowed_models: Mapping[str, str] | None = None,
        total_steps: int = 1,
        controls: Callable[[nn.Module], StepControls] | None = None,
        allowed_losses: Mapping[str, str] | None = None,
    ) -> None:
        """Build the model, optimizer and schedule (in a thread: it may import and allocate).

        Args:
            spec: the job; the model is seeded with ``spec.seed``; ``precision`` (fp16: a
                loss scale).
            dataset: the job's data; the test split is used by ``evaluate``.
            allowed_models: the operator's ``allowed_models`` for a model given as
                ``{entry: NAME}``.
            total_steps: optimizer steps of the whole job, for the default controls' lr
                schedule (>= 1).
            controls: builds the optimizer, schedule and clipping on the model (the job's
                strategy's: ``coordinator.training.diloco.outer_controls`` for diloco); None:
                the spec's own (``spec_controls`` over ``total_steps``).
            allowed_losses: the operator's ``allowed_losses`` for ``loss: {entry: NAME}``.

        Raises:
            EntryPointRefused: the model's or loss's entry is not listed (PERMISSION_DENIED).
            ModelError: the model cannot be built (INVALID_ARGUMENT).
        """
        self.spec = spec
        self.dataset = dataset
        self.task = task_of(spec, allowed_losses)
        self.model: nn.Module = build_model(
            spec.model, dataset.input_shape, dataset.num_classes, spec.seed, allowed_models
        )
        built = (
            controls(self.model)
            if controls is not None
            else spec_controls(spec, self.model, total_steps)
        )
        self.optimizer, self.scheduler = built.optimizer, built.scheduler
        self._clip_grad_norm = built.clip_grad_norm
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

        The gradient's global L2 norm is clipped to the controls' ``clip_grad_norm`` first
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
            # Clipping scales the gradients in place: then they are copies, not the caller's.
            view = self._clip_grad_norm is None
            for name, p in self.model.named_parameters():
                p.grad = _grad_tensor(np.asarray(grads[name], dtype=np.float32), view)
            if self._clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self._clip_grad_norm)
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
    def evaluate(self) -> dict[str, float]:
        """The task's metrics on the test split (eval mode): ``test_loss`` and the task's."""
        return evaluate(self.model, self.dataset, self.task)

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


def _grad_tensor(a: np.ndarray, view: bool) -> torch.Tensor:
    """A float32 gradient as a tensor: a view of ``a`` when ``view`` and NumPy allows it.

    The optimizers read ``grad`` and never write it, so a view saves a copy of the model's
    size per step; a read-only or negatively strided array is copied.
    """
    if view and a.flags.writeable:
        try:
            return torch.from_numpy(a)
        except ValueError:  # negative strides
            pass
    return torch.tensor(a)
