"""The training controls of ``strategy: sync`` through real in-process daemons.

Gradient accumulation equals a larger batch, BatchNorm statistics reach the saved model,
bf16/fp16 train the digits, the history and best model are consistent, and the device is
resolved for the job's workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from shared.config import TrainJobSpec
from shared.training.controls import lr_factor
from shared.training.data import batch_indices, load_dataset, steps_per_epoch
from shared.training.models import build_model
from tests.fixtures import ALLOWED_MODELS
from tests.fixtures.models import bn_mlp

pytestmark = pytest.mark.integration

ALLOWED = {"allowed_models": ALLOWED_MODELS}


async def run(cluster, spec: dict[str, Any]):
    async with cluster.client() as client:
        job = await client.submit(spec)
        events = [progress async for _, progress in client.watch(job.job_id)]
        final = await client.wait(job.job_id)
    assert final.state == "SUCCEEDED", final.error
    return final.result, events


def saved(path: str) -> dict[str, torch.Tensor]:
    return torch.load(Path(path), weights_only=True)


def accuracy(model: nn.Module, state: dict[str, torch.Tensor], spec: TrainJobSpec) -> float:
    """The test accuracy of a saved state_dict, evaluated here in eval mode."""
    data = load_dataset(spec.data, spec.seed, spec.test_fraction)
    model.load_state_dict(state)
    with torch.no_grad():
        logits = model.eval()(torch.from_numpy(data.x_test))
    return float((logits.argmax(1) == torch.from_numpy(data.y_test)).float().mean())


async def test_accumulating_k_micro_batches_equals_a_k_times_larger_batch(make_cluster) -> None:
    cluster = await make_cluster(workers=2)
    base = {"kind": "train", "workers": 2, "steps": 26, "optimizer": {"name": "sgd", "lr": 0.1}}

    # 26 steps of 2 x 16 rows per worker cross an epoch (23 steps), like 26 steps of 32.
    accumulated, _ = await run(cluster, base | {"batch_size": 16, "grad_accum_steps": 2})
    large, _ = await run(cluster, base | {"batch_size": 32})

    assert accumulated["samples"] == large["samples"]
    a, b = saved(accumulated["model_path"]), saved(large["model_path"])
    for name, value in b.items():
        torch.testing.assert_close(a[name], value, rtol=0, atol=1e-5, msg=name)


async def test_batchnorm_statistics_of_two_workers_reach_the_saved_model(make_cluster) -> None:
    # Arrange: BatchNorm on the raw inputs, so its statistics depend on the rows alone.
    cluster = await make_cluster(workers=2, worker_overrides=ALLOWED, **ALLOWED)
    steps = 30  # crosses an epoch (23 steps): shorter last batches weigh less
    model = {"entry": "bn_mlp"}
    job = {"kind": "train", "workers": 2, "steps": steps, "model": model}
    spec = TrainJobSpec.model_validate(job)
    data = load_dataset(spec.data, spec.seed, spec.test_fraction)
    x_NF = data.x_train.reshape(len(data.x_train), -1).astype(np.float64)

    # Act
    result, _ = await run(cluster, job)

    # Assert: by hand, each step r <- 0.9 r + 0.1 sum_w (n_w / N) stat_w (torch's momentum
    # 0.1, unbiased batch variances), where stat_w are worker w's batch mean and variance.
    mean, var = np.zeros(64), np.ones(64)
    per_epoch = steps_per_epoch(len(x_NF), 2, 32)
    for g in range(steps):
        epoch, step = divmod(g, per_epoch)
        shards = [x_NF[batch_indices(len(x_NF), s, 2, 32, epoch, step, 0)] for s in range(2)]
        n = sum(len(x) for x in shards)
        mean = 0.9 * mean + 0.1 * sum(len(x) / n * x.mean(0) for x in shards)
        var = 0.9 * var + 0.1 * sum(len(x) / n * x.var(0, ddof=1) for x in shards)
    state = saved(result["model_path"])
    assert np.abs(mean).max() > 0.1 and np.abs(var - 1).max() > 0.1  # moved from the start
    np.testing.assert_allclose(state["1.running_mean"].numpy(), mean, atol=1e-5)
    np.testing.assert_allclose(state["1.running_var"].numpy(), var, atol=1e-5)
    assert int(state["1.num_batches_tracked"]) == steps
    # The coordinator evaluated with the same statistics as the saved model holds.
    assert accuracy(bn_mlp(), state, spec) == pytest.approx(result["test_accuracy"])


def assert_history_consistent(result: dict[str, Any], events: list[dict[str, Any]]) -> None:
    history = result["history"]
    assert [e["epoch"] for e in history] == list(range(1, result["epochs"] + 1))
    assert history[-1]["test_accuracy"] == result["test_accuracy"]
    assert result["best_test_accuracy"] == max(e["test_accuracy"] for e in history)
    assert all(e["samples_per_s"] > 0 and e["train_loss"] > 0 for e in history)
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert events[-1]["history"] == history  # what submit --follow prints
    assert [] in [e.get("history") for e in events]  # none before the first epoch ended


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
async def test_reduced_precision_trains_the_digits(make_cluster, precision: str) -> None:
    cluster = await make_cluster(workers=2)
    job = {
        "kind": "train",
        "workers": 2,
        "epochs": 6,
        "precision": precision,
        "optimizer": {"name": "adamw", "lr": 0.003},
        "lr_schedule": {"name": "cosine", "warmup_steps": 10, "min_lr_factor": 0.1},
        "clip_grad_norm": 5.0,
    }
    spec = TrainJobSpec.model_validate(job)

    result, events = await run(cluster, job)

    assert result["test_accuracy"] >= 0.9 and result["device"] == "cpu"
    assert_history_consistent(result, events)
    per_epoch, total = 23, 6 * 23  # 719 rows per shard in 23 steps of 32
    for e in result["history"]:  # the rate of each epoch's last step
        assert e["lr"] == pytest.approx(0.003 * lr_factor(spec, e["epoch"] * per_epoch - 1, total))
    best = saved(result["best_model_path"])
    model = build_model(spec.model, (1, 8, 8), 10, spec.seed)
    assert accuracy(model, best, spec) == pytest.approx(result["best_test_accuracy"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a cluster without CUDA")
async def test_cuda_on_workers_without_it_fails_with_the_reason(make_cluster) -> None:
    cluster = await make_cluster(workers=1)
    async with cluster.client() as client:
        job = await client.submit({"kind": "train", "steps": 2, "device": "cuda"})
        final = await client.wait(job.job_id)

    assert final.state == "FAILED"
    assert final.error == "device: cuda asked for, but worker worker-0 trains on cpu"


@pytest.mark.gpu
async def test_auto_trains_on_cuda_when_every_worker_has_it(make_cluster) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    cluster = await make_cluster(workers=2)
    job = {"kind": "train", "workers": 2, "epochs": 3, "optimizer": {"name": "adam", "lr": 3e-3}}

    result, _ = await run(cluster, job)

    assert result["device"] == "cuda" and result["test_accuracy"] >= 0.9
