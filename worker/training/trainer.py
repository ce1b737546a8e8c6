"""One worker's side of one synchronous (parameter server) training job.

Each step the coordinator sends the current parameters and buffers (``set_params``), or only
their version when this worker already holds them, and asks for the gradients of the mean
per-sample loss of the job's task (``shared.training.tasks``) over the rows it names
(``compute_rows``; the coordinator chooses a step's rows,
``coordinator.training.step_plan``): micro-batches of ``batch_size`` rows, each forward pass
under ``torch.autocast`` in the spec's precision, the loss multiplied by the coordinator's loss
scale (fp16) and the gradients unscaled in float32. Model and batches live on
``resolve_device(spec.device)``; what goes back is float32 NumPy on the CPU. With ``strategy:
diloco`` a call runs local optimizer steps instead and answers the pseudo-gradient
(``worker.training.diloco``, using ``backward``). No networking: the worker daemon calls it in
a thread, and fetches the rows of file data sets (``worker.training.shards``) before.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from shared.config import TrainJobSpec
from shared.training.activation_checkpointing import checkpoint_blocks
from shared.training.controls import autocast, resolve_device
from shared.training.data import shard_bounds
from shared.training.models import buffer_shapes, build_model, check_param_arrays, param_shapes
from shared.training.tasks import task_of
from worker.training.shards import TrainData


class TrainerError(RuntimeError):
    """A call arrived in a state that cannot serve it (FAILED_PRECONDITION)."""


class DeviceUnavailable(RuntimeError):
    """The job's device does not exist on this worker (FAILED_PRECONDITION)."""


@dataclass
class GradResult:
    """Gradients of one shard's rows of one step, and the buffers they left.

    Attributes:
        grads: name -> float32 array, the names and shapes of ``model.named_parameters()``;
            gradients of the MEAN per-sample loss of the task over the step's rows, unscaled
            (zeros when samples == 0).
        buffers: name -> array of ``model.named_buffers()`` after the step's forward passes
            (BatchNorm running statistics), in each buffer's dtype; as set when samples == 0.
        samples: rows of the step (0 when the shard is exhausted at this step).
        loss_sum: sum of the per-sample losses over those rows (nats for cross-entropy).
        correct: rows whose arg-max logit equals the label (classification; else 0).
        compute_s: wall-clock seconds spent in forward and backward.
        finite: every gradient element is finite (after unscaling).
        losses: prioritized sampling (the call had importance weights): [R] float32 the
            unweighted per-sample losses of the rows, in their order; None otherwise.
    """

    grads: dict[str, np.ndarray]
    buffers: dict[str, np.ndarray]
    samples: int
    loss_sum: float
    correct: int
    compute_s: float
    finite: bool = True
    losses: np.ndarray | None = None


