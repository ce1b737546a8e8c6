"""Data sets, npz validation and the deterministic per-shard batch order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shared.config import BuiltinData, FileData, TrainJobSpec
from shared.training.data import (
    DataError,
    batch_indices,
    inner_total_steps,
    load_dataset,
    load_training_npz,
    shard_bounds,
    steps_per_epoch,
)


def test_digits_is_scaled_split_and_image_shaped() -> None:
    ds = load_dataset(BuiltinData(name="digits"), seed=0, test_fraction=0.2)

    assert ds.x_train.shape == (1437, 1, 8, 8) and ds.x_test.shape == (360, 1, 8, 8)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0
    assert ds.input_shape == (1, 8, 8) and ds.num_classes == 10
    assert set(np.unique(ds.y_test)) == set(range(10))  # stratified


def test_split_is_a_function_of_the_seed() -> None:
    a = load_dataset(BuiltinData(), seed=3, test_fraction=0.2)
    b = load_dataset(BuiltinData(), seed=3, test_fraction=0.2)
    c = load_dataset(BuiltinData(), seed=4, test_fraction=0.2)

    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert not np.array_equal(a.y_train, c.y_train)


def test_synthetic_blobs_follow_the_spec() -> None:
    spec = BuiltinData(name="synthetic", samples=500, features=7, classes=4)

    ds = load_dataset(spec, seed=1, test_fraction=0.2)

    assert ds.x_train.shape == (400, 7) and ds.x_test.shape == (100, 7)
    assert ds.input_shape == (7,) and ds.num_classes == 4
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64


def test_valid_npz_loads(tmp_path: Path) -> None:
    path = tmp_path / "ok.npz"
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.normal(size=(50, 3, 4)).astype(np.float32), y=np.arange(50) % 5)

    ds = load_dataset(FileData(path=str(path)), seed=0, test_fraction=0.2)

    assert ds.input_shape == (3, 4) and ds.num_classes == 5 and len(ds.y_test) == 10


def _bad(tmp_path: Path, **arrays: np.ndarray) -> FileData:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    return FileData(path=str(path))


X = np.zeros((10, 4), np.float32)
Y = np.arange(10, dtype=np.int64) % 2


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"y": Y}, "missing array 'x'"),
        ({"x": X}, "missing array 'y'"),
        ({"x": X.astype(np.complex64), "y": Y}, "array 'x' has dtype complex64"),
        ({"x": X, "y": Y.astype(bool)}, "array 'y' has dtype bool"),
        (
            {"x": X, "y": Y.astype(np.float32)},
            "array 'y' must be integer labels for task classification, got float32",
        ),
        ({"x": X, "y": Y[:7]}, "arrays 'x' and 'y' differ in length (10 != 7)"),
        ({"x": X, "y": Y - 1}, "array 'y' row 0 has a label out of range (-1 < 0)"),
        ({"x": X[:, 0], "y": Y}, "array 'x' must be [N, ...]"),
        ({"x": X, "y": Y.reshape(5, 2)}, "array 'y' must be [N]"),
        ({"x": np.full_like(X, np.nan), "y": Y}, "array 'x' row 0 is NaN or infinite"),
        (
            {"x": np.full(X.shape, 1e300), "y": Y},
            "array 'x' row 0 is NaN or infinite",  # beyond float32 once converted
        ),
        ({"x": X, "y": Y * 0}, "at least 2 classes"),
    ],
)
def test_bad_npz_is_refused_naming_the_array(
    tmp_path: Path, arrays: dict[str, np.ndarray], message: str
) -> None:
    with pytest.raises(DataError) as err:
        load_dataset(_bad(tmp_path, **arrays), seed=0, test_fraction=0.2)

    assert message in str(err.value)


def test_missing_and_corrupt_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file"):
        load_dataset(FileData(path=str(tmp_path / "nope.npz")), 0, 0.2)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    with pytest.raises(DataError, match="not a readable .npz"):
        load_dataset(FileData(path=str(junk)), 0, 0.2)


def test_pickled_npz_is_refused(tmp_path: Path) -> None:
    objects = np.array([{"a": 1}] * 10, dtype=object)

    with pytest.raises(DataError, match="array 'x' has dtype object"):
        load_dataset(_bad(tmp_path, x=objects, y=Y), 0, 0.2)


@pytest.mark.parametrize(("n", "k"), [(10, 3), (1437, 3), (7, 7), (5, 8), (0, 2), (100, 1)])
def test_shard_bounds_match_array_split(n: int, k: int) -> None:
    expected = [
        (int(p[0]), int(p[-1]) + 1) if len(p) else None for p in np.array_split(np.arange(n), k)
    ]

    got = [shard_bounds(n, i, k) for i in range(k)]

    for (start, stop), exp in zip(got, expected, strict=True):
        assert (start, stop) == exp or (exp is None and start == stop)
    assert got[0][0] == 0 and got[-1][1] == n


def test_shard_bounds_rejects_bad_shards() -> None:
    for args in [(10, 3, 3), (10, -1, 3), (10, 0, 0)]:
        with pytest.raises(ValueError, match="bad shard"):
            shard_bounds(*args)


def test_steps_per_epoch_is_the_longest_shard() -> None:
    assert steps_per_epoch(1437, 3, 32) == 15  # 479 rows per shard
    assert steps_per_epoch(10, 3, 4) == 1  # shards of 4, 3, 3
    assert steps_per_epoch(10, 3, 3) == 2


def test_steps_from_epochs_or_steps() -> None:
    by_epochs = TrainJobSpec(kind="train", workers=3, epochs=2, batch_size=32)
    by_steps = TrainJobSpec(kind="train", steps=7)

    assert inner_total_steps(by_epochs, 1437) == 30 and inner_total_steps(by_steps, 1437) == 7


def test_batches_cover_each_shard_once_per_epoch() -> None:
    n, k, b = 100, 3, 8
    for shard in range(k):
        start, stop = shard_bounds(n, shard, k)
        steps = steps_per_epoch(n, k, b)

        rows = np.concatenate([batch_indices(n, shard, k, b, 4, s, seed=9) for s in range(steps)])

        assert rows.dtype == np.int64
        assert sorted(rows.tolist()) == list(range(start, stop))


def test_batch_order_is_a_pure_function_of_seed_epoch_shard_step() -> None:
    a = batch_indices(1437, 1, 3, 32, epoch=2, step_in_epoch=5, seed=0)

    np.testing.assert_array_equal(a, batch_indices(1437, 1, 3, 32, 2, 5, 0))
    assert not np.array_equal(a, batch_indices(1437, 1, 3, 32, 3, 5, 0))  # epoch
    assert not np.array_equal(a, batch_indices(1437, 1, 3, 32, 2, 5, 1))  # seed


def test_exhausted_shard_gives_an_empty_batch() -> None:
    # 10 rows in 3 shards of 4, 3, 3 with batch 3: shard 0 has a second step, shard 1 does not.
    assert len(batch_indices(10, 0, 3, 3, 0, 1, 0)) == 1
    assert len(batch_indices(10, 1, 3, 3, 0, 1, 0)) == 0


def test_accumulation_steps_take_the_rows_of_one_k_times_larger_batch() -> None:
    # k micro-batches of B rows consume the rows of one batch of k * B, step for step.
    for step in range(4):
        np.testing.assert_array_equal(
            batch_indices(1437, 1, 3, 16, 1, step, 0, grad_accum_steps=4),
            batch_indices(1437, 1, 3, 64, 1, step, 0),
        )
    assert steps_per_epoch(1437, 3, 16, 4) == steps_per_epoch(1437, 3, 64) == 8
    spec = TrainJobSpec(kind="train", workers=3, epochs=2, batch_size=16, grad_accum_steps=4)
    assert inner_total_steps(spec, 1437) == 16


def test_an_archive_claiming_a_giant_array_is_refused_before_allocation(tmp_path) -> None:
    import io
    import zipfile

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (1 << 38, 1)}
    )
    path = tmp_path / "giant.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x.npy", header.getvalue() + b"\0" * 64)
        zf.writestr("y.npy", header.getvalue())

    with pytest.raises(DataError, match=r"array 'x' claims shape \(274877906944, 1\)"):
        load_training_npz(path)
