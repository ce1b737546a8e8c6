"""Single-process training on the global batch: the reference sync training is checked against.

The equivalence (docs/architecture.md, "Invariants"): a ``strategy: sync`` job over W shards, whose
coordinator averages the workers' gradients weighted by sample count, ends with the same
parameters as one process that, every step, takes the mean cross-entropy over the
concatenation of the W shards' mini-batches and steps the same optimizer.

The reference is written independently of the code it checks: it imports nothing from
``coordinator`` (no ``weighted_average``, no ``ParameterServer``) or ``worker`` (no
``Trainer``), nor ``shared.training.controls``: the optimizer is a plain ``torch.optim`` one
built here. What it takes from ``shared`` is what defines the job rather than how it trains:
the initial weights (``build_model`` with the job's seed), the train/test split
(``load_dataset``) and which rows shard s takes at (epoch, step) (``batch_indices``). The
length of an epoch is computed here: it lasts until the largest shard, of ceil(N / W) rows,
has run out, i.e. ceil(ceil(N / W) / B) steps; shorter shards' last batches are smaller or
empty.

Controls this reference does not model (precision other than fp32, gradient accumulation,
clipping, learning-rate schedules) are refused with ``NotImplementedError`` instead of being
ignored, so a test cannot compare against a reference that trained differently.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from shared.config import TrainJobSpec
from shared.training.data import Dataset, batch_indices
from shared.training.models import build_model


def steps_in_epoch(n_train: int, workers: int, batch_size: int) -> int:
    """Steps of one epoch: ceil(largest shard's rows / batch_size), the largest shard being
    ceil(n_train / workers) rows."""
    return math.ceil(math.ceil(n_train / workers) / batch_size)


def global_batch_rows(spec: TrainJobSpec, n_train: int, step: int) -> np.ndarray:
    """The training rows of global step ``step`` (from 0): every shard's batch, concatenated.

    Args:
        spec: the job (workers, batch size, seed).
        n_train: training rows N.
        step: the global step, from 0.

    Returns:
        [B_global] int64 row indices into ``x_train``, B_global <= workers * batch_size.
    """
    epoch, step_in_epoch = divmod(step, steps_in_epoch(n_train, spec.workers, spec.batch_size))
    return np.concatenate(
        [
            batch_indices(
                n_train, s, spec.workers, spec.batch_size, epoch, step_in_epoch, spec.seed
            )
            for s in range(spec.workers)
        ]
    )


def _optimizer(spec: TrainJobSpec, model: nn.Module) -> torch.optim.Optimizer:
    opt = spec.optimizer
    if opt.name == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay
        )
    if opt.name == "adam":
        return torch.optim.Adam(model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay)


def _refuse_unmodelled(spec: TrainJobSpec) -> None:
    unmodelled = {
        "precision": spec.precision != "fp32",
        "grad_accum_steps": spec.grad_accum_steps != 1,
        "clip_grad_norm": spec.clip_grad_norm is not None,
        "lr_schedule": spec.lr_schedule.name != "constant" or spec.lr_schedule.warmup_steps > 0,
        "sync_batchnorm": spec.sync_batchnorm,
    }
    named = [key for key, differs in unmodelled.items() if differs]
    if named:
        raise NotImplementedError(f"the single-process reference does not model {named}")


def train_single_process(spec: TrainJobSpec, dataset: Dataset, steps: int) -> nn.Module:
    """Train the spec's model in this process on the global batch for ``steps`` steps.

    Args:
        spec: the job; its model, seed, optimizer, workers (the shard count) and batch size.
        dataset: the job's data set, as ``load_dataset(spec.data, spec.seed,
            spec.test_fraction)`` gives it.
        steps: optimizer steps.

    Returns:
        The trained model (CPU, float32, training mode).

    Raises:
        NotImplementedError: the spec uses a control this reference does not model.
    """
    _refuse_unmodelled(spec)
    model = build_model(spec.model, dataset.input_shape, dataset.num_classes, spec.seed)
    opt = _optimizer(spec, model)
    x_all, y_all = torch.from_numpy(dataset.x_train), torch.from_numpy(dataset.y_train)
    for step in range(steps):
        rows = torch.from_numpy(global_batch_rows(spec, len(y_all), step))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x_all[rows]), y_all[rows]).backward()
        opt.step()
    return model