class Trainer:
    """Holds one job's data and model replica on a worker and computes shard gradients."""

    def __init__(
        self,
        spec: TrainJobSpec,
        shard_index: int,
        shard_count: int,
        torch_threads: int = 1,
        allowed_models: Mapping[str, str] | None = None,
        daemon: str = "worker",
        data: TrainData | None = None,
        allowed_losses: Mapping[str, str] | None = None,
    ) -> None:
        """Load this worker's data and build the model on the job's device.

        Args:
            spec: the job; its ``device`` was resolved by the coordinator (``auto`` is
                resolved here again, for tests and direct use).
            shard_index: this worker's shard in [0, shard_count).
            shard_count: number of shards (workers) of the job.
            torch_threads: ``torch.set_num_threads`` value. Note: this setting is process-wide.
            allowed_models: this worker's ``allowed_models`` (an entry model must be listed).
            daemon: ``worker NAME``, for a refusal's message.
            data: the job's training rows held here (at least this shard's); None makes a
                built-in data set here.
            allowed_losses: this worker's ``allowed_losses`` (a loss entry must be listed).

        Raises:
            EntryPointRefused: the model's or loss's entry is not listed here
                (PERMISSION_DENIED).
            DeviceUnavailable: ``device: cuda`` where torch sees no CUDA device
                (FAILED_PRECONDITION).
            DataError: the job's data cannot be loaded, or ``data`` is None for a file data set
                (INVALID_ARGUMENT).
            ShardMissing: ``data`` does not hold this shard (FAILED_PRECONDITION).
            ModelError: the job's model cannot be built (INVALID_ARGUMENT).
            ValueError: bad shard_index/shard_count (INVALID_ARGUMENT).
        """
        torch.set_num_threads(torch_threads)
        self.spec = spec
        try:
            self.device = resolve_device(spec.device)
        except ValueError as exc:
            raise DeviceUnavailable(f"{daemon}: {exc}") from None
        self.task = task_of(spec, allowed_losses, daemon)
        self.data = data if data is not None else TrainData.local(spec)
        # Built on the CPU (the same seeded values as the coordinator's), then moved.
        self.model: nn.Module = build_model(
            spec.model,
            self.data.input_shape,
            self.data.num_classes,
            spec.seed,
            allowed_models,
            daemon,
        ).to(self.device)
        if spec.activation_checkpointing:
            checkpoint_blocks(self.model)
        self._params = dict(self.model.named_parameters())
        self._buffers = dict(self.model.named_buffers())
        self._shapes = param_shapes(self.model) | buffer_shapes(self.model)
        self.params_version: int | None = None
        self.data.rows((shard_index, shard_count))  # validates: this shard is held here
        self.shard_index, self.shard_count = shard_index, shard_count

    @property
    def n_train(self) -> int:
        """Training rows of the whole data set (all shards)."""
        return self.data.n_train

    @property
    def train_samples(self) -> int:
        """Training rows in this worker's shard."""
        start, stop = shard_bounds(self.n_train, self.shard_index, self.shard_count)
        return stop - start

    def set_params(self, params: dict[str, np.ndarray], version: int) -> None:
        """Overwrite the replica's parameters and buffers with the coordinator's.

        Args:
            params: name -> array with the names and shapes of ``model.named_parameters()``
                and ``model.named_buffers()``; parameters in any float dtype (copied to
                float32), buffers copied to their dtype; may be read-only.
            version: the coordinator's parameter version, kept in ``params_version``.

        Raises:
            ValueError: a name is missing or unknown, or a shape differs (INVALID_ARGUMENT);
                the replica is left unchanged.
        """
        check_param_arrays(params, self._shapes)
        with torch.no_grad():
            for name, t in self._named_state():
                _load(t, np.asarray(params[name]))
        self.params_version = version

    def compute_rows(
        self, rows: np.ndarray, loss_scale: float = 1.0, weights: np.ndarray | None = None
    ) -> GradResult:
        """Gradients of the mean per-sample loss over the given global training rows.

        The rows are run in micro-batches of ``batch_size`` in their order; each backward
        pass adds the gradient of its rows' loss sum divided by ``len(rows)``, so the total
        is the gradient of the mean over all of them (sample-weighted). With ``weights``
        (prioritized sampling) the loss is mean_i(w_i * l_i) instead and the result carries
        the unweighted per-sample losses.

        Args:
            rows: [R] int64 global row indices into the training split (any shards held
                here; R may be any size, 0 gives zero gradients).
            loss_scale: S > 0; the loss is multiplied by S before backward and the gradients
                divided by S in float32 (fp16 loss scaling; 1.0 otherwise).
            weights: [R] float32 importance weights aligned with ``rows``; None: all 1.

        Raises:
            TrainerError: no parameters were set yet (FAILED_PRECONDITION).
            ShardMissing: a shard holding some of the rows is not held here
                (FAILED_PRECONDITION).
            ValueError: a row outside the training split (INVALID_ARGUMENT).
        """
        if self.params_version is None:
            raise TrainerError("no parameters set: call set_params before compute_rows")
        if weights is not None and len(weights) != len(rows):
            raise ValueError(f"weights: {len(weights)} values for {len(rows)} rows")
        if len(rows) == 0:
            zeros = {n: np.zeros(tuple(p.shape), np.float32) for n, p in self._params.items()}
            losses = None if weights is None else np.empty(0, np.float32)
            return GradResult(zeros, self._buffer_arrays(), 0, 0.0, 0, 0.0, losses=losses)
        t0 = time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        loss_sum, correct, losses = self.backward(rows, loss_scale, weights)
        grads = {n: _grad_array(p, loss_scale) for n, p in self._params.items()}
        finite = all(np.isfinite(g).all() for g in grads.values())
        compute_s = time.perf_counter() - t0
        return GradResult(
            grads, self._buffer_arrays(), len(rows), loss_sum, correct, compute_s, finite, losses
        )

    def backward(
        self, rows: np.ndarray, loss_scale: float, weights: np.ndarray | None = None
    ) -> tuple[float, int, np.ndarray | None]:
        """Add the gradient of the mean loss over ``rows`` (R >= 1) times ``loss_scale``.

        Micro-batches of ``batch_size`` in the rows' order; each backward pass adds the
        gradient of its rows' loss sum divided by R (sample-weighted mean). With ``weights``
        each per-sample loss l_i is multiplied by w_i first, so the gradient is that of
        mean_i(w_i * l_i) (importance-weighted, Schaul et al. 2016). The parameters'
        ``grad`` must be cleared before (``compute_rows``, DiLoCo's inner steps).

        Args:
            rows: [R] int64 global row indices into the training split, R >= 1.
            loss_scale: as ``compute_rows``.
            weights: [R] float32 importance weights aligned with ``rows``; None: all 1.

        Returns:
            The unweighted per-sample losses summed over the rows, the rows predicted right
            (classification; else 0), and with ``weights`` the per-sample losses [R] float32
            (None without).

        Raises:
            ValueError: the model's outputs do not fit the task's targets (names both
                shapes; INVALID_ARGUMENT).
        """
        spec = self.spec
        x_all, y_all = self.data.gather(rows, self.shard_count)
        loss_sum, correct = 0.0, 0
        parts: list[np.ndarray] = []
        for i in range(0, len(rows), spec.batch_size):
            x = torch.from_numpy(x_all[i : i + spec.batch_size]).to(self.device)
            y = torch.from_numpy(y_all[i : i + spec.batch_size]).to(self.device)
            with autocast(spec.precision, self.device):
                outputs = self.model(x)
                per = self.task.per_sample_loss(outputs, y)
                loss = per.sum()
            objective = loss
            if weights is not None:
                w = torch.from_numpy(np.array(weights[i : i + spec.batch_size], np.float32))
                objective = (per.float() * w.to(self.device)).sum()
                parts.append(per.detach().float().cpu().numpy())
            # torch leaves Tensor.backward unannotated
            (objective * (loss_scale / len(rows))).backward()  # type: ignore[no-untyped-call]
            loss_sum += float(loss.detach())
            correct += self.task.correct(outputs, y)
        losses = np.concatenate(parts).astype(np.float32) if weights is not None else None
        return loss_sum, correct, losses

    def _named_state(self) -> list[tuple[str, torch.Tensor]]:
        """The model's parameters and buffers by name (``set_params``'s names)."""
        return [*self._params.items(), *self._buffers.items()]

    def _buffer_arrays(self) -> dict[str, np.ndarray]:
        return {n: b.detach().cpu().numpy().copy() for n, b in self._buffers.items()}


def _load(t: torch.Tensor, a: np.ndarray) -> None:
    """Copy ``a`` into ``t``, cast to its dtype, in one copy when torch can view ``a``.

    A read-only array, or one torch cannot view (a dtype it lacks, negative strides), goes
    through a torch copy first.
    """
    if a.flags.writeable:
        try:
            t.copy_(torch.from_numpy(a))
            return
        except (TypeError, ValueError):  # a dtype torch has no view of, negative strides
            pass
    t.copy_(torch.tensor(a, dtype=t.dtype))


def _grad_array(p: torch.Tensor, loss_scale: float) -> np.ndarray:
    """p.grad / loss_scale as a float32 CPU copy; zeros for a parameter the loss ignores."""
    if p.grad is None:
        return np.zeros(tuple(p.shape), np.float32)
    return (p.grad.detach().to(torch.float32) / loss_scale).cpu().numpy()
