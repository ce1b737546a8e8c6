"""Interleaved A/B of ``strategy: sync`` between source trees, with torch DDP in the same rounds.

Each tree (``--trees NAME=PATH,...``, e.g. a worktree at the commit before a change and one
at the change) gets its own local cluster of 2 workers whose daemons import that tree's code
(``PYTHONPATH``; the clusters start from an empty working directory, since ``python -m``
puts the working directory first on ``sys.path``). After one warm-up job per cluster, each
round runs DDP gloo on 2 processes (``bench_train.run_ddp_gloo``), then one sync job of
``--steps`` steps per tree, in an order rotated every round. Printed: each round's rates, the
medians, the medians of the per-round ratios to DDP, and each tree's CPU milliseconds per
step per daemon (``/proc/PID/stat`` around each job, its start-up included, divided by its
steps). docs/bench-train.md keeps the results.

``--hold SECONDS`` instead runs back-to-back 200-step jobs on the first tree's cluster for
that long, printing the daemons' pids first, for a sampling profiler (py-spy) to attach.

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
    """CPU milliseconds (user + system) used so far by the coordinator and each worker."""
    out = []
    for proc in [cluster.coordinator, *cluster.workers]:
        assert proc is not None
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out.append((int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK"))
    return out


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
    p.add_argument("--hold", type=float, default=0.0, help="profile mode, seconds")
    a = p.parse_args(argv)
    trees = [(n, path) for n, _, path in (t.partition("=") for t in a.trees.split(","))]
    spec = TrainJobSpec.model_validate({"kind": "train", **MODELS[a.model]})
    b, s = a.global_batch, a.steps
    print(f"load average at the start: {os.getloadavg()}", flush=True)
    with contextlib.ExitStack() as stack:
        clusters = _clusters(stack, trees)
        for _cluster, client in clusters.values():
            neuroshard_rate(client, "sync", 2, spec, b, s)  # warm-up
        if a.hold:
            client = clusters[trees[0][0]][1]
            t0 = time.monotonic()
            while time.monotonic() - t0 < a.hold:
                print(f"{neuroshard_rate(client, 'sync', 2, spec, b, 200):.0f}", flush=True)
            return
        rates: dict[str, list[float]] = {"ddp": []} | {n: [] for n, _ in trees}
        cpu: dict[str, list[list[float]]] = {n: [] for n, _ in trees}
        names = [n for n, _ in trees]
        for r in range(a.rounds):
            rates["ddp"].append(run_ddp_gloo(spec, b, s, 1))
            for name in names[r % len(names) :] + names[: r % len(names)]:
                cluster, client = clusters[name]
                before = cpu_ms(cluster)
                rates[name].append(neuroshard_rate(client, "sync", 2, spec, b, s))
                cpu[name].append(
                    [(y - x) / s for x, y in zip(before, cpu_ms(cluster), strict=True)]
                )
            print(f"round {r}: " + "  ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items()))
    _report(rates, cpu)
    print(f"load average at the end: {os.getloadavg()}")


def _report(rates: dict[str, list[float]], cpu: dict[str, list[list[float]]]) -> None:
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
        cols = [statistics.median(c) for c in zip(*per_job, strict=True)]
        total = statistics.median(sum(j) for j in per_job)
        daemons = ", ".join(f"{c:.1f}" for c in cols)
        print(f"{name}: CPU ms per step, coordinator and workers: {daemons}; all: {total:.1f}")


if __name__ == "__main__":
    main()
