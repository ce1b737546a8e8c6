"""The worker-side Trainer: shard gradients of the mean loss, parameter updates, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from shared.config import TrainJobSpec
from shared.training.data import batch_indices, load_dataset
from shared.training.models import build_model
from worker.trainer import Trainer, TrainerError


def make_spec(**overrides: object) -> TrainJobSpec:
    fields = {"kind": "train", "workers": 3, "batch_size": 32, "seed": 0, "model": "mlp"}
    return TrainJobSpec.model_validate(fields | overrides)


@pytest.fixture
def trainer() -> Trainer:
    t = Trainer(make_spec(), shard_index=1, shard_count=3)
    t.set_params({n: p.detach().numpy() for n, p in t.model.named_parameters()}, version=0)
    return t


def test_shard_size_and_version(trainer: Trainer) -> None:
    assert trainer.train_samples == 479  # 1437 digits training rows / 3
    assert trainer.params_version == 0


def test_gradients_are_of_the_mean_loss_over_the_shard_batch(trainer: Trainer) -> None:
    rows = batch_indices(1437, 1, 3, 32, epoch=2, step_in_epoch=3, seed=0)
    model = build_model(make_spec().model, (1, 8, 8), 10, seed=0)
    full = load_dataset(make_spec().data, seed=0, test_fraction=make_spec().test_fraction)
    x = torch.from_numpy(full.x_train[rows])
    y = torch.from_numpy(full.y_train[rows])
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()

    result = trainer.compute_gradients(epoch=2, step_in_epoch=3)

    assert result.samples == 32 and result.compute_s > 0
    assert result.loss_sum == pytest.approx(loss.item() * 32, rel=1e-5)
    assert 0 <= result.correct <= 32
    for name, p in model.named_parameters():
        assert result.grads[name].dtype == np.float32
        np.testing.assert_allclose(result.grads[name], p.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_exhausted_shard_returns_zero_grads() -> None:
    # 1437 rows, batch 400: each shard (479 rows) has 2 steps; step 2 is past the end.
    t = Trainer(make_spec(batch_size=400), shard_index=0, shard_count=3)
    t.set_params({n: p.detach().numpy() for n, p in t.model.named_parameters()}, version=4)

    result = t.compute_gradients(epoch=0, step_in_epoch=2)

    assert result.samples == 0 and result.loss_sum == 0.0 and result.correct == 0
    assert set(result.grads) == {n for n, _ in t.model.named_parameters()}
    assert all(not g.any() for g in result.grads.values())


def test_set_params_overwrites_the_replica(trainer: Trainer) -> None:
    params = {n: np.full(p.shape, 0.5, np.float32) for n, p in trainer.model.named_parameters()}
    for a in params.values():
        a.flags.writeable = False  # as decoded from wire bytes

    trainer.set_params(params, version=7)

    assert trainer.params_version == 7
    assert all(torch.all(p == 0.5) for p in trainer.model.parameters())


def test_set_params_rejects_mismatched_names_and_shapes(trainer: Trainer) -> None:
    good = {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters()}
    first = next(iter(good))

    with pytest.raises(ValueError, match="missing"):
        trainer.set_params({k: v for k, v in good.items() if k != first}, version=9)
    with pytest.raises(ValueError, match=f"parameter '{first}': expected shape"):
        trainer.set_params(good | {first: np.zeros((1, 1), np.float32)}, version=9)
    assert trainer.params_version != 9


def test_gradients_need_parameters_first() -> None:
    t = Trainer(make_spec(), shard_index=0, shard_count=3)

    with pytest.raises(TrainerError, match="no parameters set"):
        t.compute_gradients(0, 0)


def test_set_shard_takes_over_another_shard(trainer: Trainer) -> None:
    t = Trainer(make_spec(), shard_index=2, shard_count=3)
    t.set_params({n: p.detach().numpy() for n, p in trainer.model.named_parameters()}, 1)

    t.set_shard(1, 3)

    a, b = t.compute_gradients(0, 0), trainer.compute_gradients(0, 0)
    assert t.train_samples == trainer.train_samples and a.loss_sum == pytest.approx(b.loss_sum)
    with pytest.raises(ValueError, match="bad shard"):
        t.set_shard(3, 3)
