"""Which training rows each rank of an ``allreduce`` job trains on, whatever its world size.

The job's global batch is fixed by the spec, ``G = workers x batch_size x grad_accum_steps``
rows per optimizer step, and so is the order of an epoch's rows: one seeded permutation of
the training split per epoch. Step ``s`` of epoch ``e`` takes the rows
``perm_e[s * G : (s + 1) * G]``; a generation of ``W`` ranks splits them into ``W``
contiguous parts like ``np.array_split``. Nothing depends on who trained the earlier steps,
so when the world changes mid-epoch (a worker died, one joined), the next step is split over
the new ranks and every row of the epoch is still trained on exactly once.

Shapes: N training rows; G rows per global step; W ranks.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from shared.config import TrainJobSpec


def global_batch_size(spec: TrainJobSpec) -> int:
    """Rows per optimizer step, G = workers x batch_size x grad_accum_steps."""
    return spec.workers * spec.batch_size * spec.grad_accum_steps


def allreduce_steps_per_epoch(n_train: int, global_batch: int) -> int:
    """Optimizer steps in one epoch, ceil(N / G); the last step of an epoch may be short.

    Args:
        n_train: training rows N >= 0.
        global_batch: G >= 1.
    """
    return max(math.ceil(n_train / global_batch), 1)


def allreduce_total_steps(spec: TrainJobSpec, n_train: int) -> int:
    """Optimizer steps of an allreduce job: ``spec.steps``, else epochs x steps per epoch."""
    if spec.steps is not None:
        return spec.steps
    per_epoch = allreduce_steps_per_epoch(n_train, global_batch_size(spec))
    return (spec.epochs if spec.epochs is not None else 1) * per_epoch


def epoch_permutation(n_train: int, seed: int, epoch: int) -> npt.NDArray[np.int64]:
    """The order of an epoch's rows: ``np.random.default_rng((seed, epoch, 7)).permutation(N)``.

    The 7 keeps this stream apart from the sync strategy's per-shard permutations.

    Returns:
        [N] int64, a permutation of 0..N-1.
    """
    return np.random.default_rng((seed, epoch, 7)).permutation(n_train).astype(np.int64)


def step_rows(n_train: int, global_batch: int, step_in_epoch: int) -> int:
    """How many rows step ``step_in_epoch`` of an epoch takes: G, fewer at the end, then 0."""
    return max(0, min(global_batch, n_train - step_in_epoch * global_batch))


def global_rows(
    n_train: int, global_batch: int, seed: int, epoch: int, step_in_epoch: int
) -> npt.NDArray[np.int64]:
    """The training rows of one global step: ``perm_e[s * G : (s + 1) * G]``.

    Args:
        n_train: training rows N.
        global_batch: G.
        seed: the job's seed.
        epoch: the epoch, from 0.
        step_in_epoch: the step within the epoch, from 0.

    Returns:
        [G'] int64 row indices into the training split, G' = ``step_rows(...)`` <= G (short
        at an epoch's end, empty past it); ``perm_e`` is ``epoch_permutation``.
    """
    perm = epoch_permutation(n_train, seed, epoch)
    return perm[step_in_epoch * global_batch : (step_in_epoch + 1) * global_batch]


def rank_rows(rows: npt.NDArray[np.int64], rank: int, world_size: int) -> npt.NDArray[np.int64]:
    """Rank ``rank``'s contiguous part of a global step's rows (``np.array_split`` order).

    Args:
        rows: [G'] int64, the step's rows.
        rank: in [0, world_size).
        world_size: W >= 1.

    Raises:
        ValueError: rank outside [0, world_size).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    size, extra = divmod(len(rows), world_size)
    start = rank * size + min(rank, extra)
    return rows[start : start + size + (rank < extra)]


def micro_batches(
    rows: npt.NDArray[np.int64], grad_accum_steps: int
) -> list[npt.NDArray[np.int64]]:
    """Split one rank's rows of a step into ``grad_accum_steps`` consecutive micro-batches.

    Some may be empty when the rank has fewer rows than micro-batches.
    """
    return list(np.array_split(rows, grad_accum_steps))
