"""Interleaved A/B of a strategy between source trees, with torch DDP in the same rounds.

``--strategy`` picks what the jobs run (``sync``, the default, or ``allreduce``). Each tree
(``--trees NAME=PATH,...``, e.g. a worktree at the commit before a change and one at the
change) gets its own local cluster of 2 workers whose daemons import that tree's code
(``PYTHONPATH``; the clusters start from an empty working directory, since ``python -m``
puts the working directory first on ``sys.path``). After one warm-up job per cluster, each
round runs DDP gloo on 2 processes (``bench_train.run_ddp_gloo``), then one job of
``--steps`` steps per tree, in an order rotated every round. Printed: each round's rates, the
medians, the medians of the per-round ratios to DDP, and each tree's CPU milliseconds per
step per daemon (``/proc/PID/stat`` around each job, its start-up included, divided by its
steps). With ``allreduce`` also per epoch (``--epoch-steps``, 15 for the digits MLP at global
batch 96), and each worker daemon's reaped children (the job's training processes, their
start-up included) per job. docs/bench-train.md keeps the results.

``--hold SECONDS`` instead runs back-to-back jobs of ``--hold-steps`` steps on the first
tree's cluster for that long, printing the daemons' pids first, for a sampling profiler
(py-spy) to attach.

Linux only (``/proc``). Not collected by pytest; run with
``python -m tests.benchmarks.bench_train_ab --trees base=/path/a,new=/path/b``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from typing import Any

from shared.cli.local_cluster import LocalCluster
from shared.client import SyncClient
from shared.config import TrainJobSpec
from tests.benchmarks.bench_train import MODELS, neuroshard_rate, run_ddp_gloo


def cpu_ms(cluster: LocalCluster) -> list[float]:
    """CPU milliseconds used so far: the coordinator, each worker, each worker's children.

    User + system time of each daemon, then of each worker daemon's reaped children
    (``cutime + cstime``: the training processes of the jobs that ended).
    """
    own, children = [], []
    for proc in [cluster.coordinator, *cluster.workers]:
        assert proc is not None
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = [int(x) for x in f.read().rsplit(")", 1)[1].split()[11:15]]
        tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
        own.append((fields[0] + fields[1]) * tick_ms)
        if proc is not cluster.coordinator:
            children.append((fields[2] + fields[3]) * tick_ms)
    return own + children


def _children_reaped(cluster: LocalCluster, timeout_s: float = 10.0) -> None:
    """Wait (bounded) until no worker daemon has a child left: their CPU is then counted."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = []
        for proc in cluster.workers:
            with contextlib.suppress(OSError):
                for task in os.listdir(f"/proc/{proc.pid}/task"):
                    with open(f"/proc/{proc.pid}/task/{task}/children") as f:
                        left += f.read().split()
        if not left:
            return
        time.sleep(0.05)


