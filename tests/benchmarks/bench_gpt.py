"""``make bench-train``'s GPT part: the README's character-level GPT example, measured.

- throughput: tokens/s of neuroshard ``allreduce`` on 2 workers vs torch DDP (gloo, 2
  processes of ``torch.multiprocessing``) training the same model on the same batches: each
  step's rows are ``shared.training.partition``'s (a seeded permutation per epoch, G = 2 x 32
  rows a step, split contiguously over the ranks), interleaved rounds, medians;
- time to the stated validation loss: ``configs/jobs/char-gpt.yaml`` (3 workers) on a fresh
  local cluster of the example configs, wall seconds from submit until an epoch's evaluation
  reports ``test_loss`` <= the target; the job then runs to its end;
- one process: the same model trained in this process on the same global batches for the
  same steps, its validation loss next to the job's at every epoch's end and after a short
  job of ``short_steps``; and, as the control, one process whose step gradient is summed
  over the 3 ranks' parts of the rows (float32 sums in another order, nothing else changed),
  which shows how far rounding alone moves Adam's trajectory over many steps.

Not collected by pytest; run with ``python -m tests.benchmarks.bench_train --parts gpt``.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torch import nn

from shared.config import CoordinatorConfig, FileData, TrainJobSpec, load_config
from shared.training.data import Dataset, load_dataset
from shared.training.models import build_model
from shared.training.partition import allreduce_steps_per_epoch, global_rows, rank_rows

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "configs/jobs/char-gpt.yaml"
COORDINATOR_CONFIG = REPO / "configs/examples/coordinator.yaml"
WORKER_CONFIG = REPO / "configs/examples/worker.yaml"


def example_spec(data: Path, **changes: Any) -> TrainJobSpec:
    """``configs/jobs/char-gpt.yaml`` with its data at ``data`` and ``changes`` applied."""
    doc = yaml.safe_load(JOB.read_text()) | {"data": {"path": str(data)}} | changes
    return TrainJobSpec.model_validate(doc)


def _dataset(spec: TrainJobSpec) -> Dataset:
    assert isinstance(spec.data, FileData)
    return load_dataset(spec.data, spec.seed, spec.test_fraction, spec.task, spec.vocab_size)


def _model(spec: TrainJobSpec, ds: Dataset) -> nn.Module:
    allowed = load_config(CoordinatorConfig, COORDINATOR_CONFIG).allowed_models
    return build_model(spec.model, ds.input_shape, ds.num_classes, spec.seed, allowed)


def _next_token_ce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: tokens x, y [B, T] -> logits [B, T, V]."""
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _optimizer(spec: TrainJobSpec, model: nn.Module) -> torch.optim.Optimizer:
    """The spec's torch.optim optimizer (no schedule: the example's lr is constant)."""
    o = spec.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay
        )
    cls = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
    return cls(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)


def _train(
    spec: TrainJobSpec,
    ds: Dataset,
    model: nn.Module,
    steps: int,
    rank: int = 0,
    world: int = 1,
    opt: torch.optim.Optimizer | None = None,
    first: int = 0,
    parts: int = 1,
) -> list[float]:
    """Steps ``first`` .. ``first + steps - 1`` on each allreduce step's rows (this rank's part
    of them); the seconds of each step.

    With ``world`` > 1, ``model`` is a DDP module: its all-reduce averages the ranks' gradients,
    each of its rank's mean loss (equal parts, as G is a multiple of ``world`` here). With
    ``parts`` > 1 (one process), the step's gradient is summed over ``parts`` backward passes,
    one per part of the rows as the ranks would split them, each of its part's loss sum over
    the step's rows: the same gradient as one pass, its float32 sums in another order.
    """
    opt = opt or _optimizer(spec, model)
    x_all, y_all = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    g = spec.workers * spec.batch_size
    per_epoch = allreduce_steps_per_epoch(len(y_all), g)
    seconds = []
    for step in range(first, first + steps):
        t0 = time.perf_counter()
        epoch, s = divmod(step, per_epoch)
        rows = rank_rows(global_rows(len(y_all), g, spec.seed, epoch, s), rank, world)
        opt.zero_grad(set_to_none=True)
        for r in range(parts):
            idx = torch.from_numpy(rank_rows(rows, r, parts))
            share = len(idx) / len(rows)
            (_next_token_ce(model, x_all[idx], y_all[idx]) * share).backward()
        opt.step()
        seconds.append(time.perf_counter() - t0)
    return seconds


