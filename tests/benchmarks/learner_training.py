"""``bench_learner --parts training,gpt``: time to a test metric, prioritized vs uniform sampling.

Two workloads, each run once with ``sampling: prioritized`` (alpha 0.6, beta 0.4 annealed to
1, decay 0; README, "Prioritized training") and once with ``sampling: uniform``, interleaved
seed by seed on one local cluster; a run ends at the first evaluation (each epoch's end) whose
test metric reaches the target. Reported per sampling: how many seeds reached it, and the
medians over seeds of the steps, the epochs and the wall seconds from submit (job start
included).

- ``digits``: the job of ``configs/jobs/digits-mlp.yaml`` (MLP 64-128-64-10, Adam 0.003) with
  ``strategy: sync`` on 2 workers, global batch 96; target: test accuracy.
- ``gpt``: the GPT example (``configs/jobs/char-gpt.yaml``: 216,673 parameters, Adam 0.003,
  ``strategy: allreduce``) on 2 workers, global batch 96, on the first ``GPT_ROWS`` rows of
  the example's ``chars.npz`` (so that an epoch, the evaluation interval, is 90 steps instead
  of 356); target: validation loss. The daemons run with the example configs (the operator
  lists the model).
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import yaml

from shared.cli.local_cluster import LocalCluster
from shared.client import SyncClient

REPO = Path(__file__).resolve().parents[2]
DIGITS_JOB = REPO / "configs" / "jobs" / "digits-mlp.yaml"
GPT_JOB = REPO / "configs" / "jobs" / "char-gpt.yaml"
EXAMPLE_CONFIGS = REPO / "configs" / "examples"
GPT_ROWS = 9_600  # 8,640 training rows (test_fraction 0.1): 90 steps of 96 rows an epoch
SAMPLINGS: dict[str, dict[str, Any]] = {
    "prioritized": {"name": "prioritized", "alpha": 0.6, "beta": 0.4, "beta_final": 1.0},
    "uniform": {"name": "uniform"},
}


@dataclass(frozen=True)
class Workload:
    """What one workload trains, where, and the test metric a run stops at.

    Attributes:
        name: the workload's short name (job names, printed lines).
        title: the report section's heading, after its number.
        setup: one sentence for the report: model, strategy, workers, batch.
        metric: the progress field compared with ``target`` (``test_accuracy``, ``test_loss``).
        target: the metric's value a run stops at.
        lower_is_better: True for a loss (reached when metric <= target).
        job_doc: (sampling, seed, max_epochs) -> the job document submitted.
        cluster: the log dir -> the local cluster (not yet started).
        prepare: called once with the client before the runs (e.g. uploads the data set).
    """

    name: str
    title: str
    setup: str
    metric: str
    target: float
    lower_is_better: bool
    job_doc: Callable[[str, int, int], dict[str, Any]]
    cluster: Callable[[str], LocalCluster]
    prepare: Callable[[SyncClient], None] = lambda _client: None

    def reached(self, value: float) -> bool:
        """Whether a metric value reaches the target (NaN, before any evaluation: no)."""
        if math.isnan(value):
            return False
        return value <= self.target if self.lower_is_better else value >= self.target


@dataclass(frozen=True)
class Reached:
    """One run: where it first reached the target (None: not within the epochs)."""

    sampling: str
    seed: int
    step: int | None
    epoch: int | None
    wall_s: float | None
    best: float
    failed: str = ""  # the job's error when it FAILED before reaching the target


def _job(path: Path, name: str, sampling: str, seed: int, max_epochs: int) -> dict[str, Any]:
    """The job file at ``path`` on 2 workers x 48 rows, with the run's sampling and seed."""
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return doc | {
        "name": name,
        "workers": 2,
        "batch_size": 48,
        "epochs": max_epochs,
        "seed": seed,
        "sampling": SAMPLINGS[sampling],
    }


def digits(target_accuracy: float) -> Workload:
    """The digits MLP with ``strategy: sync`` on 2 workers, to a test accuracy."""

    def job_doc(sampling: str, seed: int, max_epochs: int) -> dict[str, Any]:
        return _job(DIGITS_JOB, f"digits-{sampling}-{seed}", sampling, seed, max_epochs) | {
            "strategy": "sync"
        }

    return Workload(
        name="digits",
        title=f"digits to test accuracy {target_accuracy}",
        setup="sync, 2 workers, global batch 96, MLP 64-128-64-10, Adam 0.003",
        metric="test_accuracy",
        target=target_accuracy,
        lower_is_better=False,
        job_doc=job_doc,
        cluster=lambda logs: LocalCluster(2, log_dir=logs),
    )


