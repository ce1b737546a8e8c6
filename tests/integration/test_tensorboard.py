"""Train jobs' TensorBoard event files, read back with TensorBoard's own reader.

A short ``sync`` job and a short ``allreduce`` job run through real daemons; their run
directories (``DATA_DIR/tensorboard/JOB_ID``) are loaded with ``EventAccumulator`` and must
hold the tags of ``coordinator.training.tensorboard_log``: one scalar per epoch equal to the
job's history entry (float32, as TensorBoard stores scalars), the step's figures at every
step (allreduce: at every progress report). A cancelled job's file holds the steps it ran.
``neuroshard tensorboard`` is started on port 0 over a data dir and must list its job's run.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
# The per-epoch tags every job writes (more when a history entry has more fields).
EPOCH_FIELDS = ("train_loss", "test_loss", "test_accuracy", "lr", "samples_per_s")


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] of every scalar in the run directory."""
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})  # 0: keep them all
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _assert_epochs_equal_history(
    scalars: dict[str, list[tuple[int, float]]], history: list[dict[str, Any]], steps: list[int]
) -> None:
    """One ``epoch/FIELD`` scalar per history entry, at the epoch's last step, equal to it."""
    for field in (*EPOCH_FIELDS, *(k for k in history[0] if k not in ("epoch", "step"))):
        got = scalars[f"epoch/{field}"]
        assert [s for s, _ in got] == steps, field
        want = [pytest.approx(h[field], rel=1e-6, abs=1e-9) for h in history]
        assert [v for _, v in got] == want, field


async def test_a_sync_job_writes_its_steps_epochs_and_workers(make_cluster) -> None:
    # Arrange
    cluster = await make_cluster(workers=2)
    spec = {"kind": "train", "workers": 2, "epochs": 2, "batch_size": 64, "health_threshold": 0.0}
    async with cluster.client() as client:
        # Act
        final = await client.wait((await client.submit(spec)).job_id)

    # Assert
    assert final.state == "SUCCEEDED", final.error
    result = final.result
    run_dir = Path(cluster.coordinator.cfg.tensorboard_dir()) / final.job_id
    scalars = _scalars(run_dir)
    total, history = result["steps"], result["history"]
    per_epoch = total // len(history)
    assert len(history) == 2 and total == 2 * per_epoch
    every_step = list(range(1, total + 1))
    assert [s for s, _ in scalars["train/loss"]] == every_step
    assert [s for s, _ in scalars["train/lr"]] == every_step
    lrs = dict(scalars["train/lr"])
    assert [lrs[per_epoch * h["epoch"]] for h in history] == [
        pytest.approx(h["lr"], rel=1e-6) for h in history
    ]
    _assert_epochs_equal_history(scalars, history, [per_epoch, total])
    for name in result["workers"]:
        wall, compute, transfer = (
            dict(scalars[f"workers/{name}/{kind}_ms"]) for kind in ("step", "compute", "transfer")
        )
        assert sorted(wall) == every_step, name
        for s in every_step:
            assert 0 < compute[s] <= wall[s] * (1 + 1e-6), (name, s)
            assert transfer[s] == pytest.approx(wall[s] - compute[s], rel=1e-5, abs=1e-3)


