"""A worker's shards of a job's training set: fetched rows train exactly like local ones,
malformed rows are refused, and a file data set is never opened on a worker."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.training.step_plan import shard_rows
from shared.config import TrainJobSpec
from shared.training.data import DataError, load_dataset, shard_bounds
from worker.training.shards import ShardMissing, ShardRows, TrainData
from worker.training.trainer import Trainer


def make_spec(**overrides: object) -> TrainJobSpec:
    fields = {"kind": "train", "workers": 3, "batch_size": 32, "seed": 0, "model": "mlp"}
    return TrainJobSpec.model_validate(fields | overrides)


def fetched_like(spec: TrainJobSpec, shards: list[int]) -> TrainData:
    """A TrainData holding only some shards, as the coordinator would send them."""
    ds = load_dataset(spec.data, spec.seed, spec.test_fraction)
    data = TrainData(len(ds.y_train), ds.input_shape, ds.num_classes)
    for s in shards:
        start, stop = shard_bounds(len(ds.y_train), s, spec.workers)
        rows = ShardRows(start, stop, ds.x_train[start:stop].copy(), ds.y_train[start:stop].copy())
        data.add((s, spec.workers), rows)
    return data


def test_fetched_shards_give_the_gradients_of_the_whole_local_set() -> None:
    spec = make_spec()
    local = Trainer(spec, shard_index=1, shard_count=3)
    remote = Trainer(spec, shard_index=1, shard_count=3, data=fetched_like(spec, [1, 2]))
    params = {n: p.detach().numpy() for n, p in local.model.named_parameters()}
    local.set_params(params, 0)
    remote.set_params(params, 0)

    for shard in (1, 2):
        rows = shard_rows(spec, local.n_train, 1, 2)[shard]
        a, b = local.compute_rows(rows), remote.compute_rows(rows)
        assert (a.samples, a.correct) == (b.samples, b.correct)
        assert a.loss_sum == b.loss_sum
        for name in a.grads:
            np.testing.assert_array_equal(a.grads[name], b.grads[name])


def test_a_shard_not_held_must_be_fetched_first() -> None:
    spec = make_spec()
    trainer = Trainer(spec, shard_index=0, shard_count=3, data=fetched_like(spec, [0]))
    trainer.set_params({n: p.detach().numpy() for n, p in trainer.model.named_parameters()}, 0)

    with pytest.raises(ShardMissing, match="shard 2 of 3 is not held here"):
        trainer.compute_rows(shard_rows(spec, trainer.n_train, 0, 0)[2])
    with pytest.raises(ShardMissing, match="shard 2 of 3 is not held here"):
        Trainer(spec, shard_index=2, shard_count=3, data=fetched_like(spec, [0]))


def test_a_file_data_set_is_never_opened_on_a_worker(tmp_path) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((10, 2), np.float32), y=np.arange(10) % 2)
    spec = make_spec(data={"path": str(path)})

    with pytest.raises(DataError, match="a worker does not open data files"):
        Trainer(spec, shard_index=0, shard_count=3)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (ShardRows(0, 3, np.zeros((3, 4), np.float32), np.zeros(3, np.int64)), "got rows"),
        (ShardRows(0, 4, np.zeros((3, 4), np.float32), np.zeros(4, np.int64)), "x must have 4"),
        (ShardRows(0, 4, np.zeros((4, 4), np.float32), np.zeros(5, np.int64)), "y must have 4"),
    ],
)
def test_malformed_rows_are_refused(rows: ShardRows, message: str) -> None:
    data = TrainData(n_train=10, input_shape=(4,), num_classes=3)  # shard 0 of 3: rows [0, 4)

    with pytest.raises(DataError, match=message):
        data.add((0, 3), rows)
    assert not data.has((0, 3))


def test_rows_as_stored_are_converted_a_batch_at_a_time() -> None:
    data = TrainData(n_train=4, input_shape=(2,), num_classes=3)
    data.add((0, 1), ShardRows(0, 4, np.arange(8, dtype=np.uint8).reshape(4, 2), np.arange(4) % 3))

    x, y = data.gather(np.array([3, 0]), 1)

    assert (x.dtype, y.dtype) == (np.float32, np.int64)
    np.testing.assert_array_equal(x, [[6, 7], [0, 1]])
    np.testing.assert_array_equal(y, [0, 0])


def test_labels_outside_the_outputs_fail_the_batch_naming_the_array() -> None:
    data = TrainData(n_train=4, input_shape=(2,), num_classes=3)
    data.add((0, 1), ShardRows(0, 4, np.zeros((4, 2), np.float16), np.array([0, 1, 2, 3])))

    with pytest.raises(DataError, match=r"y: labels or tokens outside \[0, 3\)"):
        data.gather(np.array([3]), 1)
