"""A directory of .npy streamed as an uncompressed .npz of the declared size."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest

from shared.client import npz_stream
from shared.client.npz_stream import array_files, npz_chunks, npz_size


def test_the_stream_is_an_npz_of_stored_members_of_the_declared_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(npz_stream, "READ_BYTES", 1000)  # many chunks a file
    arrays = {"x": np.arange(3000, dtype=np.float16).reshape(1000, 3), "y": np.arange(1000)}
    for name, a in arrays.items():
        np.save(tmp_path / f"{name}.npy", a)
    (tmp_path / "notes.txt").write_text("not an array")
    files = array_files(tmp_path)

    chunks = list(npz_chunks(files))
    (tmp_path / "out.npz").write_bytes(b"".join(chunks))

    assert [f.name for f in files] == ["x.npy", "y.npy"]
    assert npz_size(files) == sum(len(c) for c in chunks)
    assert max(len(c) for c in chunks) < 2000  # never the whole archive at once
    with zipfile.ZipFile(tmp_path / "out.npz") as zf:
        assert zf.testzip() is None
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
    with np.load(tmp_path / "out.npz") as npz:
        for name, a in arrays.items():
            np.testing.assert_array_equal(npz[name], a)
