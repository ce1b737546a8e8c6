"""``strategy: sync`` on the coordinator: a step is one optimizer step on the global batch.

The parameter-server loop (``coordinator.training.train_job``) asks its strategy for the
step counts, each step's pieces and the parameter server's controls; ``SyncSteps`` answers
for sync: an epoch of P = ``steps_per_epoch`` steps, each step's pieces as
``coordinator.training.step_plan`` plans them, and the spec's optimizer, lr schedule and
clipping (``coordinator.training.parameter_server.spec_controls``). DiLoCo's answers are
``coordinator.training.diloco.DilocoSteps``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from coordinator.training.parameter_server import StepControls, spec_controls
from coordinator.training.step_plan import plan_pieces
from coordinator.training.step_types import StepPlan
from shared.config import TrainJobSpec
from shared.training.data import inner_total_steps, steps_per_epoch


class SyncSteps:
    """The steps of a sync job: counts, pieces and the parameter server's controls."""

    def __init__(self, spec: TrainJobSpec, n_train: int) -> None:
        """Lay out the job's steps.

        Args:
            spec: the job (workers, batch_size, grad_accum_steps, steps or epochs).
            n_train: training rows N of its data set.
        """
        self.spec, self.n_train = spec, n_train
        self.per_epoch = steps_per_epoch(
            n_train, spec.workers, spec.batch_size, spec.grad_accum_steps
        )
        self.total = inner_total_steps(spec, n_train)

    def plan(
        self, step: int, members: Sequence[str], rates: Mapping[str, float | None]
    ) -> StepPlan:
        """The pieces of global step ``step`` (from 0) under the spec's ``batch_policy``.

        Args:
            step: the global step, in [0, ``total``).
            members: the active members' names.
            rates: member name -> measured samples/s (None: not measured yet).
        """
        epoch, step_in_epoch = divmod(step, self.per_epoch)
        pieces = plan_pieces(self.spec, self.n_train, epoch, step_in_epoch, members, rates)
        return StepPlan(pieces, step_in_epoch)

    def controls(self, model: nn.Module) -> StepControls:
        """The spec's optimizer, lr schedule over the job's steps and clipping."""
        return spec_controls(self.spec, model, self.total)

    def result_fields(self) -> dict[str, Any]:
        """Nothing beyond the parameter-server loop's result."""
        return {}
