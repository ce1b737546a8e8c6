"""Upload validation streams the archive: bounded memory, corrupt members refused, exact indices.

Memory is measured with ``tracemalloc``, which NumPy reports its array buffers to.
"""

from __future__ import annotations

import io
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

from coordinator.datasets.dataset_check import (
    CHUNK_BYTES,
    DatasetInvalid,
    DatasetTooLarge,
    check_dataset,
)
from shared.npz import npz_members
from shared.training.data import DataError, load_training_npz
from tests.npz_files import corrupt_deflate_npz, npy_bytes, npz_bytes

MiB = 1 << 20


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "up.npz"
    path.write_bytes(data)
    return path


def _peak_bytes(fn) -> tuple[object, int]:
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_compressed_set_is_validated_in_bounded_memory(tmp_path: Path) -> None:
    # Arrange: 64 MiB of float32 zeros in a few hundred KB (the review's 467 KB cost 567 MB)
    n = 64 * MiB // (4 * 64)
    data = npz_bytes(
        compressed=True, x=np.zeros((n, 64), np.float32), y=np.arange(n, dtype=np.int64) % 2
    )
    path = _write(tmp_path, data)
    assert len(data) < 2 * MiB

    # Act
    (kind, arrays), peak = _peak_bytes(lambda: check_dataset(path, "up.npz", 1 << 30))

    # Assert: a few chunks, not the 64 MiB array (nor its 16 MiB isfinite mask)
    assert kind == "train" and [a.shape for a in arrays] == [(n, 64), (n,)]
    assert peak < 4 * CHUNK_BYTES, f"peak {peak} bytes"


@pytest.mark.parametrize("intact", [4096, 32 * 1024], ids=["in the header", "in the data"])
def test_a_corrupt_deflate_member_is_invalid_not_an_escape(tmp_path: Path, intact: int) -> None:
    path = _write(tmp_path, corrupt_deflate_npz(intact))

    with pytest.raises(DatasetInvalid) as err:
        check_dataset(path, "c.npz", 1 << 30)

    assert str(err.value) == (
        "c.npz: not a readable .npz archive (as np.savez writes): "
        "Error -3 while decompressing data: invalid block type"
    )


def test_a_flipped_byte_is_caught_by_the_crc(tmp_path: Path) -> None:
    data = bytearray(npz_bytes(x=np.ones((100, 4), np.float32), y=np.arange(100) % 2))
    at = data.index(b"\x00\x00\x80\x3f") + 200  # inside x's stored data: a 1.0 becomes 1.0000x
    data[at] ^= 0x01
    path = _write(tmp_path, bytes(data))

    with pytest.raises(DatasetInvalid, match="Bad CRC-32 for file 'x.npy'"):
        check_dataset(path, "c.npz", 1 << 30)


def test_a_member_holding_more_or_less_than_its_header_claims_is_refused(
    tmp_path: Path,
) -> None:
    # an x member written with a header that lies about its shape (its CRC is right)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(
            "x.npy", npy_bytes(np.ones((10, 2), np.float32)).replace(b"(10, 2)", b"(90, 2)")
        )
        zf.writestr("y.npy", npy_bytes(np.arange(90) % 2))
    path = _write(tmp_path, buf.getvalue())

    with pytest.raises(DatasetInvalid) as err:
        check_dataset(path, "c.npz", 1 << 30)

    assert "array 'x' claims shape (90, 2) (720 bytes) but its member holds 80 bytes" in str(
        err.value
    )