@torch.no_grad()
def validation_loss(model: nn.Module, ds: Dataset, batch: int = 512) -> float:
    """Mean next-token cross-entropy over the test split (nats), in eval mode."""
    model.eval()
    x, y = torch.from_numpy(ds.x_test), torch.from_numpy(ds.y_test)
    total = sum(
        float(_next_token_ce(model, x[i : i + batch], y[i : i + batch])) * len(y[i : i + batch])
        for i in range(0, len(y), batch)
    )
    model.train()
    return total / len(y)


def one_process_losses(
    spec: TrainJobSpec, at_steps: list[int], parts: int = 1
) -> tuple[dict[int, float], float]:
    """Validation losses after each of ``at_steps`` steps of the job's global batches in this
    process, and the wall seconds of the training (1 torch thread); ``parts`` as ``_train``."""
    torch.set_num_threads(1)
    ds = _dataset(spec)
    model = _model(spec, ds)
    opt = _optimizer(spec, model)
    losses, done, seconds = {}, 0, 0.0
    for step in sorted(set(at_steps)):
        seconds += sum(_train(spec, ds, model, step - done, opt=opt, first=done, parts=parts))
        losses[step], done = validation_loss(model, ds), step
    return losses, seconds


def _ddp_rank(rank: int, world: int, port: int, spec: TrainJobSpec, steps: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ds = _dataset(spec)
        ddp = nn.parallel.DistributedDataParallel(_model(spec, ds))
        _train(spec, ds, ddp, 2, rank, world)  # warm-up
        dist.barrier()
        t0 = time.perf_counter()
        _train(spec, ds, ddp, steps, rank, world)
        dist.barrier()
        if rank == 0:
            out.put(time.perf_counter() - t0)
    finally:
        dist.destroy_process_group()


def ddp_tokens_per_s(spec: TrainJobSpec, steps: int) -> float:
    """tokens/s of torch DDP (gloo, loopback) on ``spec.workers`` processes, start-up untimed."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    world = spec.workers
    mp.start_processes(
        _ddp_rank, args=(world, port, spec, steps, out), nprocs=world, start_method="spawn"
    )
    seconds: float = out.get()
    return steps * world * spec.batch_size * _tokens_per_row(spec) / seconds


def _tokens_per_row(spec: TrainJobSpec) -> int:
    return int(spec.model.args["block"])  # type: ignore[union-attr]


def _job_doc(spec: TrainJobSpec, **kw: Any) -> dict[str, Any]:
    doc = spec.model_dump(by_alias=True, exclude_none=True)
    doc.update(data={"path": Path(spec.data.path).name}, **kw)  # type: ignore[union-attr]
    return doc


def _cluster(workers: int, logs: str) -> Any:
    from shared.cli.local_cluster import LocalCluster

    return LocalCluster(
        workers,
        log_dir=logs,
        coordinator_args=["--config", str(COORDINATOR_CONFIG)],
        worker_args=["--config", str(WORKER_CONFIG)],
    )


def throughput(data: Path, steps: int, rounds: int) -> None:
    """Print tokens/s of neuroshard allreduce and of DDP on 2 workers, and their ratio."""
    from shared.client import SyncClient

    spec = example_spec(data, workers=2)
    doc = _job_doc(spec, steps=steps, epochs=None)
    ours, theirs = [], []
    with (
        tempfile.TemporaryDirectory(prefix="neuroshard-bench-") as logs,
        _cluster(2, logs) as cluster,
        SyncClient(cluster.address) as client,
    ):
        client.put_dataset(data)

        def run_ours() -> float:
            final = client.wait(client.submit(doc).job_id)
            if final.state != "SUCCEEDED":
                raise RuntimeError(f"benchmark job {final.state}: {final.error}")
            return float(final.result["samples_per_s"]) * _tokens_per_row(spec)

        run_ours()  # warm-up: imports, data, first connections
        for _ in range(rounds):
            theirs.append(ddp_tokens_per_s(spec, steps))
            ours.append(run_ours())
    ratio = statistics.median(a / b for a, b in zip(ours, theirs, strict=True))
    print(f"char-gpt, 2 workers x 32 rows x 64 tokens, {steps} steps, {rounds} rounds, medians")
    print(f"torch DDP gloo, 2 procs x 1 thread   {statistics.median(theirs):>10,.0f} tokens/s")
    print(f"neuroshard allreduce, 2 workers       {statistics.median(ours):>10,.0f} tokens/s")
    print(f"ratio (per round, median)             {ratio:>10.2f}x", flush=True)


def example_runs(
    data: Path, target: float, short_steps: int
) -> tuple[float | None, dict[str, Any], dict[str, Any]]:
    """The example job on 3 fresh workers, then the same job cut to ``short_steps`` steps.

    Returns:
        Seconds from submit to the first evaluation with ``test_loss`` <= ``target`` (None if
        never), the example job's result, and the short job's result.
    """
    from shared.client import SyncClient

    spec = example_spec(data)
    reached: float | None = None
    with (
        tempfile.TemporaryDirectory(prefix="neuroshard-bench-") as logs,
        _cluster(spec.workers, logs) as cluster,
        SyncClient(cluster.address) as client,
    ):
        client.put_dataset(data)
        t0 = time.perf_counter()
        job = client.submit(_job_doc(spec))
        for _info, progress in client.watch(job.job_id):
            loss = progress.get("test_loss")
            if reached is None and loss is not None and not math.isnan(loss) and loss <= target:
                reached = time.perf_counter() - t0
        final = client.wait(job.job_id)
        ended = time.perf_counter() - t0
        short = client.wait(client.submit(_job_doc(spec, steps=short_steps, epochs=None)).job_id)
    for done in (final, short):
        if done.state != "SUCCEEDED":
            raise RuntimeError(f"example job {done.state}: {done.error}")
    # The last epoch's evaluation is in the result only (no progress event follows it).
    if reached is None and any(h["test_loss"] <= target for h in final.result["history"]):
        reached = ended
    return reached, final.result, short.result


def main_gpt(data: Path, steps: int, rounds: int, target: float, short_steps: int = 40) -> None:
    """The GPT part of ``make bench-train``: throughput (skipped for ``rounds`` 0), time to
    ``target``, and one process on the same batches (also with the gradient summed in 3
    parts, the control that shows what float32 rounding alone does)."""
    if rounds:
        throughput(data, steps, rounds)
    reached, result, short = example_runs(data, target, short_steps)
    spec = example_spec(data)
    print(f"\nchar-gpt example ({JOB.relative_to(REPO)}), 3 workers, {result['steps']} steps")
    when = f"{reached:.0f} s" if reached is not None else "not reached"
    print(f"time to validation loss <= {target}: {when} (wall, from submit)")
    ns = {int(h["step"]): h for h in result["history"]}
    ns[short_steps] = {"test_loss": short["test_loss"], "tokens_per_s": 0.0}
    at = sorted(ns)
    ours, seconds = one_process_losses(spec, at)
    split, _ = one_process_losses(spec, at, parts=spec.workers)
    print(
        "  step  allreduce x3  one process  |difference|  one process, grad in 3 parts  "
        "|difference to one process|"
    )
    for step in at:
        theirs, alone, parts = ns[step]["test_loss"], ours[step], split[step]
        print(
            f"{step:>6} {theirs:>13.6f} {alone:>12.6f} {abs(theirs - alone):>13.1e} "
            f"{parts:>29.6f} {abs(parts - alone):>27.1e}"
        )
        if not np.isfinite(theirs - alone):
            raise RuntimeError("validation losses are not finite")
    print(f"(one process trained for {seconds:.0f} s, 1 thread)", flush=True)
