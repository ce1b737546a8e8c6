"""The rows of each ComputeGradients call of a sync step (``plan_pieces``).

The reference rows are ``batch_indices`` per shard, the global batch whatever the policy.
"""

from __future__ import annotations

import numpy as np

from coordinator.training.step_plan import plan_pieces
from shared.config import TrainJobSpec
from shared.training.data import batch_indices

N_TRAIN = 120
BATCH = 8


SEED = 3


def spec(batch_policy: str) -> TrainJobSpec:
    return TrainJobSpec(
        kind="train", workers=3, batch_size=BATCH, seed=SEED, batch_policy=batch_policy
    )


def shard_rows(epoch: int, step_in_epoch: int, n_train: int = N_TRAIN) -> list[np.ndarray]:
    """Each shard's rows of one step: the reference, independent of ``plan_pieces``."""
    return [batch_indices(n_train, s, 3, BATCH, epoch, step_in_epoch, SEED) for s in range(3)]


def test_fixed_pieces_are_the_shards_rows() -> None:
    expected = shard_rows(1, 2)

    planned = plan_pieces(spec("fixed"), N_TRAIN, 1, 2, ["a", "b"], {"a": 1.0, "b": 5.0})

    assert [(p.index, p.shard, p.member) for p in planned] == [
        (0, 0, None),
        (1, 1, None),
        (2, 2, None),
    ]
    for piece, rows in zip(planned, expected, strict=True):
        np.testing.assert_array_equal(piece.rows, rows)


def test_proportional_pieces_cut_the_same_rows_by_rate() -> None:
    fixed_rows = np.concatenate(shard_rows(0, 1))

    planned = plan_pieces(
        spec("proportional"), N_TRAIN, 0, 1, ["c", "a", "b"], {"a": 1.0, "b": 2.0, "c": 3.0}
    )

    assert [(p.index, p.shard, p.member, len(p.rows)) for p in planned] == [
        (0, -1, "a", 4),
        (1, -1, "b", 8),
        (2, -1, "c", 12),
    ]
    np.testing.assert_array_equal(np.concatenate([p.rows for p in planned]), fixed_rows)
    assert all(p.rows.dtype == np.int64 for p in planned)


def test_proportional_with_equal_rates_matches_the_fixed_sizes() -> None:
    fixed = plan_pieces(spec("fixed"), N_TRAIN, 0, 0, [], {})

    planned = plan_pieces(spec("proportional"), N_TRAIN, 0, 0, ["a", "b", "c"], {})

    assert [len(p.rows) for p in planned] == [len(p.rows) for p in fixed] == [BATCH] * 3
    np.testing.assert_array_equal(
        np.concatenate([p.rows for p in planned]), np.concatenate([p.rows for p in fixed])
    )


def test_proportional_pieces_of_a_short_last_step_are_its_fixed_rows() -> None:
    # 100 rows in shards of 34, 33, 33: step 4 takes rows 32.. of each, 2 + 1 + 1 rows.
    fixed_rows = shard_rows(0, 4, n_train=100)

    planned = plan_pieces(spec("proportional"), 100, 0, 4, ["a", "b", "c"], {})

    assert [len(r) for r in fixed_rows] == [2, 1, 1]
    assert [len(p.rows) for p in planned] == [2, 1, 1]
    np.testing.assert_array_equal(
        np.concatenate([p.rows for p in planned]), np.concatenate(fixed_rows)
    )
