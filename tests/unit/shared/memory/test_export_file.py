"""The memory export file: written in chunks, read by plain NumPy, checked field by field."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from shared.memory.export_file import FORMAT, ExportWriter, read_export
from shared.memory.files import MemoryFileError

LIMIT = 4096


def _write(path: Path, chunks) -> int:
    w = ExportWriter(path)
    for ids, strengths, payloads in chunks:
        w.add(np.asarray(ids, np.uint64), np.asarray(strengths, np.float32), payloads)
    return w.finish()


def test_chunks_with_payloads_read_back_with_plain_numpy(tmp_path: Path) -> None:
    path = tmp_path / "e.npz"
    chunks = [
        ([5, 9, 2], [0.5, 1.0, 0.0], {9: b"nine", 2: b"\x00two"}),
        ([], [], {}),
        ([7], [0.25], None),
        ([11, 3], [0.75, 0.125], {3: b"x" * 300}),
    ]

    size = _write(path, chunks)

    assert size == path.stat().st_size
    with np.load(path, allow_pickle=False) as d:
        assert str(d["format"]) == FORMAT and int(d["version"]) == 1
        assert d["ids"].dtype == np.uint64 and d["strengths"].dtype == np.float32
        assert d["ids"].tolist() == [5, 9, 2, 7, 11, 3]
        assert d["strengths"].tolist() == [0.5, 1.0, 0.0, 0.25, 0.75, 0.125]
        assert d["payload_offsets"].tolist() == [0, 0, 4, 8, 8, 8, 308]
        assert d["payload_bytes"].tobytes() == b"nine\x00two" + b"x" * 300
    data = read_export(path, LIMIT)
    assert data.payloads(0, 6) == [b"", b"nine", b"\x00two", b"", b"", b"x" * 300]
    assert data.payloads(1, 3) == [b"nine", b"\x00two"]
    assert [p.name for p in tmp_path.iterdir()] == ["e.npz"]  # no temporary file left


def test_a_store_without_payloads_has_no_payload_arrays(tmp_path: Path) -> None:
    path = tmp_path / "e.npz"

    _write(path, [([1, 2], [0.5, 0.5], {}), ([3], [0.1], None)])

    with np.load(path, allow_pickle=False) as d:
        assert sorted(d.files) == ["format", "ids", "strengths", "version"]
    data = read_export(path, LIMIT)
    assert data.ids.tolist() == [1, 2, 3] and data.payloads(0, 3) is None


def test_an_empty_store_is_a_valid_file(tmp_path: Path) -> None:
    path = tmp_path / "e.npz"

    _write(path, [])

    data = read_export(path, LIMIT)
    assert len(data.ids) == 0 and len(data.strengths) == 0


def test_abort_leaves_the_destination_alone(tmp_path: Path) -> None:
    path = tmp_path / "e.npz"
    path.write_bytes(b"previous backup")
    w = ExportWriter(path)
    w.add(np.arange(3, dtype=np.uint64), np.zeros(3, np.float32))

    w.abort()

    assert path.read_bytes() == b"previous backup"
    assert [p.name for p in tmp_path.iterdir()] == ["e.npz"]


def _save(path: Path, **overrides) -> Path:
    arrays = {
        "format": np.array(FORMAT),
        "version": np.array(1, np.uint32),
        "ids": np.array([4, 8, 15], np.uint64),
        "strengths": np.array([0.1, 0.2, 0.3], np.float32),
    }
    arrays.update(overrides)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return path


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"ids": np.array([4, 8, 15], np.int64)}, "ids: dtype int64, expected uint64"),
        ({"strengths": np.array([0.1, 0.2, 0.3])}, "strengths: dtype float64, expected float32"),
        (
            {"strengths": np.array([0.1, 0.2], np.float32)},
            "ids and strengths differ in length (3 != 2)",
        ),
        ({"strengths": np.array([0.1, 1.5, 0.3], np.float32)}, "strengths[1]: 1.5 is outside"),
        ({"strengths": np.array([0.1, 0.2, np.nan], np.float32)}, "strengths[2]: nan is not"),
        ({"ids": np.array([4, 8, 4], np.uint64)}, "ids: id 4 repeats (ids[0] and ids[2])"),
        ({"strengths": None}, "no array 'strengths' (has: format, version, ids)"),
        ({"version": None}, "no array 'version'"),
        ({"ids": np.array([4, 8, 15], object)}, "ids: dtype object (a pickled array) is refused"),
        ({"ids": np.array([[4, 8, 15]], np.uint64)}, "ids: shape (1, 3), expected 1-D"),
        ({"format": np.array("something else")}, "format: array('something else'"),
        ({"version": np.array(2, np.uint32)}, "this client reads version 1"),
        (
            {"payload_offsets": np.array([0, 1, 1, 2], np.uint64)},
            "payload_bytes: missing (payload_offsets and payload_bytes go together)",
        ),
        (
            {
                "payload_offsets": np.array([0, 1, 2], np.uint64),
                "payload_bytes": np.zeros(2, np.uint8),
            },
            "payload_offsets: 3 entries for 3 ids (want 4)",
        ),
        (
            {
                "payload_offsets": np.array([0, 2, 1, 2], np.uint64),
                "payload_bytes": np.zeros(2, np.uint8),
            },
            "payload_offsets[2]: 1 is below the one before",
        ),
        (
            {
                "payload_offsets": np.array([0, 1, 1, 9], np.uint64),
                "payload_bytes": np.zeros(2, np.uint8),
            },
            "payload_offsets[3]: 9 is not the payload_bytes length 2",
        ),
        (
            {
                "payload_offsets": np.array([0, 0, LIMIT + 1, LIMIT + 1], np.uint64),
                "payload_bytes": np.zeros(LIMIT + 1, np.uint8),
            },
            f"payload of ids[1]: {LIMIT + 1} bytes, over the cluster's max_payload_bytes {LIMIT}",
        ),
    ],
)
def test_a_bad_file_is_refused_naming_the_field(
    tmp_path: Path, overrides: dict, message: str
) -> None:
    path = _save(tmp_path / "bad.npz", **overrides)

    with pytest.raises(MemoryFileError) as err:
        read_export(path, LIMIT)

    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_a_path_it_cannot_read_is_refused_clearly(tmp_path: Path) -> None:
    missing = tmp_path / "missing.npz"
    locked = _save(tmp_path / "locked.npz")
    os.chmod(locked, 0)
    not_zip = tmp_path / "text.npz"
    not_zip.write_text("hello")

    with pytest.raises(MemoryFileError) as gone:
        read_export(missing, LIMIT)
    with pytest.raises(MemoryFileError) as garbage:
        read_export(not_zip, LIMIT)

    assert str(gone.value) == f"{missing}: cannot read it (No such file or directory)"
    assert str(garbage.value).startswith(f"{not_zip}: not a readable .npz file")
    if os.geteuid() != 0:  # root reads a file whatever its mode
        with pytest.raises(MemoryFileError) as denied:
            read_export(locked, LIMIT)
        assert str(denied.value) == f"{locked}: cannot read it (Permission denied)"


def test_import_batches_count_payload_bytes() -> None:
    from shared.client.store_io import batch_bounds
    from shared.memory.export_file import ExportData

    ids = np.arange(6, dtype=np.uint64)
    plain = ExportData(ids, np.zeros(6, np.float32))
    sizes = np.array([0, 100, 0, 5000, 0, 0], np.uint64)
    heavy = ExportData(
        ids,
        np.zeros(6, np.float32),
        np.r_[np.uint64(0), np.cumsum(sizes)].astype(np.uint64),
        np.zeros(int(sizes.sum()), np.uint8),
    )

    assert batch_bounds(plain, 4, 1000) == [(0, 4), (4, 6)]
    # 12 + 112 + 12 fit in 1000; the 5012-byte memory goes alone; then the rest
    assert batch_bounds(heavy, 4, 1000) == [(0, 3), (3, 4), (4, 6)]
    assert batch_bounds(heavy, 1, 10**9) == [(i, i + 1) for i in range(6)]
