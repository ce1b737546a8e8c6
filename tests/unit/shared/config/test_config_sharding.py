"""The ``sharding`` and ``activation_checkpointing`` keys of a train spec."""

from __future__ import annotations

import pytest

from shared.config import ConfigError, TrainJobSpec, parse_job_spec


def test_defaults_keep_whole_replicas_and_activations() -> None:
    spec = parse_job_spec({"kind": "train", "strategy": "allreduce"})
    assert isinstance(spec, TrainJobSpec)
    assert spec.sharding == "none"
    assert spec.activation_checkpointing is False


def test_fsdp_and_activation_checkpointing_with_allreduce() -> None:
    spec = parse_job_spec(
        {
            "kind": "train",
            "strategy": "allreduce",
            "sharding": "fsdp",
            "activation_checkpointing": True,
            "precision": "bf16",
        }
    )
    assert isinstance(spec, TrainJobSpec)
    assert (spec.sharding, spec.activation_checkpointing) == ("fsdp", True)


@pytest.mark.parametrize("strategy", ["sync", "diloco"])
def test_activation_checkpointing_with_every_strategy(strategy: str) -> None:
    spec = parse_job_spec({"kind": "train", "strategy": strategy, "activation_checkpointing": True})
    assert isinstance(spec, TrainJobSpec) and spec.activation_checkpointing


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"strategy": "sync"}, "sharding: fsdp needs strategy allreduce, not sync"),
        ({"strategy": "diloco"}, "sharding: fsdp needs strategy allreduce, not diloco"),
        (
            {"strategy": "allreduce", "compression": {"name": "powersgd"}},
            "compression.name: 'powersgd' is not available with sharding fsdp",
        ),
        (
            {"strategy": "allreduce", "precision": "fp16"},
            "precision: fp16 is not available with sharding fsdp",
        ),
    ],
)
def test_fsdp_refusals_name_the_field(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_job_spec({"kind": "train", "sharding": "fsdp", **extra})


def test_unknown_sharding_is_refused() -> None:
    with pytest.raises(ConfigError, match="sharding"):
        parse_job_spec({"kind": "train", "strategy": "allreduce", "sharding": "zero3"})
