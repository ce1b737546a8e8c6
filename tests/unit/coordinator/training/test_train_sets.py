"""The rows a running train job serves to its workers, and who may not have them."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.training.train_sets import BadShard, NotJobMember, ShardNotServed, TrainSets
from shared.training.data import Dataset


def dataset(n_train: int = 10) -> Dataset:
    x = np.arange(n_train * 2, dtype=np.float32).reshape(n_train, 2)
    y = np.arange(n_train, dtype=np.int64) % 3
    return Dataset(x, y, x[:2], y[:2], input_shape=(2,), num_classes=3)


def test_a_member_gets_its_shard_rows() -> None:
    sets = TrainSets()
    sets.open("train-1", dataset(10), 3, {"w0", "w1"}.__contains__)

    rows = sets.shard("train-1", "w1", 1, 3)

    # 10 rows in 3 shards: [0, 4), [4, 7), [7, 10)
    assert (rows.n_train, rows.input_shape, rows.num_classes) == (10, (2,), 3)
    assert (rows.start, rows.stop) == (4, 7)
    np.testing.assert_array_equal(rows.x, [[8, 9], [10, 11], [12, 13]])
    np.testing.assert_array_equal(rows.y, [1, 2, 0])


def test_refusals() -> None:
    sets = TrainSets()
    sets.open("train-1", dataset(), 2, {"w0"}.__contains__)

    with pytest.raises(ShardNotServed, match="no running train job 'train-2'"):
        sets.shard("train-2", "w0", 0, 2)
    with pytest.raises(NotJobMember, match="worker 'w9' is not part of job 'train-1'"):
        sets.shard("train-1", "w9", 0, 2)
    with pytest.raises(BadShard, match="has 2 shards"):
        sets.shard("train-1", "w0", 0, 3)
    with pytest.raises(BadShard):
        sets.shard("train-1", "w0", 2, 2)


def test_a_closed_job_serves_nothing() -> None:
    sets = TrainSets()
    sets.open("train-1", dataset(), 1, lambda _name: True)

    sets.close("train-1")
    sets.close("train-1")  # idempotent

    assert "train-1" not in sets
    with pytest.raises(ShardNotServed):
        sets.shard("train-1", "w0", 0, 1)