def _clusters(
    stack: contextlib.ExitStack, trees: list[tuple[str, str]]
) -> dict[str, tuple[LocalCluster, Any]]:
    """One 2-worker cluster per tree, its daemons importing from the tree."""
    saved = dict(os.environ)
    os.chdir(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-ab-")))
    clusters = {}
    try:
        for name, path in trees:
            os.environ["PYTHONPATH"] = path
            logs = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-ab-logs-"))
            cluster = LocalCluster(2, log_dir=logs)
            stack.callback(cluster.stop)
            cluster.start(timeout_s=300)  # a loaded machine takes minutes to start 3 daemons
            client = stack.enter_context(SyncClient(cluster.address))
            clusters[name] = (cluster, client)
            pids = [p.pid for p in cluster.workers]
            print(f"{name}: coordinator pid {cluster.coordinator.pid}, workers {pids}")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return clusters


def main(argv: list[str] | None = None) -> None:
    """Run the rounds and print rates, ratios and CPU per step."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", required=True, help="NAME=PATH,NAME=PATH,...")
    p.add_argument("--model", choices=sorted(MODELS), default="wide")
    p.add_argument("--global-batch", type=int, default=96)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--strategy", choices=["sync", "allreduce"], default="sync")
    p.add_argument("--epoch-steps", type=int, default=15, help="allreduce: steps per epoch")
    p.add_argument("--hold", type=float, default=0.0, help="profile mode, seconds")
    p.add_argument("--hold-steps", type=int, default=200, help="profile mode: steps per job")
    a = p.parse_args(argv)
    trees = [(n, path) for n, _, path in (t.partition("=") for t in a.trees.split(","))]
    spec = TrainJobSpec.model_validate({"kind": "train", **MODELS[a.model]})
    b, s, strategy = a.global_batch, a.steps, a.strategy
    print(f"load average at the start: {os.getloadavg()}", flush=True)
    with contextlib.ExitStack() as stack:
        clusters = _clusters(stack, trees)
        for _cluster, client in clusters.values():
            neuroshard_rate(client, strategy, 2, spec, b, s)  # warm-up
        if a.hold:
            client = clusters[trees[0][0]][1]
            t0 = time.monotonic()
            while time.monotonic() - t0 < a.hold:
                rate = neuroshard_rate(client, strategy, 2, spec, b, a.hold_steps)
                print(f"{rate:.0f}", flush=True)
            return
        rates: dict[str, list[float]] = {"ddp": []} | {n: [] for n, _ in trees}
        cpu: dict[str, list[list[float]]] = {n: [] for n, _ in trees}
        names = [n for n, _ in trees]
        for r in range(a.rounds):
            rates["ddp"].append(run_ddp_gloo(spec, b, s, 1))
            for name in names[r % len(names) :] + names[: r % len(names)]:
                cluster, client = clusters[name]
                _children_reaped(cluster)
                before = cpu_ms(cluster)
                rates[name].append(neuroshard_rate(client, strategy, 2, spec, b, s))
                _children_reaped(cluster)
                cpu[name].append([y - x for x, y in zip(before, cpu_ms(cluster), strict=True)])
            print(f"round {r}: " + "  ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items()))
            print(f"  load average: {os.getloadavg()[0]:.1f}", flush=True)
    _report(rates, cpu, s, s / a.epoch_steps if strategy == "allreduce" else 0.0)
    print(f"load average at the end: {os.getloadavg()}")


def _report(
    rates: dict[str, list[float]], cpu: dict[str, list[list[float]]], steps: int, epochs: float
) -> None:
    """Rates and ratios; CPU of the daemons per step (and per epoch), of the children per job."""
    ddp = rates["ddp"]
    print(f"{'runner':<10} {'samples/s':>10} {'vs DDP':>8}   per round")
    for name, xs in rates.items():
        vs = statistics.median(x / d for x, d in zip(xs, ddp, strict=True))
        print(f"{name:<10} {statistics.median(xs):>10,.0f} {vs:>8.2f}   {[round(x) for x in xs]}")
    first = next(iter(cpu))
    for name in cpu:
        if name != first:
            ratio = statistics.median(x / y for x, y in zip(rates[name], rates[first], strict=True))
            print(f"{name} / {first}, median of the per-round ratios: {ratio:.2f}")
    for name, per_job in cpu.items():
        daemons = [j[:3] for j in per_job]  # the coordinator, 2 workers; then their children
        cols = [statistics.median(c) / steps for c in zip(*daemons, strict=True)]
        total = statistics.median(sum(j) for j in daemons) / steps
        shown = ", ".join(f"{c:.2f}" for c in cols)
        print(f"{name}: CPU ms per step, coordinator and workers: {shown}; all: {total:.2f}")
        if epochs:
            shown = ", ".join(f"{c * steps / epochs:.1f}" for c in cols)
            print(f"{name}: CPU ms per epoch, coordinator and workers: {shown}")
            kids = ", ".join(f"{statistics.median(c):.0f}" for c in zip(*per_job, strict=True))
            print(f"{name}: CPU ms per job, all columns (children last): {kids}")


if __name__ == "__main__":
    main()
