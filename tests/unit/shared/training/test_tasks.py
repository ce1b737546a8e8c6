"""The tasks' per-sample losses, metrics and data checks, against values written out here."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from shared.config import FileData
from shared.training.data import load_dataset
from shared.training.entry_points import EntryPointRefused
from shared.training.tasks import DataError, Task, check_targets, evaluate, make_task
from tests.fixtures import ALLOWED_LOSSES


def test_regression_losses_are_per_sample_means_over_the_targets() -> None:
    # Arrange: 2 samples of D = 2 targets.
    out = torch.tensor([[1.0, 2.0], [0.0, 4.0]])
    y = torch.tensor([[0.0, 0.0], [0.0, 1.0]])

    # Act
    mse = make_task("regression").per_sample_loss(out, y)
    huber = make_task("regression", "huber").per_sample_loss(out, y)

    # Assert: mse (1 + 4) / 2, (0 + 9) / 2; huber (0.5 + 1.5) / 2, (0 + 2.5) / 2.
    torch.testing.assert_close(mse, torch.tensor([2.5, 4.5]))
    torch.testing.assert_close(huber, torch.tensor([1.0, 1.25]))


def test_a_scalar_target_takes_a_one_wide_output() -> None:
    out = torch.tensor([[1.0], [3.0]])

    losses = make_task("regression").per_sample_loss(out, torch.tensor([0.0, 1.0]))

    torch.testing.assert_close(losses, torch.tensor([1.0, 4.0]))


def test_a_regression_output_that_does_not_fit_names_both_shapes() -> None:
    with pytest.raises(ValueError, match=r"model output \[2, 3\] does not fit .* \[2, 2\]"):
        make_task("regression").per_sample_loss(torch.zeros(2, 3), torch.zeros(2, 2))


def test_language_model_loss_is_the_mean_over_positions() -> None:
    # Arrange: B = 2, T = 3, V = 4, random logits.
    logits = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([[0, 1, 2], [3, 3, 0]])

    # Act
    losses = make_task("language_model").per_sample_loss(logits, tokens)

    # Assert: -log softmax at each target, averaged per row.
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(losses, -picked.mean(dim=1))


def test_classification_loss_is_todays_cross_entropy() -> None:
    logits = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 2, 1, 1, 0])

    losses = Task("classification").per_sample_loss(logits, y)

    torch.testing.assert_close(losses.mean(), nn.functional.cross_entropy(logits, y))


def test_a_listed_user_loss_is_built_with_its_args_and_checked_for_shape() -> None:
    task = make_task("regression", None, "scaled_abs", ALLOWED_LOSSES, loss_args={"scale": 3})

    losses = task.per_sample_loss(torch.tensor([[1.0], [2.0]]), torch.tensor([0.0, 0.0]))

    torch.testing.assert_close(losses, torch.tensor([3.0, 6.0]))


def test_an_unlisted_user_loss_is_refused() -> None:
    with pytest.raises(EntryPointRefused, match="allowed_losses"):
        make_task("regression", None, "scaled_abs", {})


def test_regression_metrics() -> None:
    # Arrange: a model that answers x itself; targets 0, 1, 2, 3 and predictions 0, 1, 2, 5.
    x = np.array([[0.0], [1.0], [2.0], [5.0]], np.float32)
    y = np.array([0.0, 1.0, 2.0, 3.0], np.float32)

    # Act
    metrics = evaluate(make_task("regression"), nn.Identity(), x, y)

    # Assert: SSE 4, SST 5 (mean 1.5).
    assert metrics["test_mse"] == pytest.approx(1.0)
    assert metrics["test_loss"] == pytest.approx(1.0)
    assert metrics["test_mae"] == pytest.approx(0.5)
    assert metrics["test_r2"] == pytest.approx(1 - 4 / 5)


def test_perplexity_is_exp_of_the_mean_token_loss() -> None:
    # Uniform logits over V = 5: every token costs log 5, perplexity 5.
    class Uniform(nn.Module):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return torch.zeros(*tokens.shape, 5)

    x = np.zeros((3, 4), np.int64)

    metrics = evaluate(make_task("language_model"), Uniform(), x, x)

    assert metrics["test_loss"] == pytest.approx(math.log(5))
    assert metrics["test_perplexity"] == pytest.approx(5.0)


def test_target_checks_name_the_first_bad_row() -> None:
    y = np.zeros((6, 2), np.float32)
    y[4, 1] = np.inf
    tokens = np.zeros((5, 3), np.int64)
    tokens[2, 0] = 9

    with pytest.raises(DataError, match="array 'y' row 4 is NaN or infinite"):
        check_targets("regression", y)
    with pytest.raises(DataError, match=r"array 'x' row 2 has a token id outside \[0, "):
        check_targets("language_model", tokens, 9, "x")
    check_targets("language_model", tokens, 10, "x")  # 9 < 10: fits


def test_a_token_set_without_y_is_split_into_inputs_and_next_tokens(tmp_path: Path) -> None:
    # Arrange: rows 0 1 2 3, 1 2 3 4, ...
    x = (np.arange(20)[:, None] + np.arange(4)[None, :]).astype(np.int32)
    np.savez(tmp_path / "t.npz", x=x)

    # Act
    ds = load_dataset(FileData(path=str(tmp_path / "t.npz")), 0, 0.25, "language_model")

    # Assert
    assert ds.input_shape == (3,) and ds.num_classes == 23
    assert ds.x_train.dtype == np.int64 and ds.y_train.shape == (15, 3)
    np.testing.assert_array_equal(ds.y_train, ds.x_train + 1)
