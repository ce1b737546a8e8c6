"""The history's best epoch: the most accurate one, or without accuracy the lowest test loss."""

from __future__ import annotations

import math

from coordinator.training.train_history import TrainHistory, history_task, train_accuracy


def test_without_accuracy_the_best_epoch_has_the_lowest_test_loss() -> None:
    # Arrange: a language model of 8 tokens a sample, 10 samples a second.
    clock = iter(range(0, 100, 1)).__next__
    history = TrainHistory(clock, *history_task("language_model", (8,)))

    # Act: test losses 2.0, 1.5, 1.8.
    history.add_step(10, 20.0)
    first = history.end_epoch(1, 2.0, math.nan, 0.1, {"test_perplexity": math.exp(2.0)})
    second = history.end_epoch(2, 1.5, math.nan, 0.1)
    third = history.end_epoch(3, 1.8, math.nan, 0.1)

    # Assert
    assert (first, second, third) == (True, True, False)
    assert history.best_test_loss == 1.5
    entry = history.entries[0]
    assert entry["test_perplexity"] == math.exp(2.0)
    assert entry["tokens_per_s"] == entry["samples_per_s"] * 8


def test_training_accuracy_is_classifications_only() -> None:
    assert train_accuracy("classification", 3, 4) == 0.75
    assert math.isnan(train_accuracy("regression", 0, 4))
