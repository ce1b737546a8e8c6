"""Tasks through real daemons: regression and language_model jobs equal single-process training.

A coordinator and workers serve in-process over gRPC (port 0); the data sets are small ``.npz``
files this module writes into the coordinator's data root. Each job's saved model is compared,
tensor by tensor within 1e-5, with training in this process on the same global batches, with
the task's mean loss written out here (not taken from ``shared.training.tasks``):

- regression: the mean squared error over every target of the batch (the mean of the
  per-sample means: every sample has D targets);
- language_model: the mean next-token cross-entropy over every position of the batch (the
  targets are the tokens shifted by one).

Then a user loss listed in ``allowed_losses``, and the refusals of data and models that do not
fit the task (before the job is queued, naming the field and the first bad row).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from shared.client import NeuroshardError
from shared.config import FileData, TrainJobSpec
from shared.training.data import Dataset, load_dataset
from shared.training.models import build_model
from tests.fixtures import ALLOWED_LOSSES, ALLOWED_MODELS
from tests.integration.test_training_equivalence import assert_same_state, load_saved_model
from tests.training_reference import MeanLoss, train_diloco_single_process, train_single_process

pytestmark = pytest.mark.integration

STEPS = 10
VOCAB = 12
TOKENS = 9  # tokens a row; the model sees 8 and predicts the next 8
OPERATOR = {"allowed_models": ALLOWED_MODELS, "allowed_losses": ALLOWED_LOSSES}


def regression_arrays(rows: int = 157) -> dict[str, np.ndarray]:
    """x [rows, 6] float32 and y [rows, 2] float32, a noisy linear map of x.

    157 rows with test_fraction 0.2 leave 125 training rows: shards of 63/62 on 2 workers.
    """
    rng = np.random.default_rng(3)
    x = rng.normal(size=(rows, 6)).astype(np.float32)
    w = rng.normal(size=(6, 2))
    y = (x @ w + 0.1 * rng.normal(size=(rows, 2))).astype(np.float32)
    return {"x": x, "y": y}


def token_arrays(rows: int = 101) -> dict[str, np.ndarray]:
    """x [rows, TOKENS] int64 tokens in [0, VOCAB): next = (5 x token + 3) mod VOCAB, 10% noise."""
    rng = np.random.default_rng(4)
    x = np.empty((rows, TOKENS), np.int64)
    x[:, 0] = rng.integers(0, VOCAB, rows)
    for t in range(1, TOKENS):
        x[:, t] = (5 * x[:, t - 1] + 3) % VOCAB
    noise = rng.random((rows, TOKENS)) < 0.1
    x[noise] = rng.integers(0, VOCAB, int(noise.sum()))
    return {"x": x}


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error over every target element of the batch."""
    return ((outputs - targets) ** 2).mean()


