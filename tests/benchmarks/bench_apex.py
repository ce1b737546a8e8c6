"""``make bench-apex``: Ape-X on CartPole-v1 through a neuroshard table, prioritized vs uniform.

For each seed, interleaved: a prioritized run (alpha 0.6) and a uniform run (alpha 0), each on
a fresh table of one local cluster (3 workers, RF 2, fsync always); then runs with a worker
killed (SIGKILL) when the actors pass ``--kill-at`` environment steps, each on a cluster of its
own (the learner and actors go on through the failover). Reported: the median over seeds of
environment steps and wall seconds to the solve criterion (examples/apex/run.py: greedy mean
return >= 475 over 100 episodes), how many seeds solved within the step budget, and a PNG of
the evaluation curves (docs/apex-cartpole.png).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from statistics import median

from examples.apex.replay import ClusterReplayFactory
from examples.apex.run import RunConfig, RunResult, run
from shared.cli.local_cluster import LocalCluster
from shared.client import SyncClient

VARIANTS = {"prioritized": 0.6, "uniform": 0.0}


def _one(cluster: LocalCluster, cfg: RunConfig, table: str, kill_at: int | None) -> RunResult:
    factory = ClusterReplayFactory(cluster.address, table)
    factory.create(cfg.capacity)
    killed = False

    def on_steps(env_steps: int) -> None:
        nonlocal killed
        if kill_at is not None and not killed and env_steps >= kill_at:
            cluster.kill_worker(0)
            killed = True

    try:
        return run(cfg, factory, on_steps)
    finally:
        try:
            factory.drop()
        except Exception as exc:  # the table goes with the cluster anyway
            print(f"drop {table}: {exc}")


def _cluster(tmp: Path, name: str) -> LocalCluster:
    cluster = LocalCluster(3, data_dir=tmp / name / "data", log_dir=tmp / name / "logs")
    cluster.start(120.0)
    with SyncClient(cluster.address, timeout_s=60) as c:
        c.wait_ready(120)
    return cluster


def summarize(runs: dict[str, list[RunResult]], budget: int) -> str:
    """Return the Markdown table of the runs (medians over seeds)."""
    lines = [
        "| sampling | seeds solved | env steps to solve (median) | wall s to solve (median) "
        "| learner steps (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, rs in runs.items():
        solved = [r for r in rs if r.solved_env_steps is not None]
        # an unsolved seed counts as the budget (a lower bound), so the median stays defined
        steps = [r.solved_env_steps if r.solved_env_steps is not None else budget for r in rs]
        wall = [r.solved_wall_s if r.solved_wall_s is not None else r.wall_s for r in rs]
        lines.append(
            f"| {name} | {len(solved)}/{len(rs)} | {median(steps):,.0f} | {median(wall):.0f} "
            f"| {median(r.learner_steps for r in rs):,.0f} |"
        )
    return "\n".join(lines)


def plot(runs: dict[str, list[RunResult]], path: Path) -> None:
    """Plot each run's evaluation curve (greedy return of 10 episodes vs env steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {
        "prioritized": "tab:blue",
        "uniform": "tab:orange",
        "prioritized, worker killed": "tab:red",
    }
    for name, rs in runs.items():
        for k, r in enumerate(rs):
            xs = [c[0] for c in r.curve]
            ys = [c[2] for c in r.curve]
            ax.plot(
                xs, ys, color=colors.get(name, "gray"), alpha=0.7, label=name if k == 0 else None
            )
    ax.axhline(475, color="black", lw=0.8, ls="--", label="solve threshold (100-episode mean)")
    ax.set_xlabel("environment steps (all actors)")
    ax.set_ylabel("greedy return, mean of 10 episodes")
    ax.set_title("Ape-X on CartPole-v1 through a neuroshard table (3 workers, RF 2)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Run the seeds and print the table (and JSON of every run with --json-out)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--kill-seeds", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=20_000)
    p.add_argument("--max-env-steps", type=int, default=150_000)
    p.add_argument("--actors", type=int, default=3)
    p.add_argument("--plot", default="docs/apex-cartpole.png")
    p.add_argument("--json-out")
    a = p.parse_args(argv)
    base = RunConfig(actors=a.actors, max_env_steps=a.max_env_steps)
    runs: dict[str, list[RunResult]] = {
        "prioritized": [],
        "uniform": [],
        "prioritized, worker killed": [],
    }
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-apex-") as tmp_s:
        tmp = Path(tmp_s)
        cluster = _cluster(tmp, "main")
        try:
            for seed in range(a.seeds):
                for name, alpha in VARIANTS.items():
                    r = _one(
                        cluster, replace(base, seed=seed, alpha=alpha), f"apex-{name}-{seed}", None
                    )
                    runs[name].append(r)
                    print(
                        f"{name} seed {seed}: solved at {r.solved_env_steps} env steps, "
                        f"{r.solved_wall_s} s ({r.learner_steps} learner steps)",
                        flush=True,
                    )
        finally:
            cluster.stop()
        for seed in range(a.kill_seeds):
            cluster = _cluster(tmp, f"kill{seed}")
            try:
                r = _one(cluster, replace(base, seed=seed), f"apex-kill-{seed}", a.kill_at)
            finally:
                cluster.stop()
            runs["prioritized, worker killed"].append(r)
            print(f"killed seed {seed}: solved at {r.solved_env_steps} env steps", flush=True)
    print(summarize(runs, a.max_env_steps))
    print(f"(total {time.time() - t0:.0f} s)")
    plot(runs, Path(a.plot))
    if a.json_out:
        Path(a.json_out).write_text(
            json.dumps({k: [asdict(r) for r in v] for k, v in runs.items()})
        )


if __name__ == "__main__":
    main()