async def test_an_allreduce_job_writes_its_progress_and_epochs(make_cluster) -> None:
    # Arrange
    cluster = await make_cluster(workers=2)
    spec = {
        "kind": "train",
        "strategy": "allreduce",
        "workers": 2,
        "epochs": 2,
        "batch_size": 64,
        "optimizer": {"name": "sgd", "lr": 0.1},
        "lr_schedule": {"name": "cosine", "warmup_steps": 3},
    }
    async with cluster.client() as client:
        # Act
        final = await client.wait((await client.submit(spec)).job_id)

    # Assert: a loss and lr at each report, the last at the job's end, one at every epoch's end
    assert final.state == "SUCCEEDED", final.error
    result = final.result
    scalars = _scalars(Path(cluster.coordinator.cfg.tensorboard_dir()) / final.job_id)
    history = result["history"]
    epoch_ends = [h["step"] for h in history]
    assert epoch_ends == [result["steps"] // 2, result["steps"]]
    reports = [s for s, _ in scalars["train/loss"]]
    assert reports == sorted(set(reports)) and set(epoch_ends) <= set(reports)
    lrs = dict(scalars["train/lr"])
    assert [lrs[s] for s in epoch_ends] == [pytest.approx(h["lr"], rel=1e-6) for h in history]
    _assert_epochs_equal_history(scalars, history, epoch_ends)
    rank0 = [t for t in scalars if t.startswith("workers/")]
    assert len(rank0) == 1 and re.fullmatch(r"workers/worker-\d/step_ms", rank0[0])
    assert [s for s, _ in scalars[rank0[0]]] == reports
    assert all(v > 0 for _, v in scalars[rank0[0]])


async def test_a_cancelled_job_closes_its_file_with_the_steps_it_ran(make_cluster) -> None:
    # Arrange: a job far from its first epoch's end
    cluster = await make_cluster(workers=1)
    async with cluster.client() as client:
        job = await client.submit({"kind": "train", "workers": 1, "batch_size": 8, "steps": 10**5})
        async for _info, progress in client.watch(job.job_id):
            if progress.get("step", 0) >= 3:
                break

        # Act
        await client.cancel(job.job_id)
        final = await client.wait(job.job_id)

    # Assert: the buffered steps written (no epoch ended to flush them), the board's thread gone
    assert final.state == "CANCELLED"
    scalars = _scalars(Path(cluster.coordinator.cfg.tensorboard_dir()) / job.job_id)
    steps = [s for s, _ in scalars["train/loss"]]
    assert steps[:3] == [1, 2, 3] and steps == list(range(1, len(steps) + 1))
    assert not any(t.name.startswith(f"tensorboard-{job.job_id}") for t in threading.enumerate())


async def test_the_tensorboard_command_serves_the_jobs_runs(make_cluster, tmp_path: Path) -> None:
    # Arrange: a finished job's run directory
    cluster = await make_cluster(workers=1)
    async with cluster.client() as client:
        final = await client.wait(
            (await client.submit({"kind": "train", "workers": 1, "steps": 2})).job_id
        )
    assert final.state == "SUCCEEDED", final.error
    data_dir = cluster.coordinator.cfg.data_dir

    # Act: TensorBoard's server on port 0 of loopback, in its own process (the cluster's
    # event loop goes on meanwhile)
    url, runs, code = await asyncio.to_thread(_serve_and_list, data_dir, final.job_id)

    # Assert: the job's run listed, and the process ended by SIGTERM with status 0
    assert url.startswith("http://127.0.0.1:")
    assert final.job_id in runs
    assert code == 0


def _serve_and_list(data_dir: str, job_id: str) -> tuple[str, list[str], int]:
    """Run ``neuroshard tensorboard --port 0``, read its runs, stop it: (URL, runs, exit)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "tensorboard", "--data-dir", data_dir, "--port", "0"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = _served_url(proc)
        runs = _poll_runs(url, job_id)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        assert proc.stderr is not None
        proc.stderr.close()
    return url, runs, code


def _served_url(proc: subprocess.Popen[str]) -> str:
    """The URL TensorBoard prints on stderr once it listens (it exits first on an error)."""
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:  # blocks on a line; TensorBoard prints within seconds
        lines.append(line)
        found = re.search(r"TensorBoard \S+ at (http://\S+/)", line)
        if found:
            return found.group(1)
    raise AssertionError(f"tensorboard exited {proc.wait()}: {''.join(lines)}")


def _poll_runs(url: str, job_id: str, timeout_s: float = 60.0) -> list[str]:
    """``/data/runs`` until it lists ``job_id`` (TensorBoard loads files in a thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{url}data/runs", timeout=10) as reply:
            runs: list[str] = json.loads(reply.read())
        if job_id in runs or time.monotonic() > deadline:
            return runs
        time.sleep(0.2)  # a poll interval, with a deadline
