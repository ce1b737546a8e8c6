"""One rank's replica of an allreduce job, without a process group (a world of one)."""

from __future__ import annotations

import pytest
import torch

from shared.config import TrainJobSpec
from shared.training.data import load_dataset
from worker.allreduce.ddp_replica import Replica, StateError


def _replica(**extra: object) -> Replica:
    spec = TrainJobSpec(kind="train", strategy="allreduce", steps=5, batch_size=32, **extra)
    ds = load_dataset(spec.data, spec.seed, spec.test_fraction)
    return Replica(spec, ds.x_train, ds.y_train, ds.num_classes, torch.device("cpu"))


def test_state_round_trips_into_a_fresh_replica() -> None:
    # Arrange: two steps of one replica (adamw, a schedule), then its state.
    a = _replica(optimizer={"name": "adamw"}, lr_schedule={"name": "linear", "warmup_steps": 2})
    model = a.wrap(1)
    assert model is a.model  # one rank: nothing to all-reduce, no DDP wrapper
    stats = [a.train_step(model, 0, 1) for _ in range(2)]
    # Act
    b = _replica(optimizer={"name": "adamw"}, lr_schedule={"name": "linear", "warmup_steps": 2})
    b.load_state(a.state_bytes())
    # Assert: the same step, parameters, optimizer moments and learning rate.
    assert [s.samples for s in stats] == [32, 32] and b.step == a.step == 2
    for (name, p), q in zip(
        a.model.state_dict().items(), b.model.state_dict().values(), strict=True
    ):
        assert torch.equal(p, q), name
    assert b.lr == a.lr
    a.train_step(a.model, 0, 1)
    b.train_step(b.model, 0, 1)
    pairs = zip(a.model.parameters(), b.model.parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)


def test_bytes_that_are_not_a_checkpoint_are_refused() -> None:
    r = _replica()
    with pytest.raises(StateError, match="not a checkpoint of this job"):
        r.load_state(b"not a torch file")
    with pytest.raises(StateError):
        r.load_state(r.model_bytes())  # the model alone is not a full state
    assert r.step == 0
