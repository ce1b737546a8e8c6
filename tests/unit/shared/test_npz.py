"""Tests for shared/npz.py: the one reader of .npy headers, alone and inside .npz archives."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from shared.npz import NpyHeaderError, npz_members, read_npy_header


def npy(array: np.ndarray, version: tuple[int, int] | None = None) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, version=version)
    return buf.getvalue()


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_header_of_each_version(version: tuple[int, int]) -> None:
    data = npy(np.zeros((3, 5), np.float32), version)

    header = read_npy_header(io.BytesIO(data))

    assert header.shape == (3, 5)
    assert header.dtype == np.float32
    assert header.data_bytes == 60
    assert header.header_bytes == len(data) - 60


def test_unknown_version_and_garbage_are_refused() -> None:
    data = bytearray(npy(np.zeros(2, np.uint8)))
    data[6] = 9  # major version 9
    with pytest.raises(NpyHeaderError, match=r"version \(9, 0\) is not supported"):
        read_npy_header(io.BytesIO(bytes(data)))
    with pytest.raises(NpyHeaderError):
        read_npy_header(io.BytesIO(b"not an npy"))


def test_members_in_archive_order_or_by_name() -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("y.npy", npy(np.arange(4, dtype=np.int64)))
        zf.writestr("x.npy", npy(np.zeros((4, 2), np.float32)))
        zf.writestr("readme.txt", b"not an array")
        zf.writestr("ids", npy(np.arange(2, dtype=np.uint64)))  # no suffix: by name only
    with zipfile.ZipFile(buf) as zf:
        every = list(npz_members(zf))
        named = list(npz_members(zf, ("x", "ids", "absent")))

    assert [(m.name, m.shape, m.dtype) for m in every] == [
        ("y", (4,), np.dtype(np.int64)),
        ("x", (4, 2), np.dtype(np.float32)),
    ]
    assert [m.name for m in named] == ["x", "ids"]
    assert named[0].stored_bytes == named[0].header_bytes + 32
