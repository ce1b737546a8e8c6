"""The network-aware training keys of a train spec: defaults, ranges, per-strategy choices."""

from __future__ import annotations

import pytest

from shared.config import ConfigError, TrainJobSpec, parse_job_spec


def test_defaults_keep_plain_sync_training() -> None:
    spec = parse_job_spec({"kind": "train"})
    assert isinstance(spec, TrainJobSpec)
    assert spec.straggler.mode == "wait"
    assert spec.batch_policy == "fixed"
    assert spec.compression.name == "none"
    assert spec.aggregation == "mean"
    assert spec.max_grad_norm_ratio is None
    assert (spec.inner_steps, spec.outer_lr, spec.outer_momentum) == (10, 0.7, 0.9)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"straggler": {"mode": "fast"}}, "straggler.mode: Input should be 'wait', 'backup'"),
        ({"straggler": {"deadline_factor": 1.0}}, "straggler.deadline_factor"),
        ({"straggler": {"min_fraction": 0}}, "straggler.min_fraction"),
        ({"straggler": {"bogus": 1}}, "straggler.bogus: Extra inputs are not permitted"),
        ({"batch_policy": "greedy"}, "batch_policy"),
        ({"compression": {"name": "zip"}}, "compression.name"),
        ({"compression": {"name": "topk", "ratio": 0}}, "compression.ratio"),
        (
            {"compression": {"name": "powersgd"}},
            "compression.name: 'powersgd' is not available with strategy sync",
        ),
        (
            {"strategy": "allreduce", "compression": {"name": "topk"}},
            "'topk' is not available with strategy allreduce",
        ),
        ({"aggregation": "mode"}, "aggregation"),
        ({"trim": 0.5}, "trim"),
        ({"max_grad_norm_ratio": 1.0}, "max_grad_norm_ratio"),
        ({"health_threshold": 1.0}, "health_threshold"),
        ({"inner_steps": 0}, "inner_steps"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
    ],
)
def test_bad_network_keys_name_the_field(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_job_spec({"kind": "train", **extra})


@pytest.mark.parametrize(
    ("strategy", "name"),
    [("sync", "topk"), ("sync", "int8"), ("diloco", "fp16"), ("allreduce", "powersgd")],
)
def test_compression_names_each_strategy_accepts(strategy: str, name: str) -> None:
    spec = parse_job_spec({"kind": "train", "strategy": strategy, "compression": {"name": name}})
    assert isinstance(spec, TrainJobSpec)
    assert spec.compression.name == name
