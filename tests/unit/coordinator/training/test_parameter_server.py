"""The parameter server's training controls: lr schedule, clipping, buffers, fp16 loss scale."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from coordinator.training.aggregation import average_buffers, weighted_average
from coordinator.training.loss_scale import LossScale
from coordinator.training.parameter_server import ParameterServer
from coordinator.training.step_plan import shard_rows
from shared.config import TrainJobSpec
from shared.training.controls import lr_factor
from shared.training.data import Dataset, batch_indices, load_dataset, steps_per_epoch
from shared.training.models import build_model
from tests.fixtures import ALLOWED_MODELS
from worker.training.trainer import Trainer

BN_MODEL = {"entry": "bn_mlp"}
ALLOWED = ALLOWED_MODELS


def make_spec(**overrides: object) -> TrainJobSpec:
    fields = {"kind": "train", "workers": 2, "batch_size": 32, "seed": 0}
    return TrainJobSpec.model_validate(fields | overrides)


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset(make_spec().data, seed=0, test_fraction=0.2)


def zero_grads(ps: ParameterServer) -> dict[str, np.ndarray]:
    return {n: np.zeros_like(a) for n, a in ps.params().items()}


def test_lr_follows_warmup_then_cosine_once_per_step(digits: Dataset) -> None:
    # warm-up 2 steps to 0.1, then cosine from 0.1 to 0.01 over the remaining 4 steps.
    spec = make_spec(
        optimizer={"name": "sgd", "lr": 0.1},
        lr_schedule={"name": "cosine", "warmup_steps": 2, "min_lr_factor": 0.1},
    )
    ps = ParameterServer(spec, digits, total_steps=6)

    lrs = []
    for _ in range(6):
        lrs.append(ps.lr)
        ps.step(zero_grads(ps))

    # by hand: 0.1 * (s + 1) / 2, then 0.01 + 0.09 * (1 + cos(pi * t)) / 2, t = 0, 1/4, ...
    expected = [0.05, 0.1, 0.1, 0.086820, 0.055, 0.023180]
    np.testing.assert_allclose(lrs, expected, atol=1e-6)
    assert lrs == pytest.approx([0.1 * lr_factor(spec, s, 6) for s in range(6)])


def test_step_schedule_multiplies_by_gamma(digits: Dataset) -> None:
    spec = make_spec(lr_schedule={"name": "step", "step_size": 2, "gamma": 0.5})
    ps = ParameterServer(spec, digits, total_steps=10)

    lrs = []
    for _ in range(5):
        lrs.append(ps.lr)
        ps.step(zero_grads(ps))

    np.testing.assert_allclose(lrs, [1e-3, 1e-3, 5e-4, 5e-4, 2.5e-4])


def test_the_averaged_gradient_is_clipped_to_its_global_norm(digits: Dataset) -> None:
    # SGD with lr 1 and no momentum moves each parameter by minus its (clipped) gradient.
    spec = make_spec(optimizer={"name": "sgd", "lr": 1.0, "momentum": 0.0}, clip_grad_norm=0.5)
    ps = ParameterServer(spec, digits)
    before = ps.params()
    grads = {n: np.full(a.shape, 0.01, np.float32) for n, a in before.items()}
    norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))
    assert norm > 0.5

    ps.step(grads)

    after = ps.params()
    for name, g in grads.items():
        np.testing.assert_allclose(before[name] - after[name], g * 0.5 / norm, rtol=1e-4)


def test_adamw_decays_weights_decoupled(digits: Dataset) -> None:
    spec = make_spec(optimizer={"name": "adamw", "lr": 0.1, "weight_decay": 0.5})
    ps = ParameterServer(spec, digits)
    before = ps.params()

    ps.step(zero_grads(ps))  # zero gradients: AdamW's update is the decay alone

    assert isinstance(ps.optimizer, torch.optim.AdamW)
    for name, value in ps.params().items():
        np.testing.assert_allclose(value, before[name] * (1 - 0.1 * 0.5), rtol=1e-6)


def test_float_buffers_are_averaged_by_samples_and_integers_take_the_max() -> None:
    a = {"mean": np.array([1.0, 2.0], np.float32), "n": np.array(4, np.int64)}
    b = {"mean": np.array([4.0, 8.0], np.float32), "n": np.array(5, np.int64)}
    idle = {"mean": np.array([100.0, 100.0], np.float32), "n": np.array(9, np.int64)}

    merged = average_buffers([a, b, idle], [1, 3, 0])

    np.testing.assert_allclose(merged["mean"], [3.25, 6.5])
    assert merged["mean"].dtype == np.float32
    assert merged["n"] == 5 and merged["n"].dtype == np.int64  # the idle shard ran nothing
    assert average_buffers([{}, {}], [1, 1]) == {}


def test_set_buffers_checks_names_and_keeps_dtypes(digits: Dataset) -> None:
    ps = ParameterServer(make_spec(model=BN_MODEL), digits, ALLOWED)
    buffers = ps.buffers()
    assert set(buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}

    ps.set_buffers(buffers | {"1.running_mean": np.full(64, 0.25, np.float32)})

    assert torch.all(ps.model.get_buffer("1.running_mean") == 0.25)
    assert ps.model.get_buffer("1.num_batches_tracked").dtype == torch.int64
    with pytest.raises(ValueError, match=r"buffer names differ: missing \['1.running_var'\]"):
        ps.set_buffers({k: v for k, v in buffers.items() if k != "1.running_var"})


def test_loss_scale_follows_torch_grad_scaler() -> None:
    # The same finite/non-finite sequence through torch's GradScaler and ours.
    param = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    ours = LossScale(enabled=True, growth_interval=3)
    pattern = [True, True, False, True, True, True, True, False, False, True, True, True]

    for finite in pattern:
        loss = scaler.scale(param.sum())  # the scale is made (and read) through a loss
        loss.backward()
        if not finite:
            param.grad = torch.full((3,), float("inf"))
        scaler.step(opt)
        opt.zero_grad()
        scaler.update()
        ours.update(finite)
        assert ours.scale == scaler.get_scale()

    assert LossScale(enabled=False).scale == 1.0


def test_an_fp16_step_with_non_finite_gradients_is_skipped(digits: Dataset) -> None:
    spec = make_spec(precision="fp16", lr_schedule={"name": "linear"})
    ps = ParameterServer(spec, digits, total_steps=4)
    before, lr0 = ps.params(), ps.lr

    stepped = ps.step(None)

    assert not stepped and ps.skipped_steps == 1 and ps.version == 1
    assert ps.loss_scale.scale == 2.0**15
    assert ps.lr < lr0  # the schedule counts skipped steps too
    for name, value in ps.params().items():
        np.testing.assert_array_equal(value, before[name])


def test_state_round_trip_keeps_schedule_loss_scale_and_run(digits: Dataset) -> None:
    spec = make_spec(precision="fp16", lr_schedule={"name": "cosine", "warmup_steps": 2})
    a = ParameterServer(spec, digits, total_steps=8)
    for grads in (zero_grads(a), None, zero_grads(a)):
        a.step(grads)
    b = ParameterServer(spec, digits, total_steps=8)

    run = b.load_state(a.state({"history": {"entries": [{"epoch": 1}]}}))

    assert run == {"history": {"entries": [{"epoch": 1}]}}
    assert (b.version, b.lr, b.loss_scale.state_dict()) == (3, a.lr, a.loss_scale.state_dict())
    a.step(zero_grads(a))
    b.step(zero_grads(b))
    assert b.lr == a.lr


def test_controls_equal_single_process_training(digits: Dataset) -> None:
    """adamw + warm-up/cosine + clipping + 2 micro-batches on 2 shards == one process."""
    spec = make_spec(
        batch_size=16,
        grad_accum_steps=2,
        optimizer={"name": "adamw", "lr": 3e-3, "weight_decay": 0.01},
        lr_schedule={"name": "cosine", "warmup_steps": 3},
        clip_grad_norm=0.5,
    )
    steps = 30  # crosses an epoch (23 steps of 2 x 16 rows per shard)
    per_epoch = steps_per_epoch(len(digits.y_train), 2, 16, 2)
    model = build_model(spec.model, digits.input_shape, digits.num_classes, spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(spec, s, steps))
    x_all, y_all = torch.from_numpy(digits.x_train), torch.from_numpy(digits.y_train)
    for g in range(steps):
        epoch, step = divmod(g, per_epoch)
        n = len(y_all)
        rows = np.concatenate([batch_indices(n, s, 2, 16, epoch, step, 0, 2) for s in range(2)])
        opt.zero_grad()
        nn.functional.cross_entropy(model(x_all[rows]), y_all[rows]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()

    ps = ParameterServer(spec, digits, total_steps=steps)
    trainers = [Trainer(spec, i, 2) for i in range(2)]
    for g in range(steps):
        epoch, step = divmod(g, per_epoch)
        for t in trainers:
            t.set_params(ps.params(), ps.version)
        pieces = shard_rows(spec, len(digits.y_train), epoch, step)
        results = [t.compute_rows(pieces[i]) for i, t in enumerate(trainers)]
        ps.step(weighted_average([r.grads for r in results], [r.samples for r in results]))

    for name, p in model.named_parameters():
        np.testing.assert_allclose(ps.params()[name], p.detach().numpy(), atol=1e-5, err_msg=name)