def test_errors_name_the_index_in_the_whole_array(tmp_path: Path) -> None:
    n = 3 * CHUNK_BYTES // 4  # strengths span three chunks
    strengths = np.full(n, 0.5, np.float32)
    strengths[n - 7] = 1.5
    path = _write(tmp_path, npz_bytes(ids=np.arange(n, dtype=np.uint64), strengths=strengths))

    with pytest.raises(DatasetInvalid) as err:
        check_dataset(path, "m.npz", 1 << 30)

    assert str(err.value) == f"m.npz: strengths[{n - 7}]: 1.5 is outside [0, 1]"


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x": np.full((4, 2), np.nan, np.float32), "y": np.arange(4)}, "NaN or infinite"),
        (
            {"x": np.ones((4, 2), np.float32), "y": np.array([0, 1, -1, 0])},
            "row 2 has a label out of range (-1 < 0)",
        ),
        ({"x": np.ones((4, 2), np.float32), "y": np.zeros(4, np.int64)}, "at least 2 classes"),
        ({"x": np.ones((4, 2), np.float32), "y": np.arange(3)}, "differ in length (4 != 3)"),
        ({"x": np.ones((4, 2), np.float32)}, "missing array 'y'"),
        ({"ids": np.array([1, -2]), "strengths": np.ones(2, np.float32)}, "ids[1]: -2"),
        ({"ids": np.arange(2)}, "no array 'strengths'"),
    ],
)
def test_value_checks_match_what_jobs_require(tmp_path: Path, arrays: dict, message: str) -> None:
    path = _write(tmp_path, npz_bytes(**arrays))

    with pytest.raises(DatasetInvalid) as err:
        check_dataset(path, "d.npz", 1 << 30)

    assert message in str(err.value)


def test_declared_sizes_over_the_cap_are_refused_before_inflating(tmp_path: Path) -> None:
    n = 16 * MiB // 4
    path = _write(tmp_path, npz_bytes(compressed=True, x=np.zeros((n, 1), np.float32)))

    with pytest.raises(DatasetTooLarge, match="max_dataset_bytes 1048576"):
        check_dataset(path, "d.npz", MiB)


X4 = np.ones((4, 2), np.float32)
Y4 = np.array([0, 1, 1, 0], np.int64)


@pytest.mark.parametrize(
    "arrays",
    [
        {"x": X4, "y": Y4.astype(np.complex64)},
        {"x": np.ones(4, np.float32), "y": Y4},
        {"x": X4, "y": Y4.reshape(2, 2)},
        {"x": X4, "y": Y4[:3]},
        {"x": X4[:0], "y": Y4[:0]},
        {"x": np.full((4, 2), np.inf, np.float32), "y": Y4},
        {"x": X4, "y": Y4 - 1},
        {"x": X4, "y": Y4 * 0},
        {"x": X4, "extra": Y4},
    ],
    ids=[
        "y dtype",
        "x ndim",
        "y ndim",
        "lengths",
        "empty",
        "inf",
        "min",
        "classes",
        "missing",
    ],  # fmt: skip
)
def test_an_upload_is_refused_with_the_loaders_own_message(tmp_path: Path, arrays: dict) -> None:
    # Arrange: one rule set (shared.training.data) for the loader and the upload check; a
    # rule written again in either place and worded or decided differently fails here.
    path = _write(tmp_path, npz_bytes(**arrays))

    # Act
    with pytest.raises(DataError) as loaded:
        load_training_npz(path)
    with pytest.raises(DatasetInvalid) as uploaded:
        check_dataset(path, "d.npz", 1 << 30)

    # Assert
    assert str(loaded.value).startswith(f"{path.name}: ")
    assert str(uploaded.value) == "d.npz: " + str(loaded.value).removeprefix(f"{path.name}: ")


def test_an_upload_whose_x_fits_no_task_is_refused_naming_every_tasks_dtypes(
    tmp_path: Path,
) -> None:
    # The upload's task is not known: its message names what each task takes (a job's loader
    # names its own task's).
    path = _write(tmp_path, npz_bytes(x=X4.astype(np.complex64), y=Y4))

    with pytest.raises(DatasetInvalid) as uploaded:
        check_dataset(path, "d.npz", 1 << 30)

    assert str(uploaded.value) == (
        "d.npz: array 'x' has dtype complex64; a data set takes integers of any width or "
        "float16/32/64"
    )


def test_the_arrays_are_the_members_npz_members_reads(tmp_path: Path) -> None:
    path = _write(tmp_path, npz_bytes(x=X4, y=Y4, z=np.zeros((3, 5, 7), np.uint8)))

    _, arrays = check_dataset(path, "d.npz", 1 << 30)

    with zipfile.ZipFile(path) as zf:
        expected = [(m.name, m.dtype.name, m.shape) for m in npz_members(zf)]
    assert [(a.name, a.dtype, a.shape) for a in arrays] == expected
    assert expected == [("x", "float32", (4, 2)), ("y", "int64", (4,)), ("z", "uint8", (3, 5, 7))]
