"""The rows a running train job serves to its workers, and who may not have them."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.training.train_sets import BadShard, NotJobMember, ShardNotServed, TrainSets
from shared.training.data import Dataset
from shared.training.file_sets import FileSet, open_file_set


def dataset(n_train: int = 10) -> Dataset:
    x = np.arange(n_train * 2, dtype=np.float32).reshape(n_train, 2)
    y = np.arange(n_train, dtype=np.int64) % 3
    return Dataset(x, y, x[:2], y[:2], input_shape=(2,), num_classes=3)


def file_set(tmp_path, n_train: int = 10) -> FileSet:
    """uint8 x and int16 y with x_test given: the training rows are the file's, in order."""
    x = np.arange(n_train * 2, dtype=np.uint8).reshape(n_train, 2)
    y = (np.arange(n_train) % 3).astype(np.int16)
    np.savez(tmp_path / "d.npz", x=x, y=y, x_test=x[:2], y_test=y[:2])
    fs = open_file_set(tmp_path / "d.npz", "classification", None, 0, 0.2)
    fs.set_content_hash("0" * 64)
    return fs


def blocks(rows) -> dict[str, np.ndarray]:
    out: dict[str, list[np.ndarray]] = {}
    for name, _first, block in rows.blocks(5):  # 5 bytes: a few rows a block
        out.setdefault(name, []).append(block)
    return {name: np.concatenate(parts) for name, parts in out.items()}


def test_a_member_gets_its_shard_rows_as_stored(tmp_path) -> None:
    sets = TrainSets()
    sets.open("train-1", file_set(tmp_path), 3, {"w0", "w1"}.__contains__)

    rows = sets.shard("train-1", "w1", 1, 3)
    part = sets.shard("train-1", "w1", 1, 3, 5, 7)

    # 10 rows in 3 shards: [0, 4), [4, 7), [7, 10)
    assert (rows.n_train, rows.input_shape, rows.num_classes) == (10, (2,), 3)
    assert (rows.start, rows.stop, rows.rows_start, rows.rows_stop) == (4, 7, 4, 7)
    assert [(a.name, a.dtype, a.row_shape) for a in rows.arrays] == [
        ("x", "uint8", (2,)),
        ("y", "int16", ()),
    ]
    got = blocks(rows)
    np.testing.assert_array_equal(got["x"], np.array([[8, 9], [10, 11], [12, 13]], np.uint8))
    np.testing.assert_array_equal(got["y"], np.array([1, 2, 0], np.int16))
    assert (part.rows_start, part.rows_stop) == (5, 7)
    np.testing.assert_array_equal(blocks(part)["y"], [2, 0])
    with pytest.raises(BadShard, match=r"rows \[3, 5\) are not within shard \[4, 7\)"):
        sets.shard("train-1", "w1", 1, 3, 3, 5)


def test_a_built_in_set_is_not_fetched() -> None:
    sets = TrainSets()
    sets.open("train-1", dataset(10), 3, {"w0"}.__contains__)

    with pytest.raises(ShardNotServed, match="no file data set"):
        sets.shard("train-1", "w0", 0, 3)


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
