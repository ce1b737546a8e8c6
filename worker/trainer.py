"""One worker's side of one synchronous (parameter server) training job.

Each step the coordinator sends the current parameters (``set_params``), or only their version
when this worker already holds them, and asks for the gradients of the mean cross-entropy over
this shard's mini-batch (``compute_gradients``). Pure CPU torch, no networking: the worker
daemon calls it in a thread, and fetches the rows of file data sets (``worker.shards``) before.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from shared.config import TrainJobSpec
from shared.training.data import batch_indices, shard_bounds
from shared.training.models import build_model, check_param_arrays, param_shapes
from worker.shards import TrainData


class TrainerError(RuntimeError):
    """A call arrived in a state that cannot serve it (FAILED_PRECONDITION)."""


@dataclass
class GradResult:
    """Gradients of one shard's mini-batch.

    Attributes:
        grads: name -> float32 array, the names and shapes of ``model.named_parameters()``;
            gradients of the MEAN cross-entropy over the batch (zeros when samples == 0).
        samples: rows in the batch (0 when the shard is exhausted at this step).
        loss_sum: sum of the per-sample cross-entropy over the batch, nats.
        correct: rows whose arg-max logit equals the label.
        compute_s: wall-clock seconds spent in forward and backward.
    """

    grads: dict[str, np.ndarray]
    samples: int
    loss_sum: float
    correct: int
    compute_s: float


class Trainer:
    """Holds one job's data and model replica on a worker and computes shard gradients."""

    def __init__(
        self,
        spec: TrainJobSpec,
        shard_index: int,
        shard_count: int,
        torch_threads: int = 1,
        allowed_imports: Sequence[str] = (),
        daemon: str = "worker",
        data: TrainData | None = None,
    ) -> None:
        """Load this worker's data and build the model and optimizer.

        Args:
            spec: the job.
            shard_index: this worker's shard in [0, shard_count).
            shard_count: number of shards (workers) of the job.
            torch_threads: ``torch.set_num_threads`` value. Note: this setting is process-wide.
            allowed_imports: this worker's ``allowed_imports`` (an import model must be listed).
            daemon: ``worker NAME``, for a refusal's message.
            data: the job's training rows held here (at least this shard's); None makes a
                built-in data set here.

        Raises:
            ImportNotAllowed: the model's module is not allowed here (PERMISSION_DENIED).
            DataError: the job's data cannot be loaded, or ``data`` is None for a file data set
                (INVALID_ARGUMENT).
            ShardMissing: ``data`` does not hold this shard (FAILED_PRECONDITION).
            ModelError: the job's model cannot be built (INVALID_ARGUMENT).
            ValueError: bad shard_index/shard_count (INVALID_ARGUMENT).
        """
        torch.set_num_threads(torch_threads)
        self.spec = spec
        self.data = data if data is not None else TrainData.local(spec)
        self.model: nn.Module = build_model(
            spec.model,
            self.data.input_shape,
            self.data.num_classes,
            spec.seed,
            allowed_imports,
            daemon,
        )
        self._params = dict(self.model.named_parameters())
        self.params_version: int | None = None
        self.shard_index = 0
        self.shard_count = 1
        self.set_shard(shard_index, shard_count)

    @property
    def n_train(self) -> int:
        """Training rows of the whole data set (all shards)."""
        return self.data.n_train

    @property
    def train_samples(self) -> int:
        """Training rows in this worker's shard."""
        start, stop = shard_bounds(self.n_train, self.shard_index, self.shard_count)
        return stop - start

    def set_shard(self, shard_index: int, shard_count: int) -> None:
        """Switch to another shard, e.g. to take over a dead worker's rows.

        Raises:
            ValueError: shard_count < 1 or shard_index outside [0, shard_count).
            ShardMissing: the shard's rows are not held here (FAILED_PRECONDITION).
        """
        self.data.rows((shard_index, shard_count))  # validates
        self.shard_index, self.shard_count = shard_index, shard_count

    def set_params(self, params: dict[str, np.ndarray], version: int) -> None:
        """Overwrite the replica's parameters with the coordinator's.

        Args:
            params: name -> array with the names and shapes of ``model.named_parameters()``;
                any float dtype (copied to float32), may be read-only.
            version: the coordinator's parameter version, kept in ``params_version``.

        Raises:
            ValueError: a name is missing or unknown, or a shape differs (INVALID_ARGUMENT);
                the replica is left unchanged.
        """
        check_param_arrays(params, param_shapes(self.model))
        with torch.no_grad():
            for name, p in self._params.items():
                p.copy_(torch.tensor(np.asarray(params[name], dtype=np.float32)))
        self.params_version = version

    def compute_gradients(self, epoch: int, step_in_epoch: int) -> GradResult:
        """Gradients of the mean cross-entropy over this shard's batch at (epoch, step).

        Raises:
            TrainerError: no parameters were set yet (FAILED_PRECONDITION).
        """
        if self.params_version is None:
            raise TrainerError("no parameters set: call set_params before compute_gradients")
        rows = batch_indices(
            self.n_train,
            self.shard_index,
            self.shard_count,
            self.spec.batch_size,
            epoch,
            step_in_epoch,
            self.spec.seed,
        )
        if len(rows) == 0:
            zeros = {n: np.zeros(tuple(p.shape), np.float32) for n, p in self._params.items()}
            return GradResult(zeros, samples=0, loss_sum=0.0, correct=0, compute_s=0.0)
        t0 = time.perf_counter()
        shard = self.data.rows((self.shard_index, self.shard_count))
        local = rows - shard.start  # global row indices -> this shard's rows
        x, y = torch.from_numpy(shard.x[local]), torch.from_numpy(shard.y[local])
        self.model.zero_grad(set_to_none=True)
        logits = self.model(x)
        loss = nn.functional.cross_entropy(logits, y)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        grads = {n: _grad_array(p) for n, p in self._params.items()}
        correct = int((logits.argmax(dim=1) == y).sum())
        compute_s = time.perf_counter() - t0
        return GradResult(grads, len(rows), float(loss.detach()) * len(rows), correct, compute_s)


def _grad_array(p: torch.Tensor) -> np.ndarray:
    """A float32 copy of p.grad; zeros for a parameter the loss does not depend on."""
    if p.grad is None:
        return np.zeros(tuple(p.shape), np.float32)
    return p.grad.detach().to(torch.float32).numpy().copy()
