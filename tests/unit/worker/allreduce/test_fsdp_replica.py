"""A sharded replica before any process group: built on the meta device, checked at once."""

from __future__ import annotations

import torch

from shared.config import TrainJobSpec
from shared.training.data import load_dataset
from tests.fixtures import ALLOWED_MODELS
from worker.allreduce.ddp_replica import Replica
from worker.allreduce.fsdp_replica import FsdpReplica, resident_bytes


def _replica(cls: type[Replica], **extra: object) -> Replica:
    spec = TrainJobSpec(kind="train", strategy="allreduce", steps=5, batch_size=32, **extra)
    ds = load_dataset(spec.data, spec.seed, spec.test_fraction)
    return cls(spec, ds.x_train, ds.y_train, ds.num_classes, torch.device("cpu"), ALLOWED_MODELS)


def test_sharded_replica_holds_no_parameters_until_a_generation() -> None:
    r = _replica(FsdpReplica, sharding="fsdp")
    assert r.sharded and not Replica.sharded
    assert {p.device.type for p in r.model.parameters()} == {"meta"}
    assert r.step == 0 and r.total_steps == 5


def test_checkpointed_blocks_of_an_entry_model_build_on_meta() -> None:
    r = _replica(
        FsdpReplica, sharding="fsdp", activation_checkpointing=True, model={"entry": "block_mlp"}
    )
    assert len(r.model.blocks) == 3
    assert list(r.model.state_dict())[:2] == ["stem.weight", "stem.bias"]


def test_resident_bytes_of_a_whole_replica_count_parameters_and_moments() -> None:
    r = _replica(Replica, optimizer={"name": "adam"})
    model = r.wrap(1)
    n = sum(p.numel() for p in r.model.parameters())
    assert resident_bytes(r.model, r.optimizer) == {"params": 4 * n, "optimizer": 0}
    r.train_step(model, 0, 1)
    got = resident_bytes(r.model, r.optimizer)
    assert got["params"] == 4 * n
    assert got["optimizer"] >= 2 * 4 * n  # exp_avg and exp_avg_sq (and the step counts)