def next_token_ce(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: logits [B, T, V], tokens [B, T]."""
    return nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


REGRESSION: dict[str, Any] = {
    "task": "regression",
    "data": {"path": "reg.npz"},
    "model": {"name": "mlp", "hidden": [16]},
    "batch_size": 16,
}
LANGUAGE_MODEL: dict[str, Any] = {
    "task": "language_model",
    "data": {"path": "tokens.npz"},
    "model": {"entry": "tiny_lm", "args": {"vocab": VOCAB, "dim": 8}},
    "vocab_size": VOCAB,
    "batch_size": 8,
}
CASES = {
    "regression": (REGRESSION, regression_arrays, mse),
    "lm": (LANGUAGE_MODEL, token_arrays, next_token_ce),
}


def job(task: dict[str, Any], strategy: str, **extra: Any) -> dict[str, Any]:
    """A 2-worker job of ``STEPS`` fp32 SGD steps of the task."""
    return {
        "kind": "train",
        "strategy": strategy,
        "workers": 2,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "steps": STEPS,
        "test_fraction": 0.2,
        "seed": 5,
        **task,
        **extra,
    }


def write_npz(root: Path, name: str, arrays: dict[str, np.ndarray]) -> Path:
    """Write arrays to ``root/name`` and return the path."""
    root.mkdir(exist_ok=True)
    path = root / name
    np.savez(path, **arrays)
    return path


def dataset_of(spec: TrainJobSpec, root: Path) -> Dataset:
    """The job's split, as the daemons load it (the path resolved in ``root``)."""
    assert isinstance(spec.data, FileData)
    data = FileData(path=str(root / spec.data.path))
    return load_dataset(data, spec.seed, spec.test_fraction, spec.task, spec.vocab_size)


def allreduce_reference(spec: TrainJobSpec, ds: Dataset, loss: MeanLoss) -> nn.Module:
    """Single-process SGD on each allreduce step's global batch; written without the job's code.

    The global batch of step s (one epoch = ceil(N / G) steps, G = workers x batch_size) is
    rows ``perm[s * G : (s + 1) * G]`` of ``default_rng((seed, epoch, 7)).permutation(N)``.
    """
    model = build_model(spec.model, ds.input_shape, ds.num_classes, spec.seed, ALLOWED_MODELS)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    n, g = len(ds.y_train), spec.workers * spec.batch_size
    per_epoch = -(-n // g)
    for step in range(STEPS):
        epoch, s = divmod(step, per_epoch)
        rows = np.random.default_rng((spec.seed, epoch, 7)).permutation(n)[s * g : (s + 1) * g]
        x, y = torch.from_numpy(ds.x_train[rows]), torch.from_numpy(ds.y_train[rows])
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
    return model


def reference(spec_fields: dict[str, Any], root: Path, loss: MeanLoss) -> dict[str, torch.Tensor]:
    """The state_dict single-process training on the job's global batches ends with."""
    spec = TrainJobSpec.model_validate(spec_fields)
    ds = dataset_of(spec, root)
    if spec.strategy == "allreduce":
        model = allreduce_reference(spec, ds, loss)
    elif spec.strategy == "diloco":
        model = train_diloco_single_process(spec, ds, loss, ALLOWED_MODELS)
    else:
        model = train_single_process(spec, ds, STEPS, loss, ALLOWED_MODELS)
    return model.state_dict()


async def run(make_cluster, root: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """Run one job on a fresh 2-worker cluster; return its result (the job must succeed).

    The result gets ``board_tags``: the scalar tags of the job's TensorBoard event files.
    """
    cluster = await make_cluster(
        workers=2, data_roots=[str(root)], **OPERATOR, worker_overrides=OPERATOR
    )
    async with cluster.client() as client:
        submitted = await client.submit(spec)
        final = await client.wait(submitted.job_id)
    assert final.state == "SUCCEEDED", final.error
    run_dir = Path(cluster.coordinator.cfg.tensorboard_dir()) / final.job_id
    board = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    board.Reload()
    return final.result | {"board_tags": set(board.Tags()["scalars"])}


@pytest.mark.parametrize("strategy", ["sync", "allreduce", "diloco"])
@pytest.mark.parametrize("case", ["regression", "lm"])
async def test_task_job_equals_single_process_training(
    make_cluster, tmp_path: Path, case: str, strategy: str
) -> None:
    # Arrange
    task, arrays, loss = CASES[case]
    root = tmp_path / "data"
    write_npz(root, task["data"]["path"], arrays())
    extra = {"inner_steps": 3} if strategy == "diloco" else {}
    spec = job(task, strategy, **extra)
    expected = reference(spec, root, loss)

    # Act
    result = await run(make_cluster, root, spec)

    # Assert
    assert_same_state(load_saved_model(result), expected)
    last = result["history"][-1]
    if case == "regression":
        assert {"test_mse", "test_mae", "test_r2"} <= set(result)
        assert result["test_mse"] == pytest.approx(result["test_loss"], rel=1e-5)
        assert {"epoch/test_mse", "epoch/test_mae", "epoch/test_r2"} <= result["board_tags"]
    else:
        assert result["test_perplexity"] == pytest.approx(np.exp(result["test_loss"]), rel=1e-6)
        assert last["tokens_per_s"] == pytest.approx(last["samples_per_s"] * (TOKENS - 1))
        assert {"epoch/test_perplexity", "epoch/tokens_per_s"} <= result["board_tags"]
    assert "epoch/test_accuracy" not in result["board_tags"]  # NaN: not written


@pytest.mark.parametrize("strategy", ["sync", "allreduce"])
async def test_a_listed_user_loss_trains_as_single_process_with_that_loss(
    make_cluster, tmp_path: Path, strategy: str
) -> None:
    # Arrange: tests.fixtures.losses:scaled_abs(scale=2) gives 2 x mean |outputs - targets| per
    # sample; the reference writes that loss out.
    root = tmp_path / "data"
    write_npz(root, "reg.npz", regression_arrays())
    spec = job(REGRESSION, strategy, loss={"entry": "scaled_abs", "args": {"scale": 2.0}})
    expected = reference(spec, root, lambda out, y: 2.0 * (out - y).abs().mean())

    # Act
    result = await run(make_cluster, root, spec)

    # Assert
    assert_same_state(load_saved_model(result), expected)


async def _refused(make_cluster, root: Path, spec: dict[str, Any], **cfg: Any) -> NeuroshardError:
    cluster = await make_cluster(workers=0, data_roots=[str(root)], **(cfg or OPERATOR))
    async with cluster.client() as client:
        with pytest.raises(NeuroshardError) as err:
            await client.submit(spec)
        assert await client.jobs() == []
    return err.value


def _bad_regression_target() -> dict[str, np.ndarray]:
    arrays = regression_arrays()
    arrays["y"][17, 1] = np.nan
    return arrays


def _bad_token() -> dict[str, np.ndarray]:
    arrays = token_arrays()
    arrays["x"][23, 4] = VOCAB
    return arrays


def _complex_targets() -> dict[str, np.ndarray]:
    arrays = regression_arrays()
    return {"x": arrays["x"], "y": arrays["y"].astype(np.complex64)}


@pytest.mark.parametrize(
    ("task", "arrays", "message"),
    [
        (REGRESSION, _bad_regression_target, "array 'y' row 17 is NaN or infinite"),
        (REGRESSION, _complex_targets, "array 'y' has dtype complex64"),
        (
            REGRESSION,
            lambda: {"x": regression_arrays()["x"], "y": np.zeros((157, 2, 2), np.float32)},
            "array 'y' must be [N] or [N, D] for task regression, got (157, 2, 2)",
        ),
        (LANGUAGE_MODEL, _bad_token, "array 'x' row 23 has a token id outside [0, vocab_size 12)"),
        (
            LANGUAGE_MODEL,
            lambda: {"x": regression_arrays()["x"]},
            "array 'x' must be integer tokens for task language_model, got float32",
        ),
    ],
    ids=["nan target", "complex targets", "target shape", "token >= vocab", "float tokens"],
)
async def test_data_that_does_not_fit_the_task_is_refused_before_queueing(
    make_cluster, tmp_path: Path, task: dict[str, Any], arrays: Any, message: str
) -> None:
    root = tmp_path / "data"
    write_npz(root, task["data"]["path"], arrays())

    err = await _refused(make_cluster, root, job(task, "sync"))

    assert err.code is grpc.StatusCode.INVALID_ARGUMENT
    assert f"data.path: {task['data']['path']}: {message}" in str(err)


async def test_a_model_whose_output_does_not_fit_the_targets_is_refused_naming_both_shapes(
    make_cluster, tmp_path: Path
) -> None:
    # small_mlp(classes=3) answers [B, 3]; the targets are [B, 2].
    root = tmp_path / "data"
    write_npz(root, "reg.npz", regression_arrays())
    model = {"entry": "small_mlp", "args": {"features": 6, "classes": 3}}

    err = await _refused(make_cluster, root, job(REGRESSION, "sync", model=model))

    assert err.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "model: model output [2, 3] does not fit regression targets [2, 2]" in str(err)


async def test_a_loss_the_operator_did_not_list_is_permission_denied(
    make_cluster, tmp_path: Path
) -> None:
    root = tmp_path / "data"
    write_npz(root, "reg.npz", regression_arrays())
    spec = job(REGRESSION, "sync", loss={"entry": "scaled_abs"})

    err = await _refused(make_cluster, root, spec, allowed_models=ALLOWED_MODELS)

    assert err.code is grpc.StatusCode.PERMISSION_DENIED
    assert "loss.entry: 'scaled_abs' is not in the coordinator's allowed_losses" in str(err)


async def test_an_uploaded_token_set_trains_a_language_model(make_cluster, tmp_path: Path) -> None:
    # Arrange: the upload's task is not known; int64 x without y is a token set.
    cluster = await make_cluster(workers=2, **OPERATOR, worker_overrides=OPERATOR)
    src = write_npz(tmp_path / "src", "tokens.npz", token_arrays())

    # Act
    async with cluster.client() as client:
        info = await client.put_dataset(src)
        submitted = await client.submit(job(LANGUAGE_MODEL, "sync"))
        final = await client.wait(submitted.job_id)

    # Assert
    assert info["arrays"] == [{"name": "x", "dtype": "int64", "shape": [101, TOKENS]}]
    assert final.state == "SUCCEEDED", final.error
    assert final.result["test_perplexity"] < VOCAB  # better than uniform over the vocabulary


@pytest.mark.parametrize("strategy", ["sync", "allreduce"])
async def test_a_loss_the_workers_do_not_list_fails_the_job_with_their_reason(
    make_cluster, tmp_path: Path, strategy: str
) -> None:
    # The coordinator lists the loss; the workers do not: they refuse before loading anything.
    root = tmp_path / "data"
    write_npz(root, "reg.npz", regression_arrays())
    cluster = await make_cluster(
        workers=2,
        data_roots=[str(root)],
        **OPERATOR,
        worker_overrides={"allowed_models": ALLOWED_MODELS},
    )
    spec = job(REGRESSION, strategy, loss={"entry": "scaled_abs"})

    async with cluster.client() as client:
        submitted = await client.submit(spec)
        final = await client.wait(submitted.job_id)

    assert final.state == "FAILED"
    assert "loss.entry: 'scaled_abs' is not in the worker" in final.error
    assert "allowed_losses" in final.error


async def test_a_regression_job_starts_from_an_earlier_jobs_weights(
    make_cluster, tmp_path: Path
) -> None:
    # init: {job: ID} builds the spec's model for the task's data (D = 2 outputs) at admission.
    root = tmp_path / "data"
    write_npz(root, "reg.npz", regression_arrays())
    cluster = await make_cluster(
        workers=2, data_roots=[str(root)], **OPERATOR, worker_overrides=OPERATOR
    )

    async with cluster.client() as client:
        first = await client.wait((await client.submit(job(REGRESSION, "sync"))).job_id)
        again = job(REGRESSION, "sync", init={"job": first.job_id})
        second = await client.wait((await client.submit(again)).job_id)

    assert (first.state, second.state) == ("SUCCEEDED", "SUCCEEDED"), second.error
    assert second.result["test_loss"] < first.result["history"][0]["test_loss"]
