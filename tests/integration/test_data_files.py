"""File data sets of any numeric dtype through real daemons: mapped, fetched, cached, refused.

A coordinator and two workers serve in-process over gRPC (port 0). The reference of each run
is today's loader on the same rows converted here beforehand (float32 inputs, int64 labels or
tokens, float32 targets) and written as an ``.npz``: a job on the stored dtypes (converted by
the workers a batch at a time) must end with the same model within 1e-5. Then a directory of
``.npy`` files, ``x_test``/``y_test`` given, the workers' shard caches across jobs (a second
job fetches nothing, a job with other shards fetches only the rows it lacks), and refusals
before queueing that name the array and its dtype.
"""

from __future__ import annotations

import stat
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shared.client import NeuroshardError
from shared.config import FileData, TrainJobSpec
from shared.training.data import Dataset, load_dataset
from shared.training.tasks import evaluate, make_task
from tests.fixtures import ALLOWED_MODELS
from tests.integration.test_training_equivalence import assert_same_state, load_saved_model
from tests.training_reference import train_single_process

pytestmark = pytest.mark.integration

STEPS = 6
OPERATOR = {"allowed_models": ALLOWED_MODELS}


def images(rows: int = 120) -> dict[str, np.ndarray]:
    """uint8 "images" [rows, 1, 4, 4] of 0..15 and int16 labels 0..2 that depend on them."""
    rng = np.random.default_rng(7)
    x = rng.integers(0, 16, size=(rows, 1, 4, 4), dtype=np.uint8)
    y = (x.reshape(rows, -1)[:, :3].argmax(axis=1)).astype(np.int16)
    return {"x": x, "y": y}


def regression64(rows: int = 120) -> dict[str, np.ndarray]:
    """float64 x [rows, 5] and float16 y [rows]."""
    rng = np.random.default_rng(8)
    x = rng.normal(size=(rows, 5))
    y = (x @ rng.normal(size=5)).astype(np.float16)
    return {"x": x, "y": y}


def tokens16(rows: int = 80) -> dict[str, np.ndarray]:
    """uint16 tokens [rows, 7] in [0, 10)."""
    rng = np.random.default_rng(9)
    return {"x": rng.integers(0, 10, size=(rows, 7)).astype(np.uint16)}


CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "uint8 images, int16 labels": ({"model": "mlp"}, images),
    "float64 x, float16 targets": (
        {"task": "regression", "model": {"name": "mlp", "hidden": [8]}},
        regression64,
    ),
    "uint16 tokens": (
        {
            "task": "language_model",
            "vocab_size": 10,
            "model": {"entry": "tiny_lm", "args": {"vocab": 10, "dim": 8}},
        },
        tokens16,
    ),
}


