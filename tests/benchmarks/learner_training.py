"""``bench_learner --parts training``: time to a test accuracy, prioritized vs uniform sampling.

The digits job of ``configs/jobs/digits-mlp.yaml`` (MLP 64-128-64-10, Adam 0.003) with
``strategy: sync`` on 2 workers, global batch 96, up to ``max_epochs`` epochs, once with
``sampling: prioritized`` (alpha 0.6, beta 0.4 annealed to 1, decay 0; README, "Prioritized
training") and once with ``sampling: uniform``, interleaved seed by seed on one local cluster.
A run ends at the first epoch whose test accuracy (evaluated at each epoch end) reaches
``target``. Reported per sampling: how many seeds reached it, and the medians over seeds of
the steps, the epochs and the wall seconds from submit (job start included).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import yaml

from shared.cli.local_cluster import LocalCluster
from shared.client import SyncClient

JOB = Path(__file__).resolve().parents[2] / "configs" / "jobs" / "digits-mlp.yaml"
SAMPLINGS: dict[str, dict[str, Any]] = {
    "prioritized": {"name": "prioritized", "alpha": 0.6, "beta": 0.4, "beta_final": 1.0},
    "uniform": {"name": "uniform"},
}


@dataclass(frozen=True)
class Reached:
    """One run: where it first reached the target (None: not within the epochs)."""

    sampling: str
    seed: int
    step: int | None
    epoch: int | None
    wall_s: float | None
    best_accuracy: float


def job_doc(sampling: str, seed: int, workers: int, max_epochs: int) -> dict[str, Any]:
    """The digits job of ``configs/jobs/digits-mlp.yaml`` as this benchmark runs it."""
    doc = yaml.safe_load(JOB.read_text())
    doc.update(
        name=f"digits-{sampling}-{seed}",
        strategy="sync",
        workers=workers,
        batch_size=96 // workers,
        epochs=max_epochs,
        seed=seed,
        sampling=SAMPLINGS[sampling],
    )
    return doc


def one_run(
    client: SyncClient, sampling: str, seed: int, workers: int, max_epochs: int, target: float
) -> Reached:
    """Submit one job and follow it until an epoch's test accuracy reaches ``target``."""
    t0 = time.perf_counter()
    job = client.submit(job_doc(sampling, seed, workers, max_epochs))
    best = 0.0
    for _info, progress in client.watch(job.job_id):
        acc = float(progress.get("test_accuracy") or 0.0)
        best = max(best, acc if acc == acc else 0.0)  # NaN before the first evaluation
        if acc >= target:
            wall = time.perf_counter() - t0
            client.cancel(job.job_id)
            return Reached(
                sampling, seed, int(progress["step"]), int(progress["epoch"]), wall, best
            )
    return Reached(sampling, seed, None, None, None, best)


def run(seeds: int, workers: int, max_epochs: int, target: float) -> list[Reached]:
    """Every seed's prioritized and uniform run, interleaved, on one local cluster."""
    out: list[Reached] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-learner-train-") as logs,
        LocalCluster(workers, log_dir=logs) as cluster,
        SyncClient(cluster.address, timeout_s=60) as client,
    ):
        client.wait_ready(120)
        for seed in range(seeds):
            for sampling in SAMPLINGS:
                r = one_run(client, sampling, seed, workers, max_epochs, target)
                print(f"training {sampling} seed {seed}: {r}", flush=True)
                out.append(r)
    return out


def section(runs: list[Reached], seeds: int, workers: int, max_epochs: int, target: float) -> str:
    """The Markdown table of the runs (medians over the seeds that reached the target)."""
    lines = [
        f"### 4. Training: digits to test accuracy {target}, prioritized vs uniform",
        "",
        f"sync, {workers} workers, global batch 96, MLP 64-128-64-10, Adam 0.003, at most "
        f"{max_epochs} epochs; {seeds} seeds each, interleaved on one local cluster.",
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
            f"epoch {r.epoch}"
            if r.epoch is not None
            else f"not reached (best {r.best_accuracy:.3f})"
        )
        for r in runs
    )
    lines += ["", f"Per run: {per_seed}."]
    return "\n".join(lines)
