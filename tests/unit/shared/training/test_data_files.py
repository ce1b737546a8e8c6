"""A data set's arrays mapped from an ``.npz`` or a directory of ``.npy``, never read whole."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from shared.training import data_files
from shared.training.data_files import content_hash, open_arrays, row_blocks
from shared.training.tasks import DataError

X = np.arange(60, dtype=np.uint16).reshape(20, 3)
Y = (np.arange(20) % 4).astype(np.int8)


@pytest.mark.parametrize("layout", ["npz", "directory"])
def test_arrays_are_mapped_views_equal_to_np_load(tmp_path: Path, layout: str) -> None:
    if layout == "npz":
        path = tmp_path / "d.npz"
        np.savez(path, x=X, y=Y, x_test=X[:2].astype(">f8"))
    else:
        path = tmp_path / "d"
        path.mkdir()
        for name, a in {"x": X, "y": Y, "x_test": X[:2].astype(">f8")}.items():
            np.save(path / f"{name}.npy", a)

    arrays = open_arrays(path)

    assert list(arrays) == ["x", "y", "x_test"]
    np.testing.assert_array_equal(arrays["x"].array, X)
    np.testing.assert_array_equal(arrays["y"].array, Y)
    np.testing.assert_array_equal(arrays["x_test"].array, X[:2])
    assert not arrays["x"].array.flags.writeable  # a read-only map of the file
    assert arrays["x"].array.base is not None


def test_take_reads_rows_in_the_order_asked(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", X.astype(">u2"))  # big-endian: read as stored
    x = open_arrays(tmp_path)["x"]

    got = x.take(np.array([7, 2, 19, 2, 3, 4]))

    np.testing.assert_array_equal(got, X[[7, 2, 19, 2, 3, 4]])
    assert got.dtype == np.dtype(">u2")


def test_reading_a_range_drops_the_mapped_pages_past_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    np.save(tmp_path / "x.npy", X)
    x = open_arrays(tmp_path)["x"]
    monkeypatch.setattr(data_files, "RESIDENT_BYTES", 100)
    dropped: list[bool] = []
    monkeypatch.setattr(x, "release", lambda: dropped.append(True))

    first, second = x.rows(0, 10), x.rows(10, 20)  # 60 bytes each

    np.testing.assert_array_equal(np.concatenate([first, second]), X)
    assert dropped == [True]


def test_a_small_compressed_member_is_inflated_a_large_one_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.npz"
    np.savez_compressed(path, x=X, y=Y)

    small = open_arrays(path, max_compressed_bytes=X.nbytes)
    with pytest.raises(DataError) as err:
        open_arrays(path, max_compressed_bytes=X.nbytes - 1)

    np.testing.assert_array_equal(small["x"].array, X)
    assert str(err.value) == (
        "array 'x' is compressed in the .npz (120 bytes once inflated, over the coordinator's "
        "max_compressed_array_bytes 119); save it uncompressed (np.savez, not "
        "np.savez_compressed) or as a directory of .npy files, which are memory-mapped instead"
    )


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros((4, 2), np.complex64), "array 'x' has dtype complex64"),
        (np.zeros((4, 2), bool), "array 'x' has dtype bool; a data set takes integers of any"),
        (np.zeros((4, 2), "U3"), "array 'x' has dtype <U3"),
        (np.asfortranarray(np.zeros((4, 2), np.float32)), "stored in Fortran order"),
        (np.float32(1.0), "array 'x' is a scalar"),
    ],
)
def test_arrays_no_task_takes_are_refused_from_their_headers(
    tmp_path: Path, array: np.ndarray, message: str
) -> None:
    np.save(tmp_path / "x.npy", array)

    with pytest.raises(DataError, match=message.replace("(", r"\(")):
        open_arrays(tmp_path)


def test_a_symlinked_npy_and_a_truncated_one_are_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "elsewhere.npy", X)
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "elsewhere.npy", tmp_path / "d" / "x.npy")
    (tmp_path / "t").mkdir()
    np.save(tmp_path / "t" / "x.npy", X)
    with open(tmp_path / "t" / "x.npy", "r+b") as f:
        f.truncate(150)

    with pytest.raises(DataError, match="x.npy is a symlink"):
        open_arrays(tmp_path / "d")
    with pytest.raises(DataError, match=r"array 'x' claims shape \(20, 3\) \(120 bytes\)"):
        open_arrays(tmp_path / "t")


def test_a_member_is_found_after_its_local_header_extra_field(tmp_path: Path) -> None:
    # zipfile writes no extra field itself; a member with one must still map at its data
    path = tmp_path / "extra.npz"
    np.save(tmp_path / "x.npy", X)
    with zipfile.ZipFile(path, "w") as zf:
        info = zipfile.ZipInfo("x.npy")
        info.extra = b"\xfe\xca\x04\x00abcd"
        zf.writestr(info, (tmp_path / "x.npy").read_bytes())

    np.testing.assert_array_equal(open_arrays(path)["x"].array, X)


def test_the_content_hash_names_the_arrays_not_the_container(tmp_path: Path) -> None:
    np.savez(tmp_path / "a.npz", x=X, y=Y)
    np.savez_compressed(tmp_path / "b.npz", x=X, y=Y)
    (tmp_path / "d").mkdir()
    np.save(tmp_path / "d" / "x.npy", X)
    np.save(tmp_path / "d" / "y.npy", Y)
    np.savez(tmp_path / "c.npz", x=X + 1, y=Y)

    same = {content_hash(tmp_path / p) for p in ("a.npz", "b.npz", "d")}
    assert len(same) == 1
    assert content_hash(tmp_path / "c.npz") not in same


def test_row_blocks_cover_the_rows_in_bounded_blocks() -> None:
    assert list(row_blocks(10, 3, 7)) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert list(row_blocks(3, 100, 7)) == [(0, 1), (1, 2), (2, 3)]  # at least a row a block
    assert list(row_blocks(0, 3, 7)) == []
