"""The worker-side Trainer: gradients of the mean loss over the rows the coordinator names,
parameter updates, errors. A step's rows are the coordinator's (``step_plan.shard_rows``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from coordinator.training.step_plan import shard_rows
from shared.config import TrainJobSpec
from shared.training.data import batch_indices, load_dataset
from shared.training.models import build_model
from tests.fixtures import ALLOWED_MODELS
from worker.training.trainer import DeviceUnavailable, Trainer, TrainerError

BN_MODEL = {"entry": "bn_mlp"}


def make_spec(**overrides: object) -> TrainJobSpec:
    fields = {"kind": "train", "workers": 3, "batch_size": 32, "seed": 0, "model": "mlp"}
    return TrainJobSpec.model_validate(fields | overrides)


def step_rows(t: Trainer, epoch: int, step_in_epoch: int) -> np.ndarray:
    """Trainer t's shard's rows of (epoch, step), as the coordinator plans them (fixed)."""
    return shard_rows(t.spec, t.n_train, epoch, step_in_epoch)[t.shard_index]


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

    result = trainer.compute_rows(step_rows(trainer, epoch=2, step_in_epoch=3))

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

    result = t.compute_rows(step_rows(t, epoch=0, step_in_epoch=2))

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
        t.compute_rows(step_rows(t, 0, 0))


def test_rows_of_another_shard_give_that_shards_gradients(trainer: Trainer) -> None:
    t = Trainer(make_spec(), shard_index=2, shard_count=3)
    t.set_params({n: p.detach().numpy() for n, p in trainer.model.named_parameters()}, 1)

    a, b = t.compute_rows(step_rows(trainer, 0, 0)), trainer.compute_rows(step_rows(trainer, 0, 0))

    assert a.samples == b.samples == 32 and a.loss_sum == pytest.approx(b.loss_sum)
    with pytest.raises(ValueError, match="bad shard"):
        Trainer(make_spec(), shard_index=3, shard_count=3)


def params_of(t: Trainer) -> dict[str, np.ndarray]:
    return {n: a.detach().cpu().numpy().copy() for n, a in t.model.state_dict().items()}


def test_accumulated_micro_batches_equal_one_larger_batch() -> None:
    big = Trainer(make_spec(batch_size=64), shard_index=1, shard_count=3)
    small = Trainer(make_spec(batch_size=16, grad_accum_steps=4), shard_index=1, shard_count=3)
    big.set_params(params_of(big), 0)
    small.set_params(params_of(big), 0)

    a, b = big.compute_rows(step_rows(big, 1, 2)), small.compute_rows(step_rows(small, 1, 2))

    assert a.samples == b.samples == 64 and b.loss_sum == pytest.approx(a.loss_sum, rel=1e-6)
    for name, g in a.grads.items():
        np.testing.assert_allclose(b.grads[name], g, rtol=1e-5, atol=1e-7, err_msg=name)


def test_a_short_last_step_weights_its_micro_batches_by_rows() -> None:
    # 479 rows, 2 micro-batches of 32 per step: the 8th step has 31 rows, one micro-batch.
    big = Trainer(make_spec(batch_size=64), shard_index=1, shard_count=3)
    small = Trainer(make_spec(batch_size=32, grad_accum_steps=2), shard_index=1, shard_count=3)
    big.set_params(params_of(big), 0)
    small.set_params(params_of(big), 0)

    a, b = big.compute_rows(step_rows(big, 0, 7)), small.compute_rows(step_rows(small, 0, 7))

    assert a.samples == b.samples == 479 - 7 * 64
    for name, g in a.grads.items():
        np.testing.assert_allclose(b.grads[name], g, rtol=1e-5, atol=1e-7, err_msg=name)


def test_loss_scaling_is_undone_in_float32_and_overflow_is_reported(trainer: Trainer) -> None:
    rows = step_rows(trainer, 0, 1)
    plain = trainer.compute_rows(rows)

    scaled = trainer.compute_rows(rows, loss_scale=2.0**16)
    overflow = trainer.compute_rows(rows, loss_scale=float("inf"))

    assert plain.finite and scaled.finite and not overflow.finite
    assert scaled.loss_sum == pytest.approx(plain.loss_sum)  # the loss is reported unscaled
    for name, g in plain.grads.items():
        np.testing.assert_allclose(scaled.grads[name], g, rtol=1e-5, atol=1e-8, err_msg=name)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_gradients_are_close_to_fp32(precision: str) -> None:
    ref = Trainer(make_spec(), shard_index=0, shard_count=3)
    low = Trainer(make_spec(precision=precision), shard_index=0, shard_count=3)
    ref.set_params(params_of(ref), 0)
    low.set_params(params_of(ref), 0)

    rows = step_rows(ref, 0, 0)
    a, b = ref.compute_rows(rows), low.compute_rows(rows, loss_scale=1024.0)

    assert b.finite and b.loss_sum == pytest.approx(a.loss_sum, rel=0.02)
    for name, g in a.grads.items():  # same direction within the precision's rounding
        low_g = b.grads[name].ravel().astype(np.float64)
        cosine = low_g @ g.ravel() / (np.linalg.norm(low_g) * np.linalg.norm(g))
        assert b.grads[name].dtype == np.float32 and cosine > 0.99, (name, cosine)


def test_buffers_come_back_with_the_running_statistics_of_the_batch() -> None:
    t = Trainer(make_spec(model=BN_MODEL), 0, 3, allowed_models=ALLOWED_MODELS)
    t.set_params(params_of(t), 0)
    rows = batch_indices(1437, 0, 3, 32, 0, 0, 0)
    x = t.data.gather(rows, 3)[0].reshape(32, -1).astype(np.float64)

    result = t.compute_rows(step_rows(t, 0, 0))

    assert set(result.buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    # torch's BatchNorm: r = (1 - 0.1) r + 0.1 * batch statistic (variance unbiased).
    np.testing.assert_allclose(result.buffers["1.running_mean"], 0.1 * x.mean(0), atol=1e-6)
    np.testing.assert_allclose(
        result.buffers["1.running_var"], 0.9 + 0.1 * x.var(0, ddof=1), atol=1e-6
    )
    assert result.buffers["1.num_batches_tracked"] == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_without_a_cuda_device_is_refused() -> None:
    with pytest.raises(DeviceUnavailable, match="device: cuda asked for"):
        Trainer(make_spec(device="cuda"), 0, 3, daemon="worker w0")


@pytest.mark.gpu
def test_the_model_and_batches_live_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    t = Trainer(make_spec(device="cuda"), 0, 3)
    t.set_params(params_of(t), 0)

    result = t.compute_rows(step_rows(t, 0, 0))

    assert all(p.is_cuda for p in t.model.parameters())
    assert result.samples == 32 and all(g.dtype == np.float32 for g in result.grads.values())


def test_importance_weights_give_the_gradient_of_the_weighted_mean_and_the_losses(
    trainer: Trainer,
) -> None:
    # 70 rows from several shards: three micro-batches of 32, 32 and 6.
    rows = np.arange(100, 170, dtype=np.int64)
    weights = np.linspace(0.1, 1.0, len(rows)).astype(np.float32)
    model = build_model(make_spec().model, (1, 8, 8), 10, seed=0)
    full = load_dataset(make_spec().data, seed=0, test_fraction=make_spec().test_fraction)
    x, y = torch.from_numpy(full.x_train[rows]), torch.from_numpy(full.y_train[rows])
    per = nn.functional.cross_entropy(model(x), y, reduction="none")
    (per * torch.from_numpy(weights)).mean().backward()

    result = trainer.compute_rows(rows, weights=weights)

    assert result.losses is not None and result.losses.dtype == np.float32
    np.testing.assert_allclose(result.losses, per.detach().numpy(), rtol=1e-5)
    assert result.loss_sum == pytest.approx(float(per.detach().sum()), rel=1e-5)  # unweighted
    for name, p in model.named_parameters():
        np.testing.assert_allclose(result.grads[name], p.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_without_weights_no_losses_come_back_and_a_misaligned_weighting_is_refused(
    trainer: Trainer,
) -> None:
    rows = step_rows(trainer, 0, 0)

    assert trainer.compute_rows(rows).losses is None
    with pytest.raises(ValueError, match="weights: 3 values for 32 rows"):
        trainer.compute_rows(rows, weights=np.ones(3, np.float32))
