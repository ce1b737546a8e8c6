"""The formulae of prioritized training (``coordinator.training.priority_rules``), pinned."""

from __future__ import annotations

import math

import numpy as np
import pytest

from coordinator.training.priority_rules import (
    STRENGTH_FLOOR,
    RunningLoss,
    annealed_beta,
    draw_seed,
    importance_weights,
    strengths_of_losses,
)


def test_the_strength_map_is_monotone_into_the_floor_and_one() -> None:
    losses = np.array([0.0, 0.1, 0.5, 1.0, 2.0, 5.0, 50.0], np.float32)

    s = strengths_of_losses(losses, scale=1.0)

    assert s.dtype == np.float32
    assert s[0] == np.float32(STRENGTH_FLOOR)
    assert (np.diff(s) > 0).all()
    assert s.max() <= 1.0
    # a loss at the running mean: 0.01 + 0.99 (1 - 1/e)
    assert s[3] == pytest.approx(0.01 + 0.99 * (1 - math.exp(-1)), abs=1e-7)


def test_the_strength_map_is_relative_to_the_running_mean() -> None:
    small = strengths_of_losses(np.array([0.02], np.float32), scale=0.01)
    large = strengths_of_losses(np.array([200.0], np.float32), scale=100.0)

    assert small[0] == pytest.approx(large[0], abs=1e-6)  # twice the mean, whatever the scale


def test_non_finite_losses_get_strength_one_and_a_zero_mean_gives_the_floor() -> None:
    s = strengths_of_losses(np.array([np.nan, np.inf, 1.0], np.float32), scale=1.0)
    zero = strengths_of_losses(np.array([0.0, 0.0], np.float32), scale=0.0)

    assert s[:2].tolist() == [1.0, 1.0]
    assert zero.tolist() == [np.float32(STRENGTH_FLOOR)] * 2


def test_importance_weights_follow_schaul_et_al() -> None:
    p = np.array([0.5, 0.25, 0.125, 0.125])

    w = importance_weights(p, n_rows=4, beta=0.5)

    expected = (4 * p) ** -0.5
    np.testing.assert_allclose(w, expected / expected.max(), rtol=1e-7)
    assert w.dtype == np.float32 and w.max() == 1.0
    assert (importance_weights(p, 4, beta=0.0) == 1.0).all()


def test_importance_weights_refuse_bad_probabilities() -> None:
    with pytest.raises(ValueError):
        importance_weights(np.array([0.0, 1.0]), 2, 0.4)
    with pytest.raises(ValueError):
        importance_weights(np.array([0.5]), 0, 0.4)


def test_beta_is_annealed_linearly_to_its_final_value() -> None:
    assert annealed_beta(0.4, 1.0, 0, 11) == 0.4
    assert annealed_beta(0.4, 1.0, 5, 11) == pytest.approx(0.7)
    assert annealed_beta(0.4, 1.0, 10, 11) == 1.0
    assert annealed_beta(0.4, 1.0, 20, 11) == 1.0
    assert annealed_beta(0.4, 1.0, 0, 1) == 0.4  # a one-step job


def test_draw_seeds_are_pinned_and_differ_by_every_input() -> None:
    # Golden value: a change of the derivation changes every prioritized job's draws.
    assert draw_seed(7, 0, 0) == 8592142164568205649
    seeds = {draw_seed(7, 0, 0), draw_seed(8, 0, 0), draw_seed(7, 1, 0), draw_seed(7, 0, 1)}
    assert len(seeds | {draw_seed(7, 0, 0, 1)}) == 5
    assert all(0 <= s < 2**63 for s in seeds)


def test_the_running_mean_skips_non_finite_losses_and_survives_a_checkpoint() -> None:
    running = RunningLoss()
    running.add(np.array([1.0, 3.0, np.inf], np.float32))
    running.add(np.array([2.0], np.float32))

    restored = RunningLoss.from_doc(running.to_doc())

    assert running.mean == 2.0 and running.count == 3
    assert restored == running
    assert RunningLoss.from_doc(None).mean == 0.0
