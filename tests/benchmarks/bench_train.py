"""``make bench-train``: single process vs torch DDP (gloo) vs neuroshard allreduce and sync.

Three parts (``--parts``):

- throughput: every runner trains the same model on the same GLOBAL batch per step (split
  across processes where there are several), indexing each step's rows of a per-epoch
  permutation; the runners take turns, one timed run of ``--steps`` steps each per round, for
  ``--repeats`` rounds; medians of the rates and of the per-round ratios;
- time: wall seconds from submit to test accuracy 0.95 on digits (allreduce, sync);
- elastic: kill -9 of one of 3 allreduce workers to the next step, next to the start of a
  fresh 2-process DDP group (what torchrun does on every membership change);
- gpt: the README's character-level GPT example (``tests.benchmarks.bench_gpt``): tokens/s of
  allreduce on 2 workers vs DDP on the same batches, time to the stated validation loss, and
  one process on the same batches (``--gpt-data chars.npz``, ``make example-data`` writes it).

Not collected by pytest; run with ``python -m tests.benchmarks.bench_train``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from shared.config import TrainJobSpec
from shared.training.data import Dataset, load_dataset
from shared.training.models import build_model


class _Batches:
    """A plain training loop's data: each step the next rows of a per-epoch permutation.

    Every runner indexes its step's rows out of the training split, as neuroshard's
    processes do (and as a DataLoader over a shuffled data set would), rather than
    re-using one fixed batch; ``rank``/``world`` take a contiguous part of each step's rows.
    """

    def __init__(self, x: Any, y: Any, global_batch: int, seed: int) -> None:
        self.x, self.y, self.g, self.seed = x, y, global_batch, seed
        self.epoch, self.pos = 0, len(y)
        self.perm = np.empty(0, np.int64)

    def next(self, rank: int = 0, world: int = 1) -> tuple[Any, Any]:
        if self.pos + self.g > len(self.y):
            self.perm = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.y))
            self.epoch, self.pos = self.epoch + 1, 0
        rows = self.perm[self.pos : self.pos + self.g]
        self.pos += self.g
        mine = torch.from_numpy(np.array_split(rows, world)[rank])
        return self.x[mine], self.y[mine]


def _setup(spec: TrainJobSpec, global_batch: int, threads: int) -> tuple[nn.Module, Any, _Batches]:
    """Model, optimizer and the step batches of ``global_batch`` rows."""
    torch.set_num_threads(threads)
    ds: Dataset = load_dataset(spec.data, spec.seed, spec.test_fraction)
    model = build_model(spec.model, ds.input_shape, ds.num_classes, spec.seed)
    o = spec.optimizer
    opt = (
        torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum)
        if o.name == "sgd"
        else torch.optim.Adam(model.parameters(), lr=o.lr)
    )
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    return model, opt, _Batches(x, y, global_batch, spec.seed)


def _train_steps(
    model: nn.Module, opt: Any, data: _Batches, steps: int, rank: int = 0, world: int = 1
) -> None:
    for _ in range(steps):
        x, y = data.next(rank, world)
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
    model, opt, data = _setup(spec, global_batch, threads)
    _train_steps(model, opt, data, 1)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _train_steps(model, opt, data, steps)
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
        model, opt, data = _setup(spec, global_batch, threads)
        ddp = nn.parallel.DistributedDataParallel(model)
        _train_steps(ddp, opt, data, 1, rank, world)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            _train_steps(ddp, opt, data, steps, rank, world)
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
    all-reduces (averages) the gradients. Process start-up is not timed. A rank that dies
    (gloo aborted once in 16 quiet rounds on 2026-11-27: "terminate called without an active
    exception", SIGABRT) is reported and the run started again once, so one crash of the
    baseline does not end a benchmark of many rounds.

    Raises:
        ProcessExitedException: a rank died on the second attempt too.
    """
    ctx = mp.get_context("spawn")
    args = (spec, global_batch, steps, repeats, threads)
    for attempt in (1, 2):
        out = ctx.SimpleQueue()
        try:
            mp.start_processes(
                _ddp_rank,
                args=(world_size, _free_port(), args, out),
                nprocs=world_size,
                start_method="spawn",
            )
        except mp.ProcessExitedException as exc:
            if attempt == 2:
                raise
            print(f"  DDP gloo baseline died ({exc}); running it again", flush=True)
            continue
        times: list[float] = out.get()
        return statistics.median(global_batch * steps / t for t in times)
    raise AssertionError("unreachable")


