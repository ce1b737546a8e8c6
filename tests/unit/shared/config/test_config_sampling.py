"""The ``sampling`` key of a train spec: uniform by default, prioritized's fields and refusals."""

from __future__ import annotations

import pytest

from shared.config import ConfigError, TrainJobSpec, parse_job_spec


def test_the_default_is_uniform_sampling() -> None:
    spec = parse_job_spec({"kind": "train"})

    assert isinstance(spec, TrainJobSpec)
    assert spec.sampling.name == "uniform"


def test_prioritized_short_form_takes_the_defaults() -> None:
    spec = parse_job_spec({"kind": "train", "sampling": "prioritized"})

    assert isinstance(spec, TrainJobSpec)
    s = spec.sampling
    assert (s.name, s.alpha, s.beta, s.beta_final, s.decay_rate, s.priority) == (
        "prioritized",
        0.6,
        0.4,
        1.0,
        0.0,
        "loss",
    )
    assert s.resample_every_steps is None


def test_diloco_windows_of_whole_outer_steps() -> None:
    spec = parse_job_spec(
        {
            "kind": "train",
            "strategy": "diloco",
            "inner_steps": 5,
            "sampling": {"name": "prioritized", "resample_every_steps": 15},
        }
    )

    assert isinstance(spec, TrainJobSpec) and spec.sampling.resample_every_steps == 15


@pytest.mark.parametrize(
    ("sampling", "extra", "message"),
    [
        ({"alpha": -0.1}, {}, "sampling.alpha: Input should be greater than or equal to 0"),
        ({"alpha": float("inf")}, {}, "sampling.alpha: Input should be a finite number"),
        ({"alpha": float("nan")}, {}, "sampling.alpha: Input should be a finite number"),
        ({"beta": 1.01}, {}, "sampling.beta: Input should be less than or equal to 1"),
        ({"beta_final": -0.5}, {}, "sampling.beta_final: Input should be greater than"),
        ({"decay_rate": 1.5}, {}, "sampling.decay_rate: Input should be less than or equal"),
        ({"resample_every_steps": 0}, {}, "sampling.resample_every_steps: Input should be"),
        ({"priority": "td"}, {}, "sampling.priority: Input should be 'loss'"),
        ({"name": "rank"}, {}, "sampling.name: Input should be 'uniform' or 'prioritized'"),
        ({"extra": 1}, {}, "sampling.extra: Extra inputs are not permitted"),
        (
            {},
            {"strategy": "allreduce", "sharding": "fsdp"},
            "sampling.name: prioritized is not supported with sharding fsdp",
        ),
        ({"resample_every_steps": 4}, {}, "sampling.resample_every_steps: only for strategy"),
        (
            {"resample_every_steps": 4},
            {"strategy": "diloco", "inner_steps": 3},
            "sampling.resample_every_steps: 4 is not a multiple of inner_steps (3)",
        ),
    ],
)
def test_bad_sampling_is_refused_naming_the_field(
    sampling: dict[str, object], extra: dict[str, object], message: str
) -> None:
    fields = {"kind": "train", "sampling": {"name": "prioritized"} | sampling} | extra

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_job_spec(fields)


def test_prioritized_allreduce_with_a_window_is_accepted() -> None:
    fields = {"name": "prioritized", "resample_every_steps": 7}
    spec = parse_job_spec({"kind": "train", "strategy": "allreduce", "sampling": fields})

    assert isinstance(spec, TrainJobSpec) and spec.sampling.resample_every_steps == 7


def test_uniform_with_allreduce_is_accepted() -> None:
    spec = parse_job_spec({"kind": "train", "strategy": "allreduce", "sampling": "uniform"})

    assert isinstance(spec, TrainJobSpec) and spec.sampling.name == "uniform"
