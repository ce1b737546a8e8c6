"""Training throughput: single process vs torch DDP (gloo) vs neuroshard sync training.

Every runner trains the same model on the same GLOBAL batch per step (split across processes
where there are several) and reports the median samples/s over ``repeats`` timed runs of
``steps`` optimizer steps, after one untimed warm-up step. Not collected by pytest; run with
``python -m tests.benchmarks.bench_train`` (``make bench-train``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from shared.config import TrainJobSpec
from shared.training.data import Dataset, load_dataset
from shared.training.models import build_model


def _setup(spec: TrainJobSpec, rows: int, threads: int) -> tuple[nn.Module, Any, Any, Any]:
    """Model, optimizer and one fixed batch of ``rows`` training rows (x, y)."""
    torch.set_num_threads(threads)
    ds: Dataset = load_dataset(spec.data, spec.seed, spec.test_fraction)
    model = build_model(spec.model, ds.input_shape, ds.num_classes, spec.seed)
    o = spec.optimizer
    opt = (
        torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum)
        if o.name == "sgd"
        else torch.optim.Adam(model.parameters(), lr=o.lr)
    )
    idx = np.random.default_rng(spec.seed).integers(0, len(ds.y_train), size=rows)
    return model, opt, torch.from_numpy(ds.x_train[idx]), torch.from_numpy(ds.y_train[idx])


def _train_steps(model: nn.Module, opt: Any, x: Any, y: Any, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def run_single_process(
    spec: TrainJobSpec, global_batch: int, steps: int, repeats: int = 5, threads: int = 1
) -> float:
    """Median samples/s of plain torch training on the whole global batch in this process.

    Args:
        spec: model, data and optimizer to use.
        global_batch: samples per step.
        steps: optimizer steps per timed repetition.
        repeats: timed repetitions.
        threads: torch intra-op threads.
    """
    model, opt, x, y = _setup(spec, global_batch, threads)
    _train_steps(model, opt, x, y, 1)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _train_steps(model, opt, x, y, steps)
        rates.append(global_batch * steps / (time.perf_counter() - t0))
    return statistics.median(rates)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ddp_rank(
    rank: int, world: int, port: int, args: tuple[TrainJobSpec, int, int, int, int], out: Any
) -> None:
    spec, global_batch, steps, repeats, threads = args
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, opt, x, y = _setup(spec, global_batch, threads)
        local = slice(rank * global_batch // world, (rank + 1) * global_batch // world)
        ddp = nn.parallel.DistributedDataParallel(model)
        _train_steps(ddp, opt, x[local], y[local], 1)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            _train_steps(ddp, opt, x[local], y[local], steps)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        if rank == 0:
            out.put(times)
    finally:
        dist.destroy_process_group()


def run_ddp_gloo(
    spec: TrainJobSpec,
    global_batch: int,
    steps: int,
    repeats: int = 5,
    world_size: int = 2,
    threads: int = 1,
) -> float:
    """Median samples/s of torch DDP (gloo, localhost) with the global batch split by rank.

    Starts ``world_size`` processes with ``torch.multiprocessing`` (spawn) on a free port;
    each trains on global_batch / world_size rows with ``threads`` torch threads, and DDP
    all-reduces (averages) the gradients. Process start-up is not timed.
    """
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    args = (spec, global_batch, steps, repeats, threads)
    mp.start_processes(
        _ddp_rank,
        args=(world_size, _free_port(), args, out),
        nprocs=world_size,
        start_method="spawn",
    )
    times: list[float] = out.get()
    return statistics.median(global_batch * steps / t for t in times)


# ---------------------------------------------------------------------------------------------
# TODO(neuroshard): fill in once the coordinator and worker daemons run sync training.
def run_neuroshard(
    workers: int, spec: TrainJobSpec, global_batch: int, steps: int, repeats: int = 5
) -> float:
    """Median samples/s of a neuroshard sync job on a local cluster of ``workers`` worker
    processes: ``spec`` with batch_size = global_batch // workers and ``steps`` steps,
    submitted ``repeats`` times; each job's own samples/s covers its step loop only (after
    the workers loaded the data), as the other runners time steps after a warm-up.
    """
    from shared.cli.local_cluster import LocalCluster
    from shared.client import SyncClient

    doc = spec.model_dump(by_alias=True)
    doc.update(workers=workers, batch_size=global_batch // workers, steps=steps, epochs=None)
    import tempfile

    rates = []
    logs = tempfile.TemporaryDirectory(prefix="neuroshard-bench-")
    with (
        logs,
        LocalCluster(workers, log_dir=logs.name) as cluster,
        SyncClient(cluster.address) as client,
    ):
        for _ in range(repeats + 1):  # the first job warms up the workers
            job = client.submit(doc)
            final = client.wait(job.job_id)
            if final.state != "SUCCEEDED":
                raise RuntimeError(f"benchmark job {final.state}: {final.error}")
            rates.append(float(final.result["samples_per_s"]))
    return statistics.median(rates[1:])


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """Print samples/s of each runner and its ratio to single-process (1 thread)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--global-batch", type=int, default=96)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    spec = TrainJobSpec.model_validate({"kind": "train", "model": a.model})
    b, s, r = a.global_batch, a.steps, a.repeats
    rows: list[tuple[str, Callable[[], float]]] = [
        ("single-process, 1 thread", lambda: run_single_process(spec, b, s, r, threads=1)),
        ("single-process, 2 threads", lambda: run_single_process(spec, b, s, r, threads=2)),
        ("torch DDP gloo, 2 procs x 1 thread", lambda: run_ddp_gloo(spec, b, s, r)),
        ("neuroshard sync, 1 worker", lambda: run_neuroshard(1, spec, b, s, r)),
        ("neuroshard sync, 2 workers", lambda: run_neuroshard(2, spec, b, s, r)),
    ]
    print(f"digits {a.model}, global batch {b}, {s} steps x {r} repeats, median")
    print(f"{'runner':<36} {'samples/s':>12} {'ratio':>7}")
    baseline: float | None = None
    for name, run in rows:
        try:
            rate = run()
        except NotImplementedError:
            continue
        baseline = baseline or rate
        print(f"{name:<36} {rate:>12,.0f} {rate / baseline:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
