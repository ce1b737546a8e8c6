"""DiLoCo on the coordinator (``strategy: diloco``): what a diloco job does differently.

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models",
algorithm 1. A diloco job runs the parameter-server loop of a sync one
(``coordinator.training.train_job``), where a step is an OUTER step covering H =
``inner_steps`` consecutive inner steps of an epoch (``shared.training.outer_steps``).

A piece of an outer step (``plan_outer_pieces``) covers those inner steps: the rows of each
inner step are planned as a sync step's (``coordinator.training.step_plan``) and each shard's
(fixed) or member's (proportional) rows are concatenated, with the per-inner-step counts, so
the worker cuts them back into its local steps' batches.

Shapes: R rows of one piece.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from coordinator.training.step_plan import plan_pieces
from coordinator.training.step_types import Piece
from shared.config import TrainJobSpec


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
