"""``strategy: allreduce`` through real daemons: DDP in the workers' child processes.

The final parameters equal single-process training on the same global batches (the rows of
``shared.training.partition``) within 1e-5, for 1, 2 and 3 workers; a worker that dies
mid-job is replaced by a new generation of the survivors without losing or repeating a row.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.fixtures import ALLOWED_MODELS
from tests.integration.test_failover import kill_abruptly
from worker.allreduce.allreduce_sessions import CHILD_MODULE

pytestmark = pytest.mark.integration

STEPS = 20
DIGITS_ALLREDUCE = Path(__file__).resolve().parents[2] / "configs/jobs/digits-allreduce.yaml"


def _spec(workers: int, **extra: Any) -> dict[str, Any]:
    return {
        "kind": "train",
        "strategy": "allreduce",
        "workers": workers,
        "steps": STEPS,
        "batch_size": 16,
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        **extra,
    }


def reference_params(spec_dict: dict[str, Any], steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Single-process SGD on each step's whole global batch; written without the job's code.

    The global batch of step s (one epoch = ceil(N / G) steps, G = workers x batch_size) is
    rows ``perm[s * G : (s + 1) * G]`` of ``default_rng((seed, epoch, 7)).permutation(N)``.
    """
    from shared.config import TrainJobSpec
    from shared.training.data import load_dataset
    from shared.training.models import build_model

    spec = TrainJobSpec(**spec_dict)
    ds = load_dataset(spec.data, spec.seed, spec.test_fraction)
    n = len(ds.y_train)
    g = spec.workers * spec.batch_size * spec.grad_accum_steps
    per_epoch = -(-n // g)
    model = build_model(
        spec.model, ds.input_shape, ds.num_classes, spec.seed, allowed_models=ALLOWED_MODELS
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        epoch, s = divmod(step, per_epoch)
        rows = np.random.default_rng((spec.seed, epoch, 7)).permutation(n)[s * g : (s + 1) * g]
        x, y = torch.from_numpy(ds.x_train[rows]), torch.from_numpy(ds.y_train[rows])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def _saved(path: str) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(Path(path).read_bytes()), weights_only=True)


def _max_diff(path: str, ref: dict[str, torch.Tensor]) -> float:
    got = _saved(path)
    assert set(got) == set(ref)
    return max(float((got[k] - v).abs().max()) for k, v in ref.items())


def _cuda(n: int) -> Any:
    return pytest.param(n, "cuda", marks=pytest.mark.gpu, id=f"{n}-cuda")


@pytest.mark.parametrize(
    ("workers", "device"), [(1, "cpu"), (2, "cpu"), (3, "cpu"), _cuda(1), _cuda(2)]
)
async def test_allreduce_equals_single_process_training(
    make_cluster, workers: int, device: str
) -> None:
    # Arrange (on CUDA: nccl, the same tolerance)
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    cluster = await make_cluster(workers=workers)
    spec = _spec(workers, device=device)
    async with cluster.client() as client:
        # Act
        job = await client.submit(spec)
        final = await client.wait(job.job_id)

    # Assert
    assert final.state == "SUCCEEDED", final.error
    result = final.result
    assert result["strategy"] == "allreduce"
    assert result["generations"] == 1 and result["worker_failures"] == 0
    assert _max_diff(result["model_path"], reference_params(spec)) < 1e-5


async def test_refused_model_fails_the_job_with_the_workers_reason(make_cluster) -> None:
    # The coordinator allows the import; the worker does not: nothing is imported there.
    cluster = await make_cluster(
        workers=1, allowed_models=ALLOWED_MODELS, worker_overrides={"allowed_models": {}}
    )
    spec = _spec(1, model={"entry": "small_mlp"})
    async with cluster.client() as client:
        job = await client.submit(spec)
        final = await client.wait(job.job_id)
    assert final.state == "FAILED"
    assert "refused the job" in final.error and "allowed_models" in final.error
    # Refused before any training process started (nothing imported the module there): no
    # child of this process (the in-process worker's) runs the training child.
    import importlib.util
    import os
    import subprocess

    assert importlib.util.find_spec(CHILD_MODULE) is not None  # the pattern names the child
    mine = ["pgrep", "-P", str(os.getpid()), "-f", CHILD_MODULE]
    procs = subprocess.run(mine, capture_output=True)  # noqa: ASYNC221
    assert procs.stdout == b""


async def test_worker_killed_mid_epoch_new_generation_loses_no_row(make_cluster) -> None:
    # Arrange: 3 workers train digits with allreduce; one dies in the middle of epoch 2.
    import yaml

    # The training state (rank 0 to the coordinator at each checkpoint, the coordinator to the
    # next generation's rank 0) in 1 KiB chunks, dozens per transfer: a dropped chunk leaves a
    # state torch cannot load and the job fails (issue 20 #4).
    tiny: dict[str, object] = {"chunk_bytes": 1024}
    # Heartbeats slower than FAST_HEARTBEATS: a 0.6 s timeout declared a survivor dead under
    # CI load (worker_failures 2); the killed worker is found by the failed calls' probe.
    beats = {"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 2.0}
    cluster = await make_cluster(workers=3, **beats, **tiny, worker_overrides=tiny)
    spec = yaml.safe_load(DIGITS_ALLREDUCE.read_text())  # min_workers: 2
    async with cluster.client() as client:
        job = await client.submit(spec)
        async for _, progress in client.watch(job.job_id):
            per_epoch = progress.get("steps", 0) // progress.get("epochs", 1)
            if progress and progress["step"] >= per_epoch + per_epoch // 2:
                break
        # Act: worker-1 dies; worker-3 turns up and is taken in at a later generation.
        await kill_abruptly(cluster.workers[1])
        await cluster.add_worker("worker-3")
        final = await client.wait(job.job_id)

    # Assert: new generations (survivors, then with the newcomer) finished the job.
    assert final.state == "SUCCEEDED", final.error
    result = final.result
    assert result["worker_failures"] == 1
    assert result["generations"] in (2, 3)  # 2 when worker-3 registered before the 2nd
    assert set(result["workers"]) == {"worker-0", "worker-1", "worker-2", "worker-3"}
    assert result["workers"]["worker-3"]["generations"] == 1
    assert result["test_accuracy"] >= 0.95
    n_train = 1797 - int(np.ceil(1797 * 0.2))
    assert [h["samples"] for h in result["history"]] == [n_train] * result["epochs"]
    assert [h["epoch"] for h in result["history"]] == list(range(1, result["epochs"] + 1))


BN_MODEL = {"entry": "bn_hidden_mlp"}


async def test_sync_batchnorm_equals_single_process_batchnorm(make_cluster) -> None:
    # Arrange: BatchNorm statistics over the global batch, on CPU (CpuSyncBatchNorm).
    cluster = await make_cluster(
        workers=2,
        allowed_models=ALLOWED_MODELS,
        worker_overrides={"allowed_models": ALLOWED_MODELS},
    )
    spec = _spec(2, model=BN_MODEL, sync_batchnorm=True)
    async with cluster.client() as client:
        # Act
        final = await client.wait((await client.submit(spec)).job_id)

    # Assert: parameters and running statistics as one process on the global batch.
    assert final.state == "SUCCEEDED", final.error
    ref = reference_params(spec)
    assert "2.running_mean" in ref and "2.running_var" in ref
    assert _max_diff(final.result["model_path"], ref) < 1e-5


async def test_plain_allreduce_keeps_rank0_statistics_that_moved(make_cluster) -> None:
    # Without sync_batchnorm, DDP broadcasts rank 0's buffers: trained, not initial, values.
    cluster = await make_cluster(
        workers=2,
        allowed_models=ALLOWED_MODELS,
        worker_overrides={"allowed_models": ALLOWED_MODELS},
    )
    spec = _spec(2, model=BN_MODEL)
    async with cluster.client() as client:
        final = await client.wait((await client.submit(spec)).job_id)
    assert final.state == "SUCCEEDED", final.error
    got = _saved(final.result["model_path"])
    assert float(got["2.running_mean"].abs().max()) > 1e-3  # initial: zeros
    assert float((got["2.running_var"] - 1).abs().max()) > 1e-3  # initial: ones
    assert int(got["2.num_batches_tracked"]) == STEPS
    # ...and not the global batch's statistics (those need sync_batchnorm).
    assert _max_diff(final.result["model_path"], reference_params(spec)) > 1e-4


async def test_grad_accumulation_equals_the_larger_batch(make_cluster) -> None:
    # grad_accum_steps 2 at batch 8 trains on the rows of batch 16, in two micro-batches.
    cluster = await make_cluster(workers=2)
    spec = _spec(2, batch_size=8, grad_accum_steps=2)
    async with cluster.client() as client:
        final = await client.wait((await client.submit(spec)).job_id)
    assert final.state == "SUCCEEDED", final.error
    assert _max_diff(final.result["model_path"], reference_params(_spec(2, batch_size=16))) < 1e-5


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
async def test_mixed_precision_trains_digits(make_cluster, precision: str) -> None:
    cluster = await make_cluster(workers=2)
    spec = {
        "kind": "train",
        "strategy": "allreduce",
        "workers": 2,
        "epochs": 6,
        "optimizer": {"name": "adamw", "lr": 0.003},
        "precision": precision,
        "clip_grad_norm": 5.0,
    }
    async with cluster.client() as client:
        final = await client.wait((await client.submit(spec)).job_id)
    assert final.state == "SUCCEEDED", final.error
    assert final.result["test_accuracy"] >= 0.9
    assert final.result["best_test_accuracy"] >= final.result["test_accuracy"]
    assert Path(final.result["best_model_path"]).is_file()  # noqa: ASYNC240


async def test_history_follows_the_lr_schedule(make_cluster) -> None:
    from shared.config import TrainJobSpec
    from shared.training.controls import lr_factor

    cluster = await make_cluster(workers=1)
    spec = {
        "kind": "train",
        "strategy": "allreduce",
        "workers": 1,
        "epochs": 3,
        "batch_size": 64,
        "optimizer": {"name": "sgd", "lr": 0.2},
        "lr_schedule": {"name": "cosine", "warmup_steps": 5, "min_lr_factor": 0.1},
    }
    async with cluster.client() as client:
        final = await client.wait((await client.submit(spec)).job_id)
    assert final.state == "SUCCEEDED", final.error
    history, total = final.result["history"], final.result["steps"]
    assert [h["epoch"] for h in history] == [1, 2, 3]
    parsed = TrainJobSpec(**spec)
    for h in history:  # the lr of the epoch's last step
        assert h["lr"] == pytest.approx(0.2 * lr_factor(parsed, h["step"] - 1, total), rel=1e-6)
    assert history[-1]["lr"] < history[0]["lr"]


async def test_file_data_set_is_fetched_whole_and_its_temporary_copy_removed(
    make_cluster, tmp_path: Path
) -> None:
    # Arrange: a user's .npz in the coordinator's data root (no shared disk with workers).
    import tempfile

    from sklearn.datasets import load_digits

    cluster = await make_cluster(workers=2)
    digits = load_digits()
    root = tmp_path / "coord" / "datasets"
    root.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 (set-up, before any job)
    np.savez(root / "mine.npz", x=(digits.images / 16).astype(np.float32), y=digits.target)
    before = set(Path(tempfile.gettempdir()).glob("neuroshard-train-*"))  # noqa: ASYNC240
    spec = _spec(2, data={"path": "mine.npz"})
    async with cluster.client() as client:
        # Act
        job = await client.submit(spec)
        final = await client.wait(job.job_id)

    # Assert: trained on the fetched rows; no copy of them left in the temporary directory.
    assert final.state == "SUCCEEDED", final.error
    assert final.result["history"][-1]["samples"] == STEPS * 32  # 20 steps of 2 x 16 rows
    left = set(Path(tempfile.gettempdir()).glob(f"neuroshard-{job.job_id[:16]}-*"))  # noqa: ASYNC240
    assert left - before == set()
