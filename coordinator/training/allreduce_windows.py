"""Prioritized allreduce (``sampling: prioritized``): its steps and the ranks' losses.

An allreduce job draws the rows of each window of ``resample_every_steps`` steps (default one
epoch) at its start (``coordinator.training.prioritized``) and runs it as one generation
(``coordinator.training.allreduce_job``); every rank is sent the whole window, splits each
step's global batch as the uniform order does (``shared.training.partition.rank_rows``) and
returns its rows' unweighted losses when the generation ends. ``window_losses`` puts them
back in draw order.

Shape letters: G' rows of one step, R rows of one rank's steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from coordinator.training.step_types import Piece, StepPlan
from shared.training.partition import rank_rows, step_rows


class AllreduceSteps:
    """An allreduce job's steps as the prioritized sampler plans them: one piece per step."""

    def __init__(self, n_train: int, global_batch: int, per_epoch: int, total: int) -> None:
        """Args: N training rows, G the global batch, the steps per epoch and in all."""
        self.n_train, self.global_batch = n_train, global_batch
        self._per_epoch, self._total = per_epoch, total

    @property
    def per_epoch(self) -> int:
        """Global steps in one epoch."""
        return self._per_epoch

    @property
    def total(self) -> int:
        """Global steps of the job."""
        return self._total

    def plan(
        self, step: int, members: Sequence[str], rates: Mapping[str, float | None]
    ) -> StepPlan:
        """One piece of G' placeholder rows (the sampler replaces them) for ``step``."""
        in_epoch = step % self._per_epoch
        size = step_rows(self.n_train, self.global_batch, in_epoch)
        return StepPlan([Piece(0, np.zeros(size, np.int64))], in_epoch)

    def step_size(self, step: int) -> int:
        """G', the rows of global step ``step``."""
        return step_rows(self.n_train, self.global_batch, step % self._per_epoch)


def window_losses(
    steps: AllreduceSteps,
    ranks: Sequence[str],
    reported: Mapping[str, tuple[int, bytes]],
    stop: int,
) -> dict[int, np.ndarray]:
    """The per-sample losses of every step all ranks of a generation reported, in draw order.

    Args:
        steps: the job's steps.
        ranks: the generation's workers in rank order (W = len(ranks)).
        reported: worker -> (its first step, [R] float32 little-endian losses), the ranks
            that ended (``GenerationOutcome.losses``).
        stop: the step the ranks hold at the end (exclusive).

    Returns:
        step -> [G'] float32 losses; only the steps every rank reported from the same first
        step (a rank that failed, or losses that do not add up, leave the generation's
        steps out).
    """
    world = len(ranks)
    if world == 0 or any(name not in reported for name in ranks):
        return {}
    firsts = {reported[name][0] for name in ranks}
    if len(firsts) != 1:
        return {}
    first = firsts.pop()
    out: dict[int, np.ndarray] = {
        s: np.empty(steps.step_size(s), np.float32) for s in range(first, stop)
    }
    for rank, name in enumerate(ranks):
        losses = np.frombuffer(reported[name][1], "<f4")
        offset = 0
        for s in range(first, stop):
            where = rank_rows(np.arange(steps.step_size(s)), rank, world)
            part = losses[offset : offset + len(where)]
            if len(part) != len(where):
                return {}
            out[s][where] = part
            offset += len(where)
        if offset != len(losses):
            return {}
    return out
