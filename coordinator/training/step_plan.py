"""Which rows of a ``sync`` step each ComputeGradients call computes (``Piece``).

A step's global batch is fixed by the spec whatever the policy: the union over the job's
shards of ``shared.training.data.batch_indices`` (each shard's rows of the step, in shard
order). ``batch_policy: fixed`` makes one piece per shard; ``proportional`` cuts the same
rows, in the same order, into one contiguous piece per active member, sized by the members'
measured samples/s (``coordinator.network.straggler.proportional_shares``). Every piece's gradient
is of the mean loss over its rows and the pieces are averaged weighted by rows, so both give the
gradient of the mean loss over the same global batch (Goyal et al. 2017, section 2).

With ``strategy: diloco`` a piece covers the consecutive inner steps of one outer step: each
inner step is planned here and ``coordinator.training.diloco.plan_outer_pieces`` joins them.

Shapes: G rows of the global batch, R rows of one piece.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from coordinator.network.straggler import proportional_shares
from coordinator.training.step_types import Piece
from shared.config import TrainJobSpec
from shared.training.data import batch_indices


def shard_rows(
    spec: TrainJobSpec, n_train: int, epoch: int, step_in_epoch: int
) -> list[np.ndarray]:
    """Each shard's rows of one step: ``spec.workers`` arrays of [R] int64 global rows."""
    return [
        batch_indices(
            n_train,
            s,
            spec.workers,
            spec.batch_size,
            epoch,
            step_in_epoch,
            spec.seed,
            spec.grad_accum_steps,
        )
        for s in range(spec.workers)
    ]


def plan_pieces(
    spec: TrainJobSpec,
    n_train: int,
    epoch: int,
    step_in_epoch: int,
    members: Sequence[str],
    rates: Mapping[str, float | None],
) -> list[Piece]:
    """The pieces of one step under the spec's ``batch_policy``.

    Args:
        spec: the job (workers = shards, batch_size, grad_accum_steps, seed, batch_policy).
        n_train: training rows N.
        epoch: the epoch, from 0.
        step_in_epoch: the step within the epoch, from 0.
        members: the active members' names (proportional: one piece each; fixed: unused).
        rates: member name -> measured samples/s (None: not measured yet).

    Returns:
        fixed: one piece per shard (``shard`` set, no member); proportional: one piece per
        member with rows (``member`` set), in name order, together the same G rows as fixed.
    """
    per_shard = shard_rows(spec, n_train, epoch, step_in_epoch)
    if spec.batch_policy == "fixed" or not members:
        return [Piece(s, rows, s) for s, rows in enumerate(per_shard)]
    global_rows = np.concatenate(per_shard) if per_shard else np.empty(0, np.int64)
    names = sorted(members)
    sizes = proportional_shares(len(global_rows), {n: rates.get(n) for n in names})
    pieces: list[Piece] = []
    start = 0
    for name in names:
        size = sizes.get(name, 0)
        if size:
            pieces.append(Piece(len(pieces), global_rows[start : start + size], -1, name))
        start += size
    return pieces
