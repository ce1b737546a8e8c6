"""DiLoCo's inner loop on a worker: ``LocalSteps.run`` against ``Trainer.compute_rows``."""

from __future__ import annotations

import numpy as np
import pytest

from shared.config import TrainJobSpec
from shared.training.data import batch_indices
from worker.training.diloco import InnerSteps, LocalSteps, legacy_inner_steps
from worker.training.trainer import Trainer
from worker.training.training_sessions import TrainingSessions

LR = 0.05
FIRST = InnerSteps(first=0, total=15)  # a constant lr: where the steps are does not matter
STEP_2 = InnerSteps(first=2, total=15)


def make_local(**overrides: object) -> LocalSteps:
    fields = {
        "kind": "train",
        "strategy": "diloco",
        "workers": 3,
        "batch_size": 32,
        "seed": 0,
        "model": {"name": "mlp", "hidden": [16]},
        "optimizer": {"name": "sgd", "lr": LR, "momentum": 0.0},
    }
    t = Trainer(TrainJobSpec.model_validate(fields | overrides), shard_index=1, shard_count=3)
    t.set_params(params_of(t), version=0)
    return LocalSteps(t)


def params_of(t: Trainer) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in t.model.named_parameters()}


def rows_of(step: int) -> np.ndarray:
    return batch_indices(1437, 1, 3, 32, epoch=0, step_in_epoch=step, seed=0)


def test_one_sgd_step_gives_lr_times_the_gradient() -> None:
    # Arrange: SGD without momentum, H = 1: Δ = θ - (θ - lr g) = lr g.
    local = make_local()
    rows = rows_of(0)
    grads = local.trainer.compute_rows(rows).grads

    # Act
    res = local.run(rows, [len(rows)], FIRST)

    # Assert
    assert res.finite and res.samples == 32
    for name, g in grads.items():
        assert res.grads[name].dtype == np.float32
        np.testing.assert_allclose(res.grads[name], LR * g, rtol=1e-4, atol=1e-7)


def test_inner_rows_are_consecutive_steps_each_from_the_last() -> None:
    # Arrange: two inner steps by hand: g1 at θ0 on batch 1, g2 at θ0 - lr g1 on batch 2.
    local = make_local()
    t = local.trainer
    b1, b2 = rows_of(0), rows_of(1)
    theta0 = params_of(t)
    step1 = t.compute_rows(b1)
    theta1 = {n: theta0[n] - LR * step1.grads[n] for n in theta0}
    t.set_params(theta1, version=1)
    step2 = t.compute_rows(b2)
    expected = {n: LR * (step1.grads[n] + step2.grads[n]) for n in theta0}
    t.set_params(theta0, version=2)

    # Act
    res = local.run(np.concatenate([b1, b2]), [32, 32], FIRST)

    # Assert: Δ = θ0 - θ2; losses summed over both steps.
    for name in theta0:
        np.testing.assert_allclose(res.grads[name], expected[name], rtol=1e-4, atol=1e-6)
    assert res.samples == 64
    assert res.loss_sum == pytest.approx(step1.loss_sum + step2.loss_sum, rel=1e-5)
    assert res.correct == step1.correct + step2.correct


def test_every_call_starts_from_the_set_parameters() -> None:
    # Two pieces of one outer step on one worker (a dead worker's shard taken over): the
    # second starts from θ_start too, not from where the first one's steps ended; between
    # them the replica holds θ_start, the parameters of its version.
    local = make_local()
    theta0 = params_of(local.trainer)
    rows = rows_of(0)

    first = local.run(rows, [32], FIRST)
    between = params_of(local.trainer)
    second = local.run(rows, [32], FIRST)

    for name in first.grads:
        np.testing.assert_allclose(second.grads[name], first.grads[name], rtol=1e-6)
        np.testing.assert_array_equal(between[name], theta0[name])
    assert local.trainer.params_version == 0


def test_inner_adam_state_carries_across_outer_steps() -> None:
    # Adam's moments from outer step 1 (batch 0) change outer step 2's move on batch 1,
    # compared with a worker whose first outer step is on batch 1.
    kept, fresh = (make_local(optimizer={"name": "adamw", "lr": 0.01}) for _ in range(2))
    theta0 = params_of(kept.trainer)
    kept.run(rows_of(0), [32], FIRST)
    kept.trainer.set_params(theta0, version=1)

    with_state = kept.run(rows_of(1), [32], FIRST)
    without = fresh.run(rows_of(1), [32], FIRST)

    for name in with_state.grads:
        assert not np.allclose(with_state.grads[name], without.grads[name], rtol=1e-2)


def test_inner_rows_must_split_the_rows() -> None:
    local = make_local()
    with pytest.raises(ValueError, match="inner_rows"):
        local.run(rows_of(0), [16, 8], FIRST)


def test_each_inner_step_takes_the_lr_of_its_job_wide_step() -> None:
    # Arrange: warm-up over 4 steps, so job-wide inner step 2 has lr 3/4 LR: Δ = 3/4 LR g.
    local = make_local(lr_schedule={"name": "constant", "warmup_steps": 4})
    rows = rows_of(0)
    grads = local.trainer.compute_rows(rows).grads

    # Act
    res = local.run(rows, [len(rows)], STEP_2)

    # Assert
    for name, g in grads.items():
        np.testing.assert_allclose(res.grads[name], 0.75 * LR * g, rtol=1e-4, atol=1e-7)


def test_a_coordinator_without_inner_steps_in_its_header_gets_them_computed() -> None:
    # digits on 3 workers, batch 32: 15 inner steps an epoch, 2 epochs.
    spec = make_local(epochs=2).trainer.spec
    sync = spec.model_copy(update={"strategy": "sync"})

    assert legacy_inner_steps(spec, 1437, epoch=1, step_in_epoch=10) == InnerSteps(25, 30)
    assert legacy_inner_steps(sync, 1437, epoch=1, step_in_epoch=10) is None


async def test_the_sessions_run_the_inner_steps_the_header_names() -> None:
    # Arrange: warm-up over 4 steps. The coordinator names job-wide inner step 2 (lr 3/4);
    # without the field, the worker's own count from (epoch 0, step 0) gives step 0 (lr 1/4).
    spec = make_local(lr_schedule={"name": "constant", "warmup_steps": 4}).trainer.spec
    sessions = TrainingSessions(torch_threads=1)
    try:
        await sessions.start("job", spec.model_dump_json(by_alias=True), 1, 3)
        trainer = sessions.get("job")
        await sessions.set_params(trainer, params_of(trainer), version=0)
        rows = rows_of(0)

        # Act
        named = await sessions.compute("job", trainer, 0, 0, rows, 1.0, [32], STEP_2)
        legacy = await sessions.compute("job", trainer, 0, 0, rows, 1.0, [32])
    finally:
        sessions.close()

    # Assert: SGD without momentum, one step: Δ = lr g, three times larger at step 2.
    for name, delta in named.grads.items():
        np.testing.assert_allclose(delta, 3 * legacy.grads[name], rtol=1e-4, atol=1e-7)
