"""DiLoCo on the coordinator (``strategy: diloco``): what a diloco job does differently.

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models",
algorithm 1. A diloco job runs the parameter-server loop of a sync one
(``coordinator.training.train_job``) with ``DilocoSteps`` as its strategy:

- a step is an OUTER step covering H = ``inner_steps`` consecutive inner steps of an epoch
  (``shared.training.outer_steps``): an epoch of P inner steps has ceil(P / H) steps;
- a piece of an outer step (``plan_outer_pieces``) covers those inner steps: the rows of each
  inner step are planned as a sync step's (``coordinator.training.step_plan``) and each shard's
  (fixed) or member's (proportional) rows are concatenated, with the per-inner-step counts, so
  the worker cuts them back into its local steps' batches; every call asks for local steps
  (``InnerSteps``: the job-wide index of the first and the job's inner steps, which set the
  workers' inner lr) and the worker answers the pseudo-gradient (``worker.training.diloco``);
- the parameter server's optimizer is the outer Nesterov SGD at a constant ``outer_lr``,
  without clipping: the workers' inner steps schedule and clip (``outer_controls``);
- the result adds ``outer_steps`` and ``inner_steps`` (inner steps per shard).

Shapes: R rows of one piece.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from coordinator.training.parameter_server import StepControls
from coordinator.training.step_plan import plan_pieces
from coordinator.training.step_types import InnerSteps, Piece, StepPlan
from shared.config import TrainJobSpec
from shared.training.controls import make_outer_optimizer
from shared.training.data import inner_total_steps, steps_per_epoch
from shared.training.outer_steps import outer_step, outer_steps_per_epoch, outer_total_steps


class DilocoSteps:
    """The steps of a diloco job: outer-step counts, pieces and the outer optimizer.

    Attributes:
        per_epoch: outer steps in one epoch, ceil(P / H).
        total: outer steps of the job.
        inner_per_epoch: P, inner steps in one epoch (``steps_per_epoch``).
        inner_total: inner steps per shard of the job (``inner_total_steps``).
    """

    def __init__(self, spec: TrainJobSpec, n_train: int) -> None:
        """Lay out the job's outer steps.

        Args:
            spec: the job (workers, batch_size, grad_accum_steps, steps or epochs,
                inner_steps).
            n_train: training rows N of its data set.
        """
        self.spec, self.n_train = spec, n_train
        self.inner_per_epoch = steps_per_epoch(
            n_train, spec.workers, spec.batch_size, spec.grad_accum_steps
        )
        self.inner_total = inner_total_steps(spec, n_train)
        self.per_epoch = outer_steps_per_epoch(self.inner_per_epoch, spec.inner_steps)
        self.total = outer_total_steps(self.inner_total, self.inner_per_epoch, spec.inner_steps)

    def plan(
        self, step: int, members: Sequence[str], rates: Mapping[str, float | None]
    ) -> StepPlan:
        """The pieces of outer step ``step`` (from 0): its inner steps' rows per owner.

        Args:
            step: the global outer step, in [0, ``total``).
            members: the active members' names.
            rates: member name -> measured samples/s (None: not measured yet).

        Returns:
            The pieces (``plan_outer_pieces``), as ``step_in_epoch`` the first inner step's
            index within the epoch, and the inner steps every piece runs.
        """
        spec = self.spec
        outer = outer_step(step, self.inner_total, self.inner_per_epoch, spec.inner_steps)
        inner = range(outer.first, outer.stop)
        pieces = plan_outer_pieces(spec, self.n_train, outer.epoch, inner, members, rates)
        first = outer.epoch * self.inner_per_epoch + outer.first
        return StepPlan(pieces, outer.first, InnerSteps(first, self.inner_total))

    def controls(self, model: nn.Module) -> StepControls:
        """The outer optimizer (``outer_controls``)."""
        return outer_controls(self.spec, model)

    def result_fields(self) -> dict[str, Any]:
        """``outer_steps`` (the job's steps) and ``inner_steps`` (per shard)."""
        return {"outer_steps": self.total, "inner_steps": self.inner_total}


def outer_controls(spec: TrainJobSpec, model: nn.Module) -> StepControls:
    """The parameter server's controls of a diloco job: the outer Nesterov SGD, as it is.

    ``make_outer_optimizer`` (``outer_lr``, ``outer_momentum``), a constant schedule (kept so
    that checkpoints hold a schedule as a sync job's do) and no clipping: ``lr_schedule`` and
    ``clip_grad_norm`` are the inner steps' (the workers').

    Args:
        spec: the job.
        model: the parameter server's model, float32 on the CPU.
    """
    optimizer = make_outer_optimizer(spec, model.parameters())
    return StepControls(
        optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), None
    )


def plan_outer_pieces(
    spec: TrainJobSpec,
    n_train: int,
    epoch: int,
    inner: range,
    members: Sequence[str],
    rates: Mapping[str, float | None],
) -> list[Piece]:
    """The pieces of one diloco outer step: each inner step's pieces joined per owner.

    Args:
        spec: as ``plan_pieces``.
        n_train: training rows N.
        epoch: the epoch, from 0.
        inner: the inner steps within the epoch the outer step covers (non-empty).
        members: as ``plan_pieces``.
        rates: as ``plan_pieces``.

    Returns:
        One piece per shard (fixed) or per member with rows (proportional), whose rows are
        its inner steps' rows in order and ``inner_rows`` their counts (0 for an inner step
        it has no rows in).
    """
    per_step = [plan_pieces(spec, n_train, epoch, s, members, rates) for s in inner]
    owners = list(dict.fromkeys(_owner(p) for pieces in per_step for p in pieces))
    out: list[Piece] = []
    for owner in owners:
        parts = [next((p for p in pieces if _owner(p) == owner), None) for pieces in per_step]
        rows = [p.rows if p is not None else np.empty(0, np.int64) for p in parts]
        shard = owner if isinstance(owner, int) else -1
        member = owner if isinstance(owner, str) else None
        counts = tuple(len(r) for r in rows)
        out.append(Piece(len(out), np.concatenate(rows), shard, member, counts))
    return out


def _owner(piece: Piece) -> int | str:
    """A piece's shard (fixed) or member (proportional)."""
    return piece.member if piece.member is not None else piece.shard
