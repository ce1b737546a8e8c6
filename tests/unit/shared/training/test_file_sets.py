"""A file data set opened for a task: the split of the in-memory loader, on row indices."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sklearn.model_selection import train_test_split

from shared.training import file_sets
from shared.training.file_sets import open_file_set
from shared.training.tasks import DataError


def blobs(n: int = 50) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.integers(0, 9, size=(n, 3)).astype(np.int32), "y": np.arange(n) % 3}


def test_the_split_is_sklearns_on_the_arrays(tmp_path: Path) -> None:
    # Arrange: a reference that splits the converted arrays themselves, as the loader did
    arrays = blobs()
    np.savez(tmp_path / "d.npz", **arrays)
    x = arrays["x"].astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, arrays["y"], test_size=10, random_state=4, stratify=arrays["y"]
    )

    # Act
    fs = open_file_set(tmp_path / "d.npz", "classification", None, 4, 0.2)
    x_train, y_train = fs.train_batch(np.arange(fs.n_train))
    ((x_test, y_test),) = list(fs.test_batches(100))

    # Assert
    np.testing.assert_array_equal(x_train, x_tr)
    np.testing.assert_array_equal(y_train, y_tr)
    np.testing.assert_array_equal(x_test, x_te)
    np.testing.assert_array_equal(y_test, y_te)
    assert (fs.input_shape, fs.num_classes, x_train.dtype) == ((3,), 3, np.float32)


def test_given_test_arrays_leave_every_row_of_x_for_training(tmp_path: Path) -> None:
    arrays = blobs()
    np.savez(tmp_path / "d.npz", **arrays, x_test=arrays["x"][:5], y_test=arrays["y"][:5])

    fs = open_file_set(tmp_path / "d.npz", "classification", None, 4, 0.2)

    np.testing.assert_array_equal(fs.train_rows, np.arange(50))
    assert fs.test_rows is None and fs.n_test == 5
    blocks = list(fs.native_blocks(10, 13, block_bytes=24))  # 2 rows of x a block
    assert [(n, first, len(b)) for n, first, b in blocks] == [
        ("x", 0, 2),
        ("x", 2, 1),
        ("y", 0, 3),
    ]
    assert blocks[0][2].dtype == np.int32  # as stored


def test_tokens_without_targets_are_shifted_a_batch_at_a_time(tmp_path: Path) -> None:
    x = (np.arange(40).reshape(10, 4) % 7).astype(np.uint8)
    np.savez(tmp_path / "t.npz", x=x)

    fs = open_file_set(tmp_path / "t.npz", "language_model", 7, 0, 0.2)
    inputs, targets = fs.train_batch(np.array([0]))

    assert fs.input_shape == (3,) and fs.streamed == ("x",)
    row = x[fs.train_rows[0]].astype(np.int64)
    np.testing.assert_array_equal(inputs[0], row[:-1])
    np.testing.assert_array_equal(targets[0], row[1:])


def test_a_bad_value_is_named_by_its_row_in_the_whole_array(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(file_sets, "BLOCK_BYTES", 16)  # 2 rows of y a block
    arrays = blobs()
    arrays["y"][37] = -2
    np.savez(tmp_path / "d.npz", **arrays)

    with pytest.raises(DataError) as err:
        open_file_set(tmp_path / "d.npz", "classification", None, 0, 0.2)

    assert str(err.value) == "d.npz: array 'y' row 37 has a label out of range (-2 < 0)"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"y_test": np.arange(3)}, "array 'y_test' is given without 'x_test'"),
        ({"x_test": np.zeros((3, 3), np.int32)}, "missing array 'y_test'"),
        (
            {"x_test": np.zeros((3, 4), np.int32), "y_test": np.arange(3)},
            "array 'x_test' rows are [4], 'x' rows [3]",
        ),
        (
            {"x_test": np.zeros((3, 3), np.int32), "y_test": np.zeros(3, np.float32)},
            "array 'y_test' must be integer labels for task classification, got float32",
        ),
    ],
)
def test_test_arrays_must_match_the_training_arrays(
    tmp_path: Path, extra: dict[str, np.ndarray], message: str
) -> None:
    np.savez(tmp_path / "d.npz", **blobs(), **extra)

    with pytest.raises(DataError) as err:
        open_file_set(tmp_path / "d.npz", "classification", None, 0, 0.2)

    assert message in str(err.value)