def gpt(chars: Path, target_loss: float, rows: int = GPT_ROWS) -> Workload:
    """The GPT example with ``strategy: allreduce`` on 2 workers, to a validation loss.

    Args:
        chars: the example's ``chars.npz`` (``make example-data``): x [R, 65] int64.
        target_loss: the validation loss (nats per character) a run stops at.
        rows: how many of its first rows the runs train and validate on.
    """
    subset = f"chars-{rows}.npz"

    def prepare(client: SyncClient) -> None:
        with np.load(chars, allow_pickle=False) as npz:
            x = npz["x"][:rows]
        with tempfile.TemporaryDirectory(prefix="bench-learner-gpt-") as tmp:
            path = Path(tmp) / subset
            np.savez(path, x=x)
            client.put_dataset(path)

    def job_doc(sampling: str, seed: int, max_epochs: int) -> dict[str, Any]:
        return _job(GPT_JOB, f"gpt-{sampling}-{seed}", sampling, seed, max_epochs) | {
            "data": {"path": subset}
        }

    def cluster(logs: str) -> LocalCluster:
        return LocalCluster(
            2,
            log_dir=logs,
            coordinator_args=["--config", str(EXAMPLE_CONFIGS / "coordinator.yaml")],
            worker_args=["--config", str(EXAMPLE_CONFIGS / "worker.yaml")],
        )

    return Workload(
        name="gpt",
        title=f"the GPT example to validation loss {target_loss}",
        setup=(
            f"allreduce, 2 workers, global batch 96 (6,144 tokens), char-gpt (216,673 "
            f"parameters), Adam 0.003, the first {rows:,} rows of chars.npz (an epoch and the "
            f"evaluation interval: {int(rows * 0.9) // 96} steps)"
        ),
        metric="test_loss",
        target=target_loss,
        lower_is_better=True,
        job_doc=job_doc,
        cluster=cluster,
        prepare=prepare,
    )


def first_reached(work: Workload, history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first evaluation (a history entry: step, epoch, metrics) reaching the target."""
    for h in history:
        if work.reached(float(h.get(work.metric, math.nan))):
            return h
    return None


def one_run(
    client: SyncClient, work: Workload, sampling: str, seed: int, max_epochs: int
) -> Reached:
    """Submit one job and follow it until an evaluation's metric reaches the target.

    The step and epoch are the evaluation's own (its history entry: an allreduce job reports
    an evaluation some steps after the epoch end it evaluated; a sync job's entries have no
    step, it evaluates at the epoch's last step); the wall seconds run from the submit until
    the client saw it.
    """
    t0 = time.perf_counter()
    job = client.submit(work.job_doc(sampling, seed, max_epochs))
    history: list[dict[str, Any]] = []

    def reached(hit: dict[str, Any], step: int) -> Reached:
        # A sync job's entries have no step: it evaluated at ``step``, the epoch's last.
        wall, best = time.perf_counter() - t0, _best(work, history)
        return Reached(sampling, seed, int(hit.get("step", step)), int(hit["epoch"]), wall, best)

    for _info, progress in client.watch(job.job_id):
        history = list(progress.get("history") or history)
        hit = first_reached(work, history)
        if hit is not None:
            run = reached(hit, int(progress["step"]))  # the wall time before the cancel
            client.cancel(job.job_id)
            return run
    final = client.wait(job.job_id)  # the last epoch's evaluation is in the result only
    result = final.result or {}
    history = list(result.get("history") or history)
    hit = first_reached(work, history)
    if hit is not None:  # the last epoch's (an earlier one came with a progress event)
        return reached(hit, int(result.get("steps", 0)))
    failed = final.error if final.state == "FAILED" else ""
    return Reached(sampling, seed, None, None, None, _best(work, history), failed)


def _best(work: Workload, history: list[dict[str, Any]]) -> float:
    values = [float(h.get(work.metric, math.nan)) for h in history]
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan
    return min(values) if work.lower_is_better else max(values)


def run(work: Workload, seeds: int, max_epochs: int, first_seed: int = 0) -> list[Reached]:
    """Seeds ``first_seed`` .. ``first_seed + seeds - 1``, prioritized and uniform run of each,
    interleaved, on one local cluster."""
    out: list[Reached] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-learner-train-") as logs,
        work.cluster(logs) as cluster,
        SyncClient(cluster.address, timeout_s=60) as client,
    ):
        client.wait_ready(120)
        work.prepare(client)
        for seed in range(first_seed, first_seed + seeds):
            for sampling in SAMPLINGS:
                r = one_run(client, work, sampling, seed, max_epochs)
                print(f"{work.name} {sampling} seed {seed}: {r}", flush=True)
                out.append(r)
    return out


def section(number: int, work: Workload, runs: list[Reached], seeds: int, max_epochs: int) -> str:
    """The Markdown table of the runs (medians over the seeds that reached the target)."""
    lines = [
        f"### {number}. Training: {work.title}, prioritized vs uniform",
        "",
        f"{work.setup}, at most {max_epochs} epochs; {seeds} seeds each, interleaved on one "
        "local cluster.",
        "",
        "| sampling | seeds reached | steps (median) | epochs (median) | wall s (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    for sampling in SAMPLINGS:
        mine = [r for r in runs if r.sampling == sampling]
        ok = [r for r in mine if r.step is not None]

        def med(values: list[float]) -> str:
            return f"{median(values):,.1f}" if values else "-"

        lines.append(
            f"| {sampling} | {len(ok)}/{len(mine)} | {med([float(r.step or 0) for r in ok])} | "
            f"{med([float(r.epoch or 0) for r in ok])} | "
            f"{med([r.wall_s or 0.0 for r in ok])} |"
        )
    per_seed = "; ".join(
        f"{r.sampling} seed {r.seed}: "
        + (
            f"epoch {r.epoch} ({r.wall_s:.0f} s)"
            if r.epoch is not None and r.wall_s is not None
            else f"FAILED ({r.failed}; best {r.best:.3f})"
            if r.failed
            else f"not reached (best {r.best:.3f})"
        )
        for r in runs
    )
    lines += ["", f"Per run: {per_seed}."]
    return "\n".join(lines)
