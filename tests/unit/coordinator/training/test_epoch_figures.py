"""A train job's epoch figures, against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from coordinator.training.epoch_figures import EpochFigures, convergence


def test_convergence_is_the_initial_loss_over_the_epochs() -> None:
    assert convergence(2.3, 0.5) == pytest.approx(4.6)
    assert math.isnan(convergence(math.nan, 0.5))
    assert math.isnan(convergence(2.3, 0.0))


def test_an_epochs_figures_count_its_steps_only() -> None:
    f = EpochFigures()
    f.set_initial(samples=4, loss_sum=9.2)  # L_0 = 2.3
    # epoch 1: three steps of 10, 20, 60 ms; 1000 bytes and one failure before it
    f.add_step(10.0, wire_bytes=1000, failures=1)
    f.add_step(20.0, wire_bytes=1500, failures=1)
    f.add_step(60.0, wire_bytes=2000, failures=2)

    first = f.end(train_loss=1.15, wire_bytes=3000, failures=2)
    f.add_step(5.0, wire_bytes=3000, failures=2)
    second = f.end(train_loss=0.46, wire_bytes=3500, failures=2)

    assert first == {
        "initial_loss": pytest.approx(2.3),
        "convergence": pytest.approx(2.0),
        "iteration_ms_p50": 20.0,
        "iteration_ms_std": pytest.approx(math.sqrt((20**2 + 10**2 + 30**2) / 3)),
        "wire_bytes": 2000,
        "wire_mbit_s": pytest.approx(2000 * 8 / 1e6 / 0.09),
        "failures": 1,
    }
    assert second["convergence"] == pytest.approx(5.0)
    assert second["wire_bytes"] == 500 and second["failures"] == 0
    assert second["iteration_ms_std"] == 0.0
