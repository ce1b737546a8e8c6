"""Data set names, uploads and the listing: what is kept, what is refused, and that a refused
upload leaves nothing in the data root."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import numpy as np
import pytest

from coordinator.datasets.dataset_check import DatasetInvalid, DatasetTooLarge
from coordinator.datasets.dataset_store import (
    DatasetExists,
    DatasetNameError,
    Upload,
    UploadError,
    dataset_name,
    list_datasets,
    remove_stale_uploads,
)

MiB = 1 << 20


def npz_bytes(compressed: bool = False, **arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


def train_set(n: int = 20) -> bytes:
    x = np.random.default_rng(0).normal(size=(n, 3)).astype(np.float32)
    return npz_bytes(x=x, y=np.arange(n, dtype=np.int64) % 2)


def put(root: Path, name: str, data: bytes, max_bytes: int = MiB, replace: bool = False):
    upload = Upload(root, name, len(data), max_bytes, replace)
    for i in range(0, len(data), 1000):
        upload.write(data[i : i + 1000])
    return upload.commit()


@pytest.mark.parametrize(
    ("name", "stem"),
    [("digits", "digits"), ("a.b_c-1", "a.b_c-1"), ("mnist.npz", "mnist"), ("9" * 128, "9" * 128)],
)
def test_valid_names(name: str, stem: str) -> None:
    assert dataset_name(name) == stem


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".npz",
        "../x",
        "a/b",
        "a\\b",
        "/abs",
        ".hidden",
        "-x",
        "a..b",
        "..",
        "a b",
        "é",
        "9" * 129,
    ],
)
def test_invalid_names_are_refused_naming_the_field(name: str) -> None:
    with pytest.raises(DatasetNameError, match=r"^name: "):
        dataset_name(name)


def test_a_training_set_is_stored_with_its_digest_and_arrays(tmp_path: Path) -> None:
    data = train_set()

    stored = put(tmp_path / "datasets", "blobs", data)

    assert (stored.name, stored.path, stored.kind) == ("blobs", "blobs.npz", "train")
    assert stored.bytes == len(data)
    assert stored.sha256 == hashlib.sha256(data).hexdigest()
    assert [(a.name, a.dtype, a.shape) for a in stored.arrays] == [
        ("x", "float32", (20, 3)),
        ("y", "int64", (20,)),
    ]
    assert (tmp_path / "datasets" / "blobs.npz").read_bytes() == data
    assert os.listdir(tmp_path / "datasets") == ["blobs.npz"]


def test_a_memory_set_is_stored(tmp_path: Path) -> None:
    data = npz_bytes(ids=np.arange(5, dtype=np.uint64), strengths=np.full(5, 0.5, np.float32))

    assert put(tmp_path, "mem", data).kind == "memory"


def test_a_state_dict_is_stored_as_weights_and_anything_else_named_pt_is_refused(
    tmp_path: Path,
) -> None:
    import torch

    buf = io.BytesIO()
    torch.save({"0.weight": torch.zeros(4, 3), "0.bias": torch.zeros(4)}, buf)
    pickled = io.BytesIO()
    torch.save({"w": [1, 2]}, pickled)

    stored = put(tmp_path, "start.pt", buf.getvalue())
    with pytest.raises(DatasetInvalid) as refused:
        put(tmp_path, "junk.pt", pickled.getvalue())
    with pytest.raises(DatasetInvalid):
        put(tmp_path, "npz-as-pt.pt", train_set())

    assert (stored.name, stored.path, stored.kind) == ("start", "start.pt", "weights")
    assert [(a.name, a.dtype, a.shape) for a in stored.arrays] == [
        ("0.weight", "float32", (4, 3)),
        ("0.bias", "float32", (4,)),
    ]
    assert str(refused.value) == "junk.pt: not a state dict (a mapping of names to tensors)"
    assert os.listdir(tmp_path) == ["start.pt"]
    assert [e.path for e in list_datasets([tmp_path])] == ["start.pt"]


def test_a_bad_name_creates_nothing(tmp_path: Path) -> None:
    root = tmp_path / "datasets"

    with pytest.raises(DatasetNameError):
        Upload(root, "../evil", 10, MiB, False)
    assert not root.exists()


def test_a_declared_size_over_the_cap_is_refused_before_any_byte(tmp_path: Path) -> None:
    with pytest.raises(DatasetTooLarge, match="2048 bytes exceed the coordinator's "):
        Upload(tmp_path, "big", 2048, 1024, False)
    assert os.listdir(tmp_path) == []


def test_bytes_beyond_the_cap_abort_the_upload_and_remove_the_temp_file(tmp_path: Path) -> None:
    upload = Upload(tmp_path, "liar", 1000, 1024, False)  # declares less than it sends
    upload.write(b"x" * 1000)

    with pytest.raises(DatasetTooLarge, match="max_dataset_bytes 1024 bytes"):
        upload.write(b"x" * 100)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"not a zip at all", "not a readable .npz archive"),
        (npz_bytes(x=np.zeros((4, 2), np.complex128), y=np.zeros(4, np.int64)), "has dtype"),
        (npz_bytes(obj=np.array([{"a": 1}], dtype=object)), "holds Python objects"),
        (npz_bytes(z=np.zeros(3)), "expected arrays x and y"),
        (npz_bytes(ids=np.arange(3), strengths=np.full(3, 2.0, np.float32)), "outside [0, 1]"),
    ],
)
def test_an_invalid_data_set_is_refused_and_nothing_is_kept(
    tmp_path: Path, data: bytes, message: str
) -> None:
    with pytest.raises(DatasetInvalid, match=message.replace("[", r"\[")) as err:
        put(tmp_path, "bad", data)
    assert str(tmp_path) not in str(err.value)  # messages name the data set, not our paths
    assert os.listdir(tmp_path) == []


def test_an_archive_that_decompresses_past_the_cap_is_refused(tmp_path: Path) -> None:
    data = npz_bytes(compressed=True, x=np.zeros((1024, 64), np.float32), y=np.zeros(1024))
    assert len(data) < 64 * 1024  # zeros compress well: the file is small

    with pytest.raises(DatasetTooLarge, match="once loaded"):
        put(tmp_path, "bomb", data, max_bytes=64 * 1024)
    assert os.listdir(tmp_path) == []


def test_a_short_stream_is_refused(tmp_path: Path) -> None:
    upload = Upload(tmp_path, "short", 100, MiB, False)
    upload.write(b"x" * 10)

    with pytest.raises(UploadError, match="after 10 of the 100 bytes"):
        upload.commit()
    assert os.listdir(tmp_path) == []


def test_an_existing_name_is_kept_unless_replaced(tmp_path: Path) -> None:
    first, second = train_set(20), train_set(30)
    put(tmp_path, "d", first)

    with pytest.raises(DatasetExists, match="d.npz exists"):
        put(tmp_path, "d", second)
    assert (tmp_path / "d.npz").read_bytes() == first

    put(tmp_path, "d", second, replace=True)
    assert (tmp_path / "d.npz").read_bytes() == second
    assert os.listdir(tmp_path) == ["d.npz"]


def test_a_name_taken_during_the_upload_is_not_overwritten(tmp_path: Path) -> None:
    data = train_set()
    upload = Upload(tmp_path, "race", len(data), MiB, False)
    upload.write(data)
    put(tmp_path, "race", train_set(30))  # another upload of the same name wins first

    with pytest.raises(DatasetExists):
        upload.commit()
    assert (tmp_path / "race.npz").read_bytes() == train_set(30)
    assert os.listdir(tmp_path) == ["race.npz"]


def test_listing_skips_uploads_in_progress_and_symlinks_out_of_the_root(tmp_path: Path) -> None:
    root, other, outside = tmp_path / "a", tmp_path / "b", tmp_path / "secret"
    (root / "sub").mkdir(parents=True)
    other.mkdir()
    outside.mkdir()
    (root / "d.npz").write_bytes(b"12345")
    (root / "sub" / "t.npy").write_bytes(b"1")
    (root / "notes.txt").write_bytes(b"x")
    (outside / "s.npz").write_bytes(b"top secret")
    (root / "leak.npz").symlink_to(outside / "s.npz")
    (root / "dir-link").symlink_to(outside, target_is_directory=True)
    (root / "alias.npz").symlink_to(root / "d.npz")
    (other / "o.npz").write_bytes(b"12")
    in_progress = Upload(root, "partial", 100, MiB, False)
    in_progress.write(b"x")

    entries = list_datasets([root, other, tmp_path / "missing"])
    in_progress.discard()

    assert [(e.path, e.bytes, e.root) for e in entries] == [
        ("alias.npz", 5, 0),
        ("d.npz", 5, 0),
        ("sub/t.npy", 1, 0),
        ("o.npz", 2, 1),
    ]
    assert all(e.modified_at > 0 for e in entries)


def test_uploads_left_by_a_crash_are_removed_at_start(tmp_path: Path) -> None:
    interrupted = Upload(tmp_path, "interrupted", 100, MiB, False)
    interrupted.write(b"x")  # never committed: the process dies, and the OS closes its file
    assert interrupted._file is not None
    interrupted._file.close()
    put(tmp_path, "kept", train_set())
    (tmp_path / ".notes").write_text("not ours")

    removed = remove_stale_uploads(tmp_path)

    assert len(removed) == 1 and removed[0].startswith(".interrupted.npz.")
    assert sorted(os.listdir(tmp_path)) == [".notes", "kept.npz"]
    assert remove_stale_uploads(tmp_path / "missing") == []