def converted(task: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays as today's loader took them, converted here (not by the code under test)."""
    if task == "language_model":
        return {name: a.astype(np.int64) for name, a in arrays.items()}
    targets = np.int64 if task == "classification" else np.float32
    out = {"x": arrays["x"].astype(np.float32), "y": arrays["y"].astype(targets)}
    if "x_test" in arrays:
        out |= {"x_test": arrays["x_test"].astype(np.float32)}
        out |= {"y_test": arrays["y_test"].astype(targets)}
    return out


def job(path: str, fields: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A 2-worker sync job of ``STEPS`` SGD steps on the data set at ``path``."""
    return {
        "kind": "train",
        "workers": 2,
        "batch_size": 8,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "steps": STEPS,
        "test_fraction": 0.2,
        "seed": 3,
        "data": {"path": path},
        **fields,
        **extra,
    }


def reference_state(spec_fields: dict[str, Any], path: Path) -> dict[str, torch.Tensor]:
    """Single-process training on today's loader's split of the converted file at ``path``."""
    spec = TrainJobSpec.model_validate(spec_fields)
    ds = load_dataset(
        FileData(path=str(path)), spec.seed, spec.test_fraction, spec.task, spec.vocab_size
    )
    loss = (
        (lambda out, y: ((out.reshape(y.shape) - y) ** 2).mean())
        if spec.task == "regression"
        else (
            (lambda out, y: torch.nn.functional.cross_entropy(out.reshape(-1, 10), y.reshape(-1)))
            if spec.task == "language_model"
            else torch.nn.functional.cross_entropy
        )
    )
    return train_single_process(spec, ds, STEPS, loss, ALLOWED_MODELS).state_dict()


async def run(cluster, spec: dict[str, Any]) -> dict[str, Any]:
    async with cluster.client() as client:
        submitted = await client.submit(spec)
        final = await client.wait(submitted.job_id)
    assert final.state == "SUCCEEDED", final.error
    return final.result


def fetched_bytes(cluster) -> list[float]:
    """Each worker's ``neuroshard_shard_fetched_bytes_total``."""
    return [
        w.metrics.registry.get_sample_value("neuroshard_shard_fetched_bytes_total") or 0.0
        for w in cluster.workers
    ]


def cached_rows(cluster) -> list[float]:
    """Each worker's rows found in its shard cache."""
    return [
        w.metrics.registry.get_sample_value("neuroshard_shard_rows_total", {"source": "cache"})
        or 0.0
        for w in cluster.workers
    ]


@pytest.mark.parametrize("case", list(CASES))
async def test_stored_dtypes_train_as_the_converted_set(
    make_cluster, tmp_path: Path, case: str
) -> None:
    # Arrange: the stored dtypes in data/, the converted arrays beside them for the reference
    fields, make = CASES[case]
    root = tmp_path / "data"
    root.mkdir()
    arrays = make()
    np.savez(root / "stored.npz", **arrays)
    np.savez(tmp_path / "converted.npz", **converted(fields.get("task", "classification"), arrays))
    spec = job("stored.npz", fields)
    expected = reference_state(spec, tmp_path / "converted.npz")
    cluster = await make_cluster(
        workers=2, data_roots=[str(root)], **OPERATOR, worker_overrides=OPERATOR
    )

    # Act
    result = await run(cluster, spec)

    # Assert
    assert_same_state(load_saved_model(result), expected)


async def test_a_directory_of_npy_and_given_test_rows_train_as_the_reference(
    make_cluster, tmp_path: Path
) -> None:
    # Arrange: x, y, x_test, y_test as .npy files; every row of x trains, in file order
    arrays = images(100)
    test = images(30)
    root = tmp_path / "data"
    (root / "digits4").mkdir(parents=True)
    stored = {"x": arrays["x"], "y": arrays["y"], "x_test": test["x"], "y_test": test["y"]}
    for name, a in stored.items():
        np.save(root / "digits4" / f"{name}.npy", a)
    spec = job("digits4", {"model": "mlp"})
    ref = converted("classification", stored)
    ds_spec = TrainJobSpec.model_validate(spec)
    ds = Dataset(ref["x"], ref["y"], ref["x_test"], ref["y_test"], (1, 4, 4), 3)
    model = train_single_process(ds_spec, ds, STEPS, allowed_models=ALLOWED_MODELS)
    expected_loss = evaluate(make_task("classification"), model, ref["x_test"], ref["y_test"])
    cluster = await make_cluster(
        workers=2, data_roots=[str(root)], **OPERATOR, worker_overrides=OPERATOR
    )

    # Act
    result = await run(cluster, spec)

    # Assert
    assert_same_state(load_saved_model(result), model.state_dict())
    assert result["test_loss"] == pytest.approx(expected_loss["test_loss"], abs=1e-5)


async def test_a_second_job_reuses_the_workers_cached_rows(make_cluster, tmp_path: Path) -> None:
    # Arrange
    root = tmp_path / "data"
    root.mkdir()
    np.savez(root / "img.npz", **images(200))
    cluster = await make_cluster(workers=2, data_roots=[str(root)])
    spec = job("img.npz", {"model": "mlp"})

    # Act: the same data, split and shards twice; then one worker takes every row
    await run(cluster, spec)
    first = fetched_bytes(cluster)
    await run(cluster, spec | {"optimizer": {"name": "sgd", "lr": 0.01}})
    second = fetched_bytes(cluster)
    cached_before = cached_rows(cluster)
    await run(cluster, spec | {"workers": 1})
    third = fetched_bytes(cluster)

    # Assert: 160 training rows as uint8 [1, 4, 4] (16 bytes) and int16 labels (2 bytes)
    assert sum(first) == 160 * 18 and all(b > 0 for b in first)
    assert second == first  # nothing fetched again
    assert sum(cached_rows(cluster)) - sum(cached_before) == 80  # half held by whichever worker
    assert sum(third) - sum(second) == 80 * 18  # only the other half fetched
    for w in cluster.workers:
        cache = Path(w.cfg.data_dir) / "shard_cache"
        assert stat.S_IMODE(cache.stat().st_mode) == 0o700
        for entry in cache.iterdir():
            assert stat.S_IMODE(entry.stat().st_mode) == 0o700
            for f in entry.iterdir():
                assert stat.S_IMODE(f.stat().st_mode) == 0o600
        assert w.shard_cache.used_bytes > 0


def _complex() -> dict[str, np.ndarray]:
    return {"x": np.zeros((20, 3), np.complex64), "y": np.arange(20) % 2}


def _bool_labels() -> dict[str, np.ndarray]:
    return {"x": np.zeros((20, 3), np.float32), "y": (np.arange(20) % 2).astype(bool)}


def _float_labels() -> dict[str, np.ndarray]:
    return {"x": np.zeros((20, 3), np.float32), "y": (np.arange(20) % 2).astype(np.float32)}


@pytest.mark.parametrize(
    ("arrays", "compressed", "message"),
    [
        (_complex, False, "array 'x' has dtype complex64"),
        (_bool_labels, False, "array 'y' has dtype bool; a data set takes integers of any width"),
        (_float_labels, False, "array 'y' must be integer labels for task classification"),
        (images, True, "array 'x' is compressed in the .npz (1920 bytes once inflated, over"),
    ],
)
async def test_bad_arrays_are_refused_before_queueing_naming_the_array(
    make_cluster, tmp_path: Path, arrays: Any, compressed: bool, message: str
) -> None:
    root = tmp_path / "data"
    root.mkdir()
    save = np.savez_compressed if compressed else np.savez
    save(root / "bad.npz", **arrays())
    cluster = await make_cluster(workers=1, data_roots=[str(root)], max_compressed_array_bytes=1000)

    async with cluster.client() as client:
        with pytest.raises(NeuroshardError) as err:
            await client.submit(job("bad.npz", {"model": "mlp", "workers": 1}))
        assert await client.jobs() == []

    assert "data.path: bad.npz: " in str(err.value) and message in str(err.value)
    if compressed:
        assert "save it uncompressed" in str(err.value)
    cache = Path(cluster.workers[0].cfg.data_dir) / "shard_cache"
    assert list(cache.iterdir()) == []


async def test_a_put_directory_is_stored_as_a_mappable_npz_of_the_same_content(
    make_cluster, tmp_path: Path
) -> None:
    # Arrange: the same arrays as a local directory (uploaded) and as a directory in the root
    root = tmp_path / "data"
    local = tmp_path / "local"
    for d in (local, root / "same"):
        d.mkdir(parents=True)
        for name, a in images(200).items():
            np.save(d / f"{name}.npy", a)
    cluster = await make_cluster(workers=2, data_roots=[str(root)])

    # Act: upload the directory, train on the upload, then on the directory in the root
    async with cluster.client() as client:
        info = await client.put_dataset(local, name="img")
    await run(cluster, job("img.npz", {"model": "mlp"}))
    first = fetched_bytes(cluster)
    await run(cluster, job("same", {"model": "mlp"}))

    # Assert: stored uncompressed (mapped, not inflated), same content: nothing fetched again
    assert info["path"] == "img.npz" and [a["name"] for a in info["arrays"]] == ["x", "y"]
    with zipfile.ZipFile(root / "img.npz") as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
    assert sum(first) == 160 * 18
    assert fetched_bytes(cluster) == first


async def test_a_bad_input_value_fails_the_job_naming_the_array_and_row(
    make_cluster, tmp_path: Path
) -> None:
    # Arrange: admission reads the headers and the labels; x's values are checked when the
    # job opens the set (a float64 beyond float32's range becomes inf once converted)
    root = tmp_path / "data"
    root.mkdir()
    arrays = regression64()
    arrays["x"][17, 2] = 1e300
    np.savez(root / "far.npz", **arrays)
    cluster = await make_cluster(workers=2, data_roots=[str(root)])

    # Act
    async with cluster.client() as client:
        submitted = await client.submit(job("far.npz", CASES["float64 x, float16 targets"][0]))
        final = await client.wait(submitted.job_id)

    # Assert: failed before any worker fetched a row
    assert final.state == "FAILED"
    assert final.error == (
        "data.path: far.npz: array 'x' row 17 is NaN or infinite (task regression)"
    )
    assert fetched_bytes(cluster) == [0.0, 0.0]
    assert submitted.job_id not in cluster.coordinator.cluster.train_sets
