"""``window_losses``: the ranks' per-sample losses back in draw order, or nothing."""

from __future__ import annotations

import numpy as np

from coordinator.training.allreduce_windows import AllreduceSteps, window_losses

# 10 rows, G = 4: an epoch is steps of 4, 4 and 2 rows


def _steps() -> AllreduceSteps:
    return AllreduceSteps(n_train=10, global_batch=4, per_epoch=3, total=6)


def test_two_ranks_losses_are_put_back_in_draw_order() -> None:
    # Arrange: step 1 (4 rows: ranks take 2 and 2), step 2 (2 rows: 1 and 1)
    a = np.array([10, 11, 20], "<f4").tobytes()  # rank 0: rows 0-1 of step 1, row 0 of step 2
    b = np.array([12, 13, 21], "<f4").tobytes()

    # Act
    out = window_losses(_steps(), ["w0", "w1"], {"w0": (1, a), "w1": (1, b)}, stop=3)

    # Assert
    assert sorted(out) == [1, 2]
    assert out[1].tolist() == [10, 11, 12, 13] and out[2].tolist() == [20, 21]
    assert _steps().plan(2, [], {}).pieces[0].rows.shape == (2,)


def test_a_missing_rank_or_short_losses_give_nothing() -> None:
    a = np.array([10, 11, 20], "<f4").tobytes()
    short = np.array([12], "<f4").tobytes()

    assert window_losses(_steps(), ["w0", "w1"], {"w0": (1, a)}, stop=3) == {}
    assert window_losses(_steps(), ["w0", "w1"], {"w0": (1, a), "w1": (1, short)}, stop=3) == {}
    assert window_losses(_steps(), ["w0", "w1"], {"w0": (1, a), "w1": (0, a)}, stop=3) == {}
