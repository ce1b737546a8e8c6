"""``sharding: fsdp`` and ``activation_checkpointing`` through real daemons (CPU, gloo).

FSDP (torch's ``fully_shard``) trains to the parameters of single-process training and of DDP
within 1e-5; the states the coordinator checkpoints are full, unsharded state dicts; a worker
that dies mid-job is replaced by a new generation that re-shards the newest checkpoint over
the survivors (and a newcomer), and the job finishes with every row of every epoch trained
once. Activation checkpointing changes memory, not results.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from coordinator.training.checkpoints import read_checkpoint
from shared.config import TrainJobSpec
from shared.training.data import load_dataset
from shared.training.models import build_model
from tests.conftest import wait_until
from tests.fixtures import ALLOWED_MODELS
from tests.integration.test_allreduce import (
    BN_MODEL,
    DIGITS_ALLREDUCE,
    _max_diff,
    _saved,
    _spec,
    reference_params,
)
from tests.integration.test_failover import FAST_HEARTBEATS, kill_abruptly

pytestmark = pytest.mark.integration

ENTRIES = {"allowed_models": ALLOWED_MODELS}
BLOCKS = {"entry": "block_mlp"}
# Adam's moments, a schedule, clipping and micro-batches: every control FSDP must shard or
# keep in step with DDP.
CONTROLS: dict[str, Any] = {
    "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.01},
    "lr_schedule": {"name": "cosine", "warmup_steps": 3},
    "clip_grad_norm": 0.5,
    "batch_size": 8,
    "grad_accum_steps": 2,
}


@pytest.mark.parametrize(
    ("workers", "extra"),
    [
        (2, {}),
        (3, {}),
        (2, {"model": BN_MODEL, "sync_batchnorm": True}),
    ],
    ids=["2-mlp", "3-mlp", "2-sync-batchnorm"],
)
async def test_fsdp_equals_single_process_training(
    make_cluster, workers: int, extra: dict[str, Any]
) -> None:
    # Arrange: the reference of test_allreduce (SGD with momentum on each global batch).
    cluster = await make_cluster(workers=workers, **ENTRIES, worker_overrides=ENTRIES)
    spec = _spec(workers, sharding="fsdp", **extra)
    async with cluster.client() as client:
        # Act
        final = await client.wait((await client.submit(spec)).job_id)

    # Assert
    assert final.state == "SUCCEEDED", final.error
    assert final.result["generations"] == 1
    assert _max_diff(final.result["model_path"], reference_params(spec)) < 1e-5


async def test_fsdp_and_activation_checkpointing_equal_ddp(make_cluster) -> None:
    # Arrange: a model of residual blocks (a `blocks` ModuleList), every training control.
    cluster = await make_cluster(workers=2, **ENTRIES, worker_overrides=ENTRIES)
    base = _spec(2, model=BLOCKS, **CONTROLS)
    variants = {
        "ddp": base,
        "ddp+ac": {**base, "activation_checkpointing": True},
        "fsdp": {**base, "sharding": "fsdp"},
        "fsdp+ac": {**base, "sharding": "fsdp", "activation_checkpointing": True},
    }
    paths: dict[str, str] = {}
    async with cluster.client() as client:
        # Act: one job after the other on the same two workers.
        for name, spec in variants.items():
            final = await client.wait((await client.submit(spec)).job_id)
            assert final.state == "SUCCEEDED", f"{name}: {final.error}"
            paths[name] = final.result["model_path"]

    # Assert: the same parameters, under the same names, within 1e-5.
    ddp = _saved(paths["ddp"])
    assert any(k.startswith("blocks.2.") for k in ddp)
    for name in ("ddp+ac", "fsdp", "fsdp+ac"):
        assert _max_diff(paths[name], ddp) < 1e-5, name
    initial = build_model(
        TrainJobSpec(**base).model, (64,), 10, 0, allowed_models=ALLOWED_MODELS
    ).state_dict()
    assert _max_diff(paths["fsdp"], initial) > 1e-3  # it trained


async def test_activation_checkpointing_equals_plain_sync_training(make_cluster) -> None:
    # Arrange: strategy sync, the workers' gradients with and without recomputation.
    cluster = await make_cluster(workers=2, **ENTRIES, worker_overrides=ENTRIES)
    base = {**_spec(2, model=BLOCKS), "strategy": "sync"}
    async with cluster.client() as client:
        # Act
        plain = await client.wait((await client.submit(base)).job_id)
        ac = await client.wait(
            (await client.submit({**base, "activation_checkpointing": True})).job_id
        )

    # Assert
    assert plain.state == ac.state == "SUCCEEDED", (plain.error, ac.error)
    assert _max_diff(ac.result["model_path"], _saved(plain.result["model_path"])) < 1e-5


async def test_fsdp_rank0_killed_survivors_reshard_the_checkpoint_exactly(make_cluster) -> None:
    # Arrange: 3 of 4 workers train, a checkpoint every 10 steps. When rank 0 (worker-0)
    # dies, the idle worker-3 fills its place: each survivor gets a new rank and its shards
    # new offsets. Heartbeats slow enough for a loaded machine: the killed worker's peers see
    # its connections close at once, its death needs no quick detection.
    beats: dict[str, float] = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 3.0}
    cluster = await make_cluster(workers=4, **beats, checkpoint_every_steps=10)
    steps = 100
    spec = _spec(3, min_workers=2, sharding="fsdp", steps=steps)
    async with cluster.client() as client:
        job = await client.submit(spec)
        async for _, progress in client.watch(job.job_id):
            if progress.get("step", 0) >= 20:
                break
        # Act
        await kill_abruptly(cluster.workers[0])
        final = await client.wait(job.job_id)

    # Assert: later generations went on from the newest checkpoint, as one process would.
    assert final.state == "SUCCEEDED", final.error
    result = final.result
    assert result["generations"] >= 2 and result["worker_failures"] >= 1
    assert "worker-3" in result["workers"]
    assert _max_diff(result["model_path"], reference_params(spec, steps)) < 1e-5


async def test_fsdp_worker_killed_new_generation_reshards_and_loses_no_row(
    make_cluster,
) -> None:
    # Arrange: 3 workers, FSDP, a checkpoint every 10 steps (15 steps an epoch); the state
    # travels in 1 KiB chunks.
    tiny: dict[str, object] = {"chunk_bytes": 1024}
    cluster = await make_cluster(
        workers=3, **FAST_HEARTBEATS, **tiny, checkpoint_every_steps=10, worker_overrides=tiny
    )
    spec = yaml.safe_load(DIGITS_ALLREDUCE.read_text())  # min_workers: 2, adamw, cosine
    spec.update(sharding="fsdp", epochs=6)
    async with cluster.client() as client:
        job = await client.submit(spec)
        async for _, progress in client.watch(job.job_id):
            per_epoch = progress.get("steps", 0) // progress.get("epochs", 1)
            if progress and progress["step"] >= per_epoch + per_epoch // 2:
                break
        # The checkpoint the coordinator holds is the full, unsharded state.
        path = _checkpoint_path(cluster, job.job_id)
        await wait_until(path.exists, what="the job's checkpoint")
        _assert_full_state(path, spec)
        # Act: worker-1 dies; worker-3 turns up and is taken in at a later generation.
        await kill_abruptly(cluster.workers[1])
        await cluster.add_worker("worker-3")
        final = await client.wait(job.job_id)

    # Assert: new generations finished the job; every epoch holds every row once.
    assert final.state == "SUCCEEDED", final.error
    result = final.result
    assert result["worker_failures"] == 1
    assert result["generations"] in (2, 3)  # 2 when worker-3 registered before the 2nd
    assert set(result["workers"]) == {"worker-0", "worker-1", "worker-2", "worker-3"}
    assert result["test_accuracy"] >= 0.9
    n_train = 1797 - int(np.ceil(1797 * 0.2))
    assert [h["samples"] for h in result["history"]] == [n_train] * result["epochs"]
    assert [h["epoch"] for h in result["history"]] == list(range(1, result["epochs"] + 1))


def _checkpoint_path(cluster: Any, job_id: str) -> Any:
    from pathlib import Path

    return Path(cluster.coordinator.cfg.data_dir) / "checkpoints" / f"{job_id}.ckpt"


def _assert_full_state(path: Any, spec_dict: dict[str, Any]) -> None:
    """The checkpoint holds every parameter and AdamW moment at the model's full shape."""
    saved = read_checkpoint(path)
    assert saved is not None
    step, data = saved
    state = torch.load(io.BytesIO(data), weights_only=True)  # plain tensors only
    spec = TrainJobSpec(**spec_dict)
    ds = load_dataset(spec.data, spec.seed, spec.test_fraction)
    model = build_model(spec.model, ds.input_shape, ds.num_classes, spec.seed)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in state["model"].items()} == shapes
    assert state["step"] == step > 0
    moments = state["optimizer"]["state"]
    assert set(moments) == set(shapes)
    for name, per_param in moments.items():
        assert tuple(per_param["exp_avg"].shape) == shapes[name]
        assert tuple(per_param["exp_avg_sq"].shape) == shapes[name]
