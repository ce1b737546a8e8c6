"""DiLoCo on a worker (``strategy: diloco``): the inner loop of one outer step.

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models",
algorithm 1. The coordinator (``coordinator.training.diloco``) asks a diloco job's workers for
local steps: a call's rows are cut into inner batches (``inner_rows``), each one step of the
inner optimizer from the parameters the coordinator set (θ_start), and the answer is the
pseudo-gradient Δ = θ_start − θ_end. The header's ``inner_steps`` (``InnerSteps``) says where
those steps are in the job, for the inner lr schedule; the worker does not lay out the job's
steps itself (but for a coordinator of the release before, ``legacy_inner_steps``). The
inner optimizer is the spec's ``optimizer``, built once per job and kept across outer steps,
as the paper does (its inner optimizer is AdamW).

Between calls the replica holds θ_start, the parameters of its ``params_version``: a call puts
them back when it ends, so two pieces of one outer step on one worker (a dead worker's shard
taken over) both start from them.

Shapes: R rows of one call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from shared.config import TrainJobSpec
from shared.training.controls import lr_factor, make_optimizer
from shared.training.data import inner_total_steps, steps_per_epoch
from worker.training.trainer import GradResult, Trainer, TrainerError


@dataclass(frozen=True)
class InnerSteps:
    """Where a call's local steps are in the job, for the inner lr schedule.

    Attributes:
        first: the job-wide index of the call's first inner step (from 0).
        total: inner steps per shard of the whole job, the schedule's span (>= 1).
    """

    first: int
    total: int


def legacy_inner_steps(
    spec: TrainJobSpec, n_train: int, epoch: int, step_in_epoch: int
) -> InnerSteps | None:
    """The inner steps of a call from a coordinator whose headers do not carry them.

    Such a coordinator (before ``StepHeader.inner_steps``) asked for local steps whenever the
    job was ``strategy: diloco`` and named the first inner step by (epoch, step within the
    epoch); the rest is computed here from the spec as it did. To be removed with the release
    after the one that added the field.

    Args:
        spec: the job.
        n_train: training rows N of its data set.
        epoch: the header's epoch, from 0.
        step_in_epoch: the header's first inner step within the epoch, from 0.

    Returns:
        The call's inner steps; None: not a diloco job (the call computes gradients).
    """
    if spec.strategy != "diloco":
        return None
    per_epoch = steps_per_epoch(n_train, spec.workers, spec.batch_size, spec.grad_accum_steps)
    return InnerSteps(epoch * per_epoch + step_in_epoch, inner_total_steps(spec, n_train))


class LocalSteps:
    """DiLoCo's inner loop for one job's trainer, and its inner optimizer."""

    def __init__(self, trainer: Trainer) -> None:
        """No inner optimizer until the first call.

        Args:
            trainer: the job's model replica and data on this worker.
        """
        self.trainer = trainer
        self._inner: torch.optim.Optimizer | None = None

    def run(
        self,
        rows: np.ndarray,
        inner_rows: Sequence[int],
        steps: InnerSteps,
        weights: np.ndarray | None = None,
    ) -> GradResult:
        """Local optimizer steps from the set parameters, then Δ; the parameters are put back.

        ``rows`` is cut into consecutive inner batches of ``inner_rows[i]`` rows; each is one
        step of the inner optimizer on the gradient of the batch's mean loss (micro-batches of
        ``batch_size``), clipped to ``clip_grad_norm``, at the spec's lr times ``lr_factor``
        of its job-wide inner step ``steps.first + i`` over ``steps.total``. The answer's
        ``grads`` is the pseudo-gradient Δ = θ_start − θ_end (algorithm 1), float32;
        ``buffers`` are those after the steps; ``loss_sum``/``correct`` are summed over the
        inner steps and ``samples`` is R. A non-finite Δ is reported (``finite`` False) and
        the inner optimizer's state is dropped with it. With ``weights`` (prioritized
        sampling) each inner step's loss is mean_i(w_i * l_i) over its batch and ``losses``
        gives every row's unweighted loss, as computed in its inner step.

        Args:
            rows: [R] int64 global row indices into the training split.
            inner_rows: the inner batches' row counts, summing to R; 0 skips a step.
            steps: the call's first inner step and the job's inner steps.
            weights: [R] float32 importance weights aligned with ``rows``; None: all 1.

        Raises:
            TrainerError: no parameters were set yet (FAILED_PRECONDITION).
            ShardMissing: a shard holding some of the rows is not held here
                (FAILED_PRECONDITION).
            ValueError: a row outside the training split, or ``inner_rows`` not summing to
                R (INVALID_ARGUMENT).
        """
        t = self.trainer
        if t.params_version is None:
            raise TrainerError("no parameters set: call set_params before local steps")
        if sum(inner_rows) != len(rows) or min(inner_rows, default=0) < 0:
            raise ValueError(f"inner_rows: {list(inner_rows)} do not split {len(rows)} rows")
        if weights is not None and len(weights) != len(rows):
            raise ValueError(f"weights: {len(weights)} values for {len(rows)} rows")
        t0 = time.perf_counter()
        params = dict(t.model.named_parameters())
        state = [*params.items(), *t.model.named_buffers()]
        start = {n: x.detach().clone() for n, x in state}
        if self._inner is None:
            self._inner = make_optimizer(t.spec, params.values())
        try:
            loss_sum, correct, losses = self._steps(self._inner, rows, inner_rows, steps, weights)
            delta = {
                n: (start[n].to(torch.float32) - p.detach().to(torch.float32)).cpu().numpy()
                for n, p in params.items()
            }
            buffers = {n: b.detach().cpu().numpy().copy() for n, b in t.model.named_buffers()}
        finally:
            with torch.no_grad():
                for name, x in state:
                    x.copy_(start[name])
        finite = all(np.isfinite(d).all() for d in delta.values())
        if not finite:
            self._inner = None  # its moments may hold the NaN: start afresh
        compute_s = time.perf_counter() - t0
        return GradResult(delta, buffers, len(rows), loss_sum, correct, compute_s, finite, losses)

    def _steps(
        self,
        inner: torch.optim.Optimizer,
        rows: np.ndarray,
        inner_rows: Sequence[int],
        steps: InnerSteps,
        weights: np.ndarray | None,
    ) -> tuple[float, int, np.ndarray | None]:
        """Take the inner steps; return loss sum, rows right and (weights) per-sample losses.

        The per-sample losses are [R] float32 in the rows' order; None without ``weights``.
        """
        t = self.trainer
        spec = t.spec
        loss_sum, correct, offset = 0.0, 0, 0
        parts: list[np.ndarray] = []
        for i, count in enumerate(inner_rows):
            start = offset
            batch, offset = rows[offset : offset + count], offset + count
            if count == 0:
                continue
            for group in inner.param_groups:
                group["lr"] = spec.optimizer.lr * lr_factor(
                    spec, steps.first + i, max(steps.total, 1)
                )
            inner.zero_grad(set_to_none=True)
            w = None if weights is None else weights[start:offset]
            step_loss, step_correct, step_losses = t.backward(batch, 1.0, w)
            if step_losses is not None:
                parts.append(step_losses)
            if spec.clip_grad_norm is not None:
                nn.utils.clip_grad_norm_(t.model.parameters(), spec.clip_grad_norm)
            inner.step()
            loss_sum, correct = loss_sum + step_loss, correct + step_correct
        if weights is None:
            return loss_sum, correct, None
        return loss_sum, correct, np.concatenate([np.empty(0, np.float32), *parts])
