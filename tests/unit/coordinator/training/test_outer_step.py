"""The steps of ``strategy: diloco`` (and sync's) and its outer Nesterov SGD step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from coordinator.training.diloco import DilocoSteps, outer_controls, plan_outer_pieces
from coordinator.training.parameter_server import ParameterServer
from coordinator.training.step_types import InnerSteps
from coordinator.training.sync import SyncSteps
from shared.config import TrainJobSpec
from shared.training.data import Dataset, batch_indices, load_dataset


def make_spec(**overrides: object) -> TrainJobSpec:
    fields = {
        "kind": "train",
        "strategy": "diloco",
        "workers": 2,
        "model": {"name": "mlp", "hidden": [4]},
        "seed": 0,
    }
    return TrainJobSpec.model_validate(fields | overrides)


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset(make_spec().data, seed=0, test_fraction=0.2)


def ps_at_one(spec: TrainJobSpec, digits: Dataset) -> ParameterServer:
    ps = ParameterServer(spec, digits, controls=lambda model: outer_controls(spec, model))
    with torch.no_grad():
        for p in ps.model.parameters():
            p.fill_(1.0)
    return ps


def constant(ps: ParameterServer, value: float) -> dict[str, np.ndarray]:
    return {n: np.full_like(a, value) for n, a in ps.params().items()}


def test_outer_steps_are_nesterov_sgd_by_hand(digits: Dataset) -> None:
    # Arrange: lr 0.7, momentum 0.9 (the paper's); θ = 1; pseudo-gradients 0.5 then 0.2.
    # A schedule and clipping are the inner steps' and must not touch the outer step.
    spec = make_spec(
        outer_lr=0.7,
        outer_momentum=0.9,
        clip_grad_norm=0.01,
        lr_schedule={"name": "cosine", "warmup_steps": 3},
    )
    ps = ps_at_one(spec, digits)

    # Act
    ps.step(constant(ps, 0.5))
    after_one = ps.params()
    ps.step(constant(ps, 0.2))
    after_two = ps.params()

    # Assert, by hand (Sutskever et al. 2013 in torch's form): b = 0.9 b + Δ; θ -= 0.7 (Δ + 0.9 b)
    # step 1: b = 0.5,  θ = 1 - 0.7 (0.5 + 0.45)    = 0.335
    # step 2: b = 0.65, θ = 0.335 - 0.7 (0.2 + 0.585) = -0.2145
    for name in after_one:
        np.testing.assert_allclose(after_one[name], 0.335, rtol=1e-6)
        np.testing.assert_allclose(after_two[name], -0.2145, rtol=1e-5)
    assert ps.lr == 0.7


def test_zero_momentum_is_plain_sgd(digits: Dataset) -> None:
    ps = ps_at_one(make_spec(outer_lr=1.0, outer_momentum=0.0), digits)

    ps.step(constant(ps, 0.25))

    for a in ps.params().values():
        np.testing.assert_allclose(a, 0.75)


def test_checkpoint_keeps_the_outer_momentum(digits: Dataset) -> None:
    # Arrange: one step, saved; a restored server's second step must use the momentum.
    spec = make_spec()
    ps = ps_at_one(spec, digits)
    ps.step(constant(ps, 0.5))
    restored = ParameterServer(spec, digits, controls=lambda model: outer_controls(spec, model))
    restored.load_state(ps.state())

    # Act
    restored.step(constant(restored, 0.2))

    # Assert: as the uninterrupted run's second step.
    for a in restored.params().values():
        np.testing.assert_allclose(a, -0.2145, rtol=1e-5)


def test_outer_pieces_join_each_shards_inner_steps() -> None:
    # digits, 3 shards of 479 rows, batch 200: inner steps of 200, 200 and 79 rows.
    spec = make_spec(workers=3, batch_size=200)

    fixed = plan_outer_pieces(spec, 1437, 0, range(1, 3), [], {})
    prop = plan_outer_pieces(
        spec.model_copy(update={"batch_policy": "proportional"}),
        1437,
        0,
        range(1, 3),
        ["a", "b"],
        {"a": 1.0, "b": 3.0},
    )

    assert [(p.shard, p.inner_rows) for p in fixed] == [
        (0, (200, 79)),
        (1, (200, 79)),
        (2, (200, 79)),
    ]
    expected = np.concatenate([batch_indices(1437, 2, 3, 200, 0, s, 0) for s in (1, 2)])
    np.testing.assert_array_equal(fixed[2].rows, expected)
    # proportional: each inner step's 600 and 237 rows split 1:3 between the members.
    assert [(p.member, p.inner_rows) for p in prop] == [("a", (150, 59)), ("b", (450, 178))]


def test_diloco_steps_are_outer_steps_of_inner_steps() -> None:
    # digits, 3 shards of 479 rows, batch 32: 15 inner steps an epoch, H = 10: 2 outer.
    spec = make_spec(workers=3, batch_size=32, epochs=20, inner_steps=10)

    steps = DilocoSteps(spec, 1437)
    second = steps.plan(3, [], {})  # epoch 1's second outer step: inner steps 10 to 14

    assert (steps.per_epoch, steps.total, steps.inner_total) == (2, 40, 300)
    assert steps.result_fields() == {"outer_steps": 40, "inner_steps": 300}
    assert second.step_in_epoch == 10
    assert second.inner_steps == InnerSteps(first=15 + 10, total=300)  # the workers' lr
    assert [p.inner_rows for p in second.pieces] == [(32, 32, 32, 32, 31)] * 3
    np.testing.assert_array_equal(
        second.pieces[0].rows,
        np.concatenate([batch_indices(1437, 0, 3, 32, 1, s, 0) for s in range(10, 15)]),
    )


def test_sync_steps_are_the_spec_steps() -> None:
    # inner_steps is diloco's: a sync job's steps are as without it.
    spec = make_spec(strategy="sync", workers=3, batch_size=32, epochs=20, inner_steps=10)

    steps = SyncSteps(spec, 1437)
    plan = steps.plan(17, [], {})  # epoch 1, step 2

    assert (steps.per_epoch, steps.total, steps.result_fields()) == (15, 300, {})
    assert plan.step_in_epoch == 2 and plan.inner_steps is None
    assert [p.inner_rows for p in plan.pieces] == [()] * 3
    np.testing.assert_array_equal(plan.pieces[1].rows, batch_indices(1437, 1, 3, 32, 1, 2, 0))
