"""Step accounting of ``strategy: diloco``: outer steps made of consecutive inner steps.

An epoch keeps the ``sync`` strategy's P inner steps per shard (``data.steps_per_epoch``; the
rows of inner step s of a shard are ``data.batch_indices(..., s, ...)``). Outer step j of an
epoch covers the H = ``inner_steps`` consecutive inner steps [j H, min((j + 1) H, P)), so an
epoch has ceil(P / H) outer steps and its last one may cover fewer than H. A spec's ``steps``
counts INNER steps per worker (S): the job runs the outer steps covering the first S inner
steps of that layout, the last one cut at S. Local SGD rounds of H steps follow Douillard et
al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models", algorithm 1.
The coordinator's ``coordinator.training.diloco.DilocoSteps`` lays out a job's steps with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class OuterStep:
    """The inner steps one outer step covers.

    Attributes:
        epoch: the epoch, from 0.
        index_in_epoch: the outer step within the epoch, from 0.
        first: the first inner step within the epoch it covers.
        stop: one past the last inner step within the epoch it covers (> first).
    """

    epoch: int
    index_in_epoch: int
    first: int
    stop: int

    @property
    def inner_steps(self) -> int:
        """Inner steps it covers (H, fewer at the end of an epoch or of the job)."""
        return self.stop - self.first


def outer_steps_per_epoch(per_epoch: int, inner_steps: int) -> int:
    """Outer steps in one epoch: ceil(P / H).

    Args:
        per_epoch: P, inner steps per epoch (``data.steps_per_epoch``), >= 1.
        inner_steps: H, inner steps per outer step, >= 1.
    """
    return math.ceil(per_epoch / inner_steps)


def outer_total_steps(total_inner: int, per_epoch: int, inner_steps: int) -> int:
    """Outer steps covering the first S inner steps: full epochs, then ceil(rest / H).

    Args:
        total_inner: S, inner steps per worker of the job (>= 1).
        per_epoch: P, inner steps per epoch (>= 1).
        inner_steps: H (>= 1).
    """
    epochs, rest = divmod(total_inner, per_epoch)
    return epochs * outer_steps_per_epoch(per_epoch, inner_steps) + math.ceil(rest / inner_steps)


def outer_step(step: int, total_inner: int, per_epoch: int, inner_steps: int) -> OuterStep:
    """The inner steps of outer step ``step`` (from 0) of a job of S inner steps.

    Args:
        step: the global outer step, in [0, ``outer_total_steps(...)``).
        total_inner: S (>= 1).
        per_epoch: P (>= 1).
        inner_steps: H (>= 1).

    Raises:
        ValueError: ``step`` is outside the job.
    """
    if not 0 <= step < outer_total_steps(total_inner, per_epoch, inner_steps):
        raise ValueError(f"outer step {step} is outside the job")
    epoch, j = divmod(step, outer_steps_per_epoch(per_epoch, inner_steps))
    first = j * inner_steps
    stop = min(first + inner_steps, per_epoch, total_inner - epoch * per_epoch)
    return OuterStep(epoch, j, first, stop)