def neuroshard_rate(
    client: Any, strategy: str, workers: int, spec: TrainJobSpec, b: int, s: int
) -> float:
    """samples/s of one neuroshard job of ``s`` steps at global batch ``b`` on ``client``'s
    cluster: the job's own figure, which covers its training steps (sync: its step loop after
    the workers loaded the data; allreduce: rank 0's steps, after the DDP processes started),
    as the other runners time steps after a warm-up."""
    final = client.wait(client.submit(_job(spec, strategy, workers, b, steps=s)).job_id)
    if final.state != "SUCCEEDED":
        raise RuntimeError(f"benchmark job {final.state}: {final.error}")
    return float(final.result["samples_per_s"])


def _job(spec: TrainJobSpec, strategy: str, workers: int, global_batch: int, **kw: Any) -> dict:
    doc = spec.model_dump(by_alias=True)
    doc.update(strategy=strategy, workers=workers, batch_size=global_batch // workers)
    doc.update(epochs=None, steps=None, min_workers=None)
    doc.update(kw)
    return doc


@contextlib.contextmanager
def _cluster(workers: int, args: list[str] | None = None) -> Iterator[tuple[Any, Any]]:
    from shared.cli.local_cluster import LocalCluster
    from shared.client import SyncClient

    with (
        tempfile.TemporaryDirectory(prefix="neuroshard-bench-") as logs,
        LocalCluster(workers, log_dir=logs, coordinator_args=args) as cluster,
        SyncClient(cluster.address) as client,
    ):
        yield cluster, client


def time_to_accuracy(strategy: str, workers: int, spec: TrainJobSpec, target: float) -> float:
    """Wall seconds from submit until a progress event reports test accuracy >= ``target``.

    The digits job of ``configs/jobs/digits-mlp.yaml`` (global batch 96) on a fresh local
    cluster; includes the job's start (data, model, the DDP processes for allreduce).
    """
    doc = _job(spec, strategy, workers, 96, epochs=30)
    with _cluster(workers) as (_c, client):
        t0 = time.perf_counter()
        job = client.submit(doc)
        for _info, progress in client.watch(job.job_id):
            if float(progress.get("test_accuracy") or 0.0) >= target:
                seconds = time.perf_counter() - t0
                client.cancel(job.job_id)
                return seconds
    raise RuntimeError(f"{strategy} never reached test accuracy {target}")


def rerendezvous_seconds(spec: TrainJobSpec, repeats: int) -> float:
    """Median seconds from kill -9 of one of 3 allreduce workers to the next step's progress.

    The coordinator notices (heartbeat timeout 1 s, or the survivors' failed collective),
    opens a new generation of the 2 survivors, rank 0 broadcasts its state, and training
    goes on; the figure is the wall time until a progress event of the new generation.
    """
    fast = Path(tempfile.mkdtemp(prefix="neuroshard-bench-")) / "coordinator.yaml"
    fast.write_text("heartbeat_interval_s: 0.2\nheartbeat_timeout_s: 1.0\n")
    times = []
    for _ in range(repeats):
        doc = _job(spec, "allreduce", 3, 96, steps=100_000, min_workers=2)
        with _cluster(3, ["--config", str(fast)]) as (cluster, client):
            job = client.submit(doc)
            watch = client.watch(job.job_id)
            for _info, progress in watch:
                if progress.get("step", 0) >= 50:
                    break
            t0 = time.perf_counter()
            cluster.kill_worker(2)
            for _info, progress in watch:
                if progress.get("generation", 0) >= 1 and progress.get("step", 0) > 50:
                    times.append(time.perf_counter() - t0)
                    break
            client.cancel(job.job_id)
    return statistics.median(times)


def torch_restart_all_seconds(spec: TrainJobSpec, repeats: int) -> float:
    """Median seconds for a fresh 2-process DDP group (gloo) to start and finish one step.

    What torchrun's elastic agent does on every membership change (it stops every worker
    and starts a new group), without its rendezvous waits (``last_call_timeout``) and
    without loading a checkpoint: a lower bound of its restart.
    """
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run_ddp_gloo(spec, 96, 1, 1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# The validation loss the README states for configs/jobs/char-gpt.yaml (nats per character).
GPT_TARGET_LOSS = 1.80

MODELS: dict[str, dict[str, Any]] = {
    "mlp": {"model": "mlp"},
    "cnn": {"model": "cnn"},
    # Where communication matters: 784-1024-1024-10 (1.86M parameters) on 28x28 inputs.
    "wide": {
        "model": {"name": "mlp", "hidden": [1024, 1024]},
        "data": {"name": "synthetic", "samples": 4000, "features": 784},
    },
}


def main(argv: list[str] | None = None) -> None:
    """Print samples/s of each runner, its ratio to one process and to DDP; then times."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="mlp")
    p.add_argument("--global-batch", type=int, default=96)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--parts", default="throughput,time,elastic,gpt")
    p.add_argument("--gpt-data", help="gpt: the example's chars.npz (python -m examples.prepare)")
    p.add_argument("--gpt-steps", type=int, default=100, help="gpt: steps per throughput run")
    p.add_argument("--gpt-rounds", type=int, default=3, help="gpt: throughput rounds")
    p.add_argument(
        "--gpt-target", type=float, default=GPT_TARGET_LOSS, help="gpt: validation loss, nats"
    )
    a = p.parse_args(argv)
    if "gpt" in a.parts.split(",") and not a.gpt_data:
        p.error("the gpt part needs --gpt-data chars.npz (make example-data writes it)")
    spec = TrainJobSpec.model_validate({"kind": "train", **MODELS[a.model]})
    b, s, r = a.global_batch, a.steps, a.repeats
    parts = set(a.parts.split(","))
    if "throughput" in parts:
        _throughput(spec, a.model, b, s, r)
    if "time" in parts and a.model == "mlp":
        print("\ntime to test accuracy 0.95, digits mlp, global batch 96 (wall seconds)")
        for strategy in ("allreduce", "sync"):
            t = time_to_accuracy(strategy, 2, spec, 0.95)
            print(f"neuroshard {strategy}, 2 workers: {t:.1f} s", flush=True)
    if "elastic" in parts:
        print("\nafter kill -9 of 1 of 3 workers (median of 3)")
        print(f"neuroshard allreduce, next step: {rerendezvous_seconds(spec, 3):.2f} s")
        restart = torch_restart_all_seconds(spec, 3)
        print(f"fresh DDP group of 2 (torchrun restarts all): {restart:.2f} s")
    if "gpt" in parts:
        from tests.benchmarks.bench_gpt import main_gpt

        print()
        main_gpt(Path(a.gpt_data), a.gpt_steps, a.gpt_rounds, a.gpt_target)


def _throughput(spec: TrainJobSpec, model: str, b: int, s: int, r: int) -> None:
    """Every runner once per round, ``r`` rounds; medians, and medians of per-round ratios.

    Interleaving the runners round by round makes them share the machine's drifts (on a
    shared 2-core VM their rates move by tens of percent within minutes), and a per-round
    ratio compares runs taken a few seconds apart. The neuroshard jobs run on one local
    cluster of 2 worker processes (a 1-worker job uses one of them), warmed up first.
    """
    with _cluster(2) as (_c, client):
        runners: list[tuple[str, Callable[[], float]]] = [
            ("single-process, 1 thread", lambda: run_single_process(spec, b, s, 1, threads=1)),
            ("torch DDP gloo, 2 procs x 1 thread", lambda: run_ddp_gloo(spec, b, s, 1)),
            *(
                (f"neuroshard {st}, {w} worker{'s' * (w > 1)}", _ns(client, st, w, spec, b, s))
                for st in ("allreduce", "sync")
                for w in (1, 2)
            ),
        ]
        for _, run in runners[2:]:
            run()  # warm-up: imports, data, first connections
        rates: dict[str, list[float]] = {name: [] for name, _ in runners}
        for _ in range(r):
            for name, run in runners:
                rates[name].append(run())
    single, ddp = rates[runners[0][0]], rates[runners[1][0]]
    print(f"{model}, global batch {b}, {s} steps, {r} interleaved rounds, medians")
    print(f"{'runner':<36} {'samples/s':>12} {'vs 1 proc':>10} {'vs DDP':>8}")
    for name, xs in rates.items():
        vs1 = statistics.median(x / y for x, y in zip(xs, single, strict=True))
        vsd = statistics.median(x / y for x, y in zip(xs, ddp, strict=True))
        print(f"{name:<36} {statistics.median(xs):>12,.0f} {vs1:>10.2f} {vsd:>8.2f}", flush=True)


def _ns(
    client: Any, strategy: str, workers: int, spec: TrainJobSpec, b: int, s: int
) -> Callable[[], float]:
    return lambda: neuroshard_rate(client, strategy, workers, spec, b, s)


if __name__ == "__main__":
    main()
