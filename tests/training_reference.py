"""Single-process references that sync and diloco training are checked against.

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

``train_diloco_single_process`` is the reference of ``strategy: diloco`` (Douillard et al. 2023,
"DiLoCo: Distributed Low-Communication Training of Language Models", algorithm 1), in the same
terms: one replica and one inner optimizer per shard, kept for the whole job; every outer step
each replica starts from the global parameters and takes the inner steps the outer step covers
on its shard's batches (an epoch of P inner steps cut into outer steps of H = ``inner_steps``
consecutive ones, the last of an epoch shorter, the job ending after ``steps`` inner steps), the
pseudo-gradients (global minus replica parameters) are averaged weighted by the shard's rows
in the outer step, and an outer Nesterov SGD steps the global parameters with them. The inner
learning rate follows warm-up then cosine (Goyal et al. 2017, section 2.2; Loshchilov & Hutter
2017, eq. 5) over the job's inner steps, written out here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import nn

from shared.config import TrainJobSpec
from shared.training.data import Dataset, batch_indices
from shared.training.models import build_model

# The mean loss of a batch: (model outputs, targets) -> scalar. Tests of other tasks pass their
# own, written out in the test (regression's mean squared error, a language model's mean
# next-token cross-entropy).
MeanLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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


def _refuse_unmodelled(spec: TrainJobSpec, lr_schedule: bool = False) -> None:
    """Raise NotImplementedError naming the spec's controls the reference does not model.

    Args:
        spec: the job.
        lr_schedule: the caller models warm-up and the cosine schedule itself.
    """
    schedule = spec.lr_schedule.name != "constant" or spec.lr_schedule.warmup_steps > 0
    unmodelled = {
        "precision": spec.precision != "fp32",
        "grad_accum_steps": spec.grad_accum_steps != 1,
        "clip_grad_norm": spec.clip_grad_norm is not None,
        "lr_schedule": schedule and not lr_schedule,
        "sync_batchnorm": spec.sync_batchnorm,
    }
    named = [key for key, differs in unmodelled.items() if differs]
    if named:
        raise NotImplementedError(f"the single-process reference does not model {named}")


def train_single_process(
    spec: TrainJobSpec,
    dataset: Dataset,
    steps: int,
    loss: MeanLoss = nn.functional.cross_entropy,
    allowed_models: Mapping[str, str] | None = None,
) -> nn.Module:
    """Train the spec's model in this process on the global batch for ``steps`` steps.

    Args:
        spec: the job; its model, seed, optimizer, workers (the shard count) and batch size.
        dataset: the job's data set, as ``load_dataset(spec.data, spec.seed,
            spec.test_fraction)`` gives it.
        steps: optimizer steps.
        loss: the mean loss of a batch (default: cross-entropy of logits and labels).
        allowed_models: the entry points the spec's model may name.

    Returns:
        The trained model (CPU, float32, training mode).

    Raises:
        NotImplementedError: the spec uses a control this reference does not model.
    """
    _refuse_unmodelled(spec)
    model = build_model(
        spec.model, dataset.input_shape, dataset.num_classes, spec.seed, allowed_models
    )
    opt = _optimizer(spec, model)
    x_all, y_all = torch.from_numpy(dataset.x_train), torch.from_numpy(dataset.y_train)
    for step in range(steps):
        rows = torch.from_numpy(global_batch_rows(spec, len(y_all), step))
        opt.zero_grad()
        loss(model(x_all[rows]), y_all[rows]).backward()
        opt.step()
    return model


def _inner_lr_factor(spec: TrainJobSpec, step: int, total: int) -> float:
    """The inner lr's multiplier at job-wide inner step ``step`` of ``total``.

    Linear warm-up over ``warmup_steps``, then constant or cosine from 1 to ``min_lr_factor``.

    Raises:
        NotImplementedError: a schedule other than constant or cosine.
    """
    sched = spec.lr_schedule
    if sched.name not in ("constant", "cosine"):
        raise NotImplementedError(f"the diloco reference does not model lr_schedule {sched.name}")
    if step < sched.warmup_steps:
        return (step + 1) / sched.warmup_steps
    if sched.name == "constant":
        return 1.0
    done = min((step - sched.warmup_steps) / max(total - sched.warmup_steps, 1), 1.0)
    low = sched.min_lr_factor
    return low + (1.0 - low) * (1.0 + math.cos(math.pi * done)) / 2.0


def train_diloco_single_process(
    spec: TrainJobSpec,
    dataset: Dataset,
    loss: MeanLoss = nn.functional.cross_entropy,
    allowed_models: Mapping[str, str] | None = None,
) -> nn.Module:
    """DiLoCo in this process: ``spec.workers`` replicas, ``spec.steps`` inner steps each.

    Args:
        spec: a ``strategy: diloco`` job with ``steps`` set (inner steps per shard); its model,
            seed, inner optimizer and lr schedule, ``inner_steps`` (H), ``outer_lr``,
            ``outer_momentum``, workers (the shard count) and batch size.
        dataset: the job's data set, as ``load_dataset(spec.data, spec.seed,
            spec.test_fraction)`` gives it.
        loss: the mean loss of a batch (default: cross-entropy of logits and labels).
        allowed_models: the entry points the spec's model may name.

    Returns:
        The global model (CPU, float32, training mode).

    Raises:
        NotImplementedError: a control this reference does not model, or no ``steps``.
    """
    if spec.steps is None:
        raise NotImplementedError("the diloco reference counts inner steps: set steps")
    _refuse_unmodelled(spec, lr_schedule=True)
    n_train, shards = len(dataset.y_train), spec.workers
    per_epoch = steps_in_epoch(n_train, shards, spec.batch_size)
    outer_per_epoch = math.ceil(per_epoch / spec.inner_steps)

    def fresh() -> nn.Module:
        return build_model(
            spec.model, dataset.input_shape, dataset.num_classes, spec.seed, allowed_models
        )

    model, replicas = fresh(), [fresh() for _ in range(shards)]
    inner = [_optimizer(spec, r) for r in replicas]
    outer = torch.optim.SGD(
        model.parameters(),
        lr=spec.outer_lr,
        momentum=spec.outer_momentum,
        nesterov=spec.outer_momentum > 0,
    )
    x_all, y_all = torch.from_numpy(dataset.x_train), torch.from_numpy(dataset.y_train)
    done, outer_step = 0, 0
    while done < spec.steps:
        epoch, j = divmod(outer_step, outer_per_epoch)
        first = j * spec.inner_steps
        stop = min(first + spec.inner_steps, per_epoch, spec.steps - epoch * per_epoch)
        deltas, counts = [], []
        for shard, (replica, opt) in enumerate(zip(replicas, inner, strict=True)):
            replica.load_state_dict(model.state_dict())
            seen = 0
            for s in range(first, stop):
                rows = batch_indices(n_train, shard, shards, spec.batch_size, epoch, s, spec.seed)
                if len(rows) == 0:
                    continue
                factor = _inner_lr_factor(spec, epoch * per_epoch + s, spec.steps)
                for group in opt.param_groups:
                    group["lr"] = spec.optimizer.lr * factor
                opt.zero_grad()
                idx = torch.from_numpy(rows)
                loss(replica(x_all[idx]), y_all[idx]).backward()
                opt.step()
                seen += len(rows)
            pairs = zip(model.parameters(), replica.parameters(), strict=True)
            deltas.append([g.detach() - r.detach() for g, r in pairs])
            counts.append(seen)
        total = sum(counts)
        outer.zero_grad()
        for i, p in enumerate(model.parameters()):
            mean = sum(
                c / total * d[i].to(torch.float64) for d, c in zip(deltas, counts, strict=True)
            )
            p.grad = mean.to(torch.float32)
        outer.step()
        done += stop - first
        outer_step += 1
    return model
