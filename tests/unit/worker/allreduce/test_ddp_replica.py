"""One rank's replica of an allreduce job, without a process group (a world of one)."""

from __future__ import annotations

import io

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


def test_a_snapshot_holds_the_state_of_its_step_whatever_trains_after_it() -> None:
    # Arrange: a replica one step in, its full state and model snapshots taken there.
    a = _replica(optimizer={"name": "adamw"}, lr_schedule={"name": "linear", "warmup_steps": 2})
    a.train_step(a.model, 0, 1)
    expected_state, expected_model = a.state_bytes(), a.model_bytes()
    state_later, model_later = a.snapshot(model_only=False), a.snapshot(model_only=True)
    # Act: two more steps update the parameters and the optimizer's moments in place.
    a.train_step(a.model, 0, 1)
    a.train_step(a.model, 0, 1)
    # Assert: the snapshots load as the state of step 1, as the bytes made at step 1 do.
    at_step_1, from_bytes = (
        _replica(optimizer={"name": "adamw"}),
        _replica(optimizer={"name": "adamw"}),
    )
    at_step_1.load_state(state_later())
    from_bytes.load_state(expected_state)
    assert at_step_1.step == from_bytes.step == 1
    for (name, p), q in zip(
        at_step_1.model.state_dict().items(), from_bytes.model.state_dict().values(), strict=True
    ):
        assert torch.equal(p, q), name
    moments = at_step_1.optimizer.state_dict()["state"], from_bytes.optimizer.state_dict()["state"]
    for i, st in moments[0].items():
        assert all(torch.equal(v, moments[1][i][k]) for k, v in st.items()), i
    model_b = torch.load(io.BytesIO(model_later()), weights_only=True)
    model_a = torch.load(io.BytesIO(expected_model), weights_only=True)
    assert all(torch.equal(v, model_a[k]) for k, v in model_b.items())
    assert not torch.equal(next(iter(model_b.values())), next(iter(a.model.state_dict().values())))
