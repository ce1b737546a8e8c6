"""DiLoCo's step accounting (outer steps of inner steps) and the keys it refuses."""

from __future__ import annotations

import pytest

from shared.config import ConfigError, TrainJobSpec, parse_job_spec
from shared.training.data import inner_total_steps, steps_per_epoch, worker_steps
from shared.training.outer_steps import OuterStep, outer_step, outer_total_steps
from shared.training.partition import allreduce_total_steps

DIGITS_TRAIN = 1437  # 1797 digits, 20% held out


def diloco(**extra: object) -> TrainJobSpec:
    spec = parse_job_spec({"kind": "train", "strategy": "diloco", "workers": 3, **extra})
    assert isinstance(spec, TrainJobSpec)
    return spec


def test_an_epoch_of_15_inner_steps_is_two_outer_steps_of_10_and_5() -> None:
    # digits on 3 workers, batch 32: ceil(479 / 32) = 15 inner steps per epoch.
    spec = diloco(epochs=20, inner_steps=10, batch_size=32)
    assert steps_per_epoch(DIGITS_TRAIN, 3, 32) == 15

    assert inner_total_steps(spec, DIGITS_TRAIN) == 300
    assert outer_total_steps(300, 15, spec.inner_steps) == 40
    assert [outer_step(g, 300, 15, 10) for g in (0, 1, 2, 39)] == [
        OuterStep(0, 0, 0, 10),
        OuterStep(0, 1, 10, 15),
        OuterStep(1, 0, 0, 10),
        OuterStep(19, 1, 10, 15),
    ]


def test_steps_count_inner_steps_and_cut_the_last_outer_step() -> None:
    # 20 inner steps of 15 per epoch, H = 10: [0, 10), [10, 15), then [0, 5) of epoch 1.
    spec = diloco(steps=20, inner_steps=10, batch_size=32)

    assert inner_total_steps(spec, DIGITS_TRAIN) == 20
    assert outer_total_steps(20, 15, spec.inner_steps) == 3
    last = outer_step(2, 20, 15, 10)
    assert last == OuterStep(1, 0, 0, 5) and last.inner_steps == 5
    with pytest.raises(ValueError, match="outside the job"):
        outer_step(3, 20, 15, 10)


@pytest.mark.parametrize(
    ("total_inner", "per_epoch", "h", "expected"),
    [(30, 15, 1, 30), (30, 15, 15, 2), (30, 15, 100, 2), (31, 15, 4, 9), (1, 15, 10, 1)],
)
def test_outer_total_steps(total_inner: int, per_epoch: int, h: int, expected: int) -> None:
    assert outer_total_steps(total_inner, per_epoch, h) == expected
    # the outer steps cover exactly the job's inner steps, once each
    covered = [outer_step(g, total_inner, per_epoch, h) for g in range(expected)]
    assert sum(o.inner_steps for o in covered) == total_inner


def test_fp16_is_refused_with_diloco_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="precision: fp16 is not available with strategy diloco"):
        diloco(precision="fp16")
    assert diloco(precision="bf16", clip_grad_norm=1.0, grad_accum_steps=2).precision == "bf16"


def test_the_work_admission_caps_is_each_workers_optimizer_steps() -> None:
    # diloco: its 300 inner steps, not its 40 outer ones; sync and allreduce: their steps.
    fields = {"kind": "train", "workers": 3, "epochs": 20, "batch_size": 32}
    sync, allreduce = (
        TrainJobSpec.model_validate(fields | {"strategy": s}) for s in ("sync", "allreduce")
    )

    assert worker_steps(diloco(epochs=20, inner_steps=10, batch_size=32), DIGITS_TRAIN) == 300
    assert worker_steps(sync, DIGITS_TRAIN) == inner_total_steps(sync, DIGITS_TRAIN) == 300
    assert worker_steps(allreduce, DIGITS_TRAIN) == allreduce_total_steps(allreduce, DIGITS_TRAIN)
