"""The ``train`` job, synchronous parameter server (DESIGN.md, "Training").

Each step the coordinator streams the current parameters to the job's workers, each computes
the gradient of the mean loss over one data shard's mini-batch, and the coordinator averages
them weighted by sample count and steps the optimizer. With equal shards this equals
single-process training on the concatenated global batch. Failed workers' shards are
recomputed by the survivors (``coordinator.train_members``); every
``checkpoint_every_steps`` the parameter server's state is checkpointed so a restarted
coordinator resumes the job where it was.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.aggregation import ParameterServer, weighted_average
from coordinator.jobs import JobFailed, JobRecord, JobStore
from coordinator.membership import WorkerRecord
from coordinator.train_members import Members, ShardResult
from coordinator.train_sets import TrainSets
from shared.config import CoordinatorConfig, TrainJobSpec
from shared.logging import get_logger
from shared.metrics import Metrics
from shared.rpc.peers import WorkerClients
from shared.security.confinement import PathRefused, with_resolved_paths
from shared.training.data import load_dataset, steps_per_epoch, total_steps

log = get_logger("coordinator.train_job")


@dataclass
class _Run:
    """A run's step counts and what its steps accumulate.

    Attributes:
        per_epoch: global steps in one epoch (``steps_per_epoch``).
        total: global steps of the job (``total_steps``).
        t_start: ``clock()`` seconds when this process started (or resumed) the job.
        samples: training samples whose gradients were applied by this process.
        test_loss: mean loss on the test split at the last evaluation (NaN before one).
        test_acc: accuracy on the test split at the last evaluation (NaN before one).
    """

    per_epoch: int
    total: int
    t_start: float
    samples: int = 0
    test_loss: float = float("nan")
    test_acc: float = float("nan")

    @property
    def epochs(self) -> int:
        """Epochs the job spans, the last one possibly partial."""
        return -(-self.total // self.per_epoch)


class TrainJob:
    """Runs one train job to completion; ``run`` returns the result document."""

    def __init__(
        self,
        job: JobRecord,
        workers: list[WorkerRecord],
        cfg: CoordinatorConfig,
        clients: WorkerClients,
        jobs: JobStore,
        metrics: Metrics,
        alive: Callable[[], list[WorkerRecord]] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        train_sets: TrainSets | None = None,
    ) -> None:
        """Prepare the job; nothing runs until ``run``.

        Args:
            job: a record whose spec is a ``TrainJobSpec``.
            workers: the workers the scheduler picked.
            cfg: the coordinator's config (data roots, timeouts in seconds, chunk size,
                checkpoint interval, data dir).
            clients: channels to the workers.
            jobs: where progress is published.
            metrics: step counters and timings.
            alive: the ALIVE workers now (replacements for failed members); None: none.
            clock: seconds for step timings and throughput (injected by tests).
            train_sets: where the job's workers fetch their shards' rows; None: a private one.
        """
        assert isinstance(job.spec, TrainJobSpec)
        self.job, self.spec, self.cfg = job, job.spec, cfg
        self._jobs, self._metrics, self._clock = jobs, metrics, clock
        self._workers = workers
        # Where the job's workers fetch their shards' rows (FetchShard) while it runs.
        self._train_sets = train_sets if train_sets is not None else TrainSets()
        self.members = Members(
            job.job_id,
            job.spec_json,
            job.spec.workers,
            clients,
            alive or (lambda: []),
            cfg.rpc_timeout_s,
            cfg.step_timeout_s,
            cfg.chunk_bytes,
        )
        self.checkpoint_path = Path(cfg.data_dir) / "checkpoints" / f"{job.job_id}.ckpt"

    async def run(self) -> dict[str, Any]:
        """Train to the spec's epochs/steps and return the result.

        Raises:
            JobFailed: the spec or data was refused, or every worker failed (FAILED).
        """
        try:
            return await self._run()
        finally:
            self._train_sets.close(self.job.job_id)

    async def _run(self) -> dict[str, Any]:
        spec = self.spec
        try:  # confined again: a symlink may have changed since admission
            data = with_resolved_paths(spec, self.cfg.dataset_roots()).data
        except PathRefused as exc:
            raise JobFailed(str(exc)) from None
        dataset = await asyncio.to_thread(load_dataset, data, spec.seed, spec.test_fraction)
        ps = await asyncio.to_thread(ParameterServer, spec, dataset, self.cfg.allowed_imports)
        start_step = await asyncio.to_thread(self._restore, ps)
        self._train_sets.open(
            self.job.job_id, dataset, spec.workers, self.members.invited.__contains__
        )
        await self.members.start(self._workers)
        n_train = len(dataset.y_train)
        run = _Run(
            per_epoch=steps_per_epoch(n_train, spec.workers, spec.batch_size),
            total=total_steps(spec, n_train),
            t_start=self._clock(),
        )
        try:
            for step in range(start_step, run.total):
                await self._train_step(ps, step, run)
        finally:
            await self.members.stop()
        model_path = Path(self.cfg.data_dir) / "models" / f"{self.job.job_id}.pt"
        await asyncio.to_thread(_save_model, ps, model_path)
        self.checkpoint_path.unlink(missing_ok=True)
        elapsed = max(self._clock() - run.t_start, 1e-9)
        return {
            "test_accuracy": run.test_acc,
            "test_loss": run.test_loss,
            "steps": run.total,
            "epochs": run.epochs,
            "samples": run.samples,
            "samples_per_s": run.samples / elapsed,
            "seconds": elapsed,
            "model_path": str(model_path.resolve()),
            "resumed_from_step": start_step,
            "worker_failures": self.members.failures,
            "workers": self.members.summary(),
        }

    async def _train_step(self, ps: ParameterServer, step: int, run: _Run) -> None:
        """One global step of the job, with its progress event.

        Gradients from the workers, an optimizer step, evaluation at the end of an epoch, a
        checkpoint every ``checkpoint_every_steps``.
        """
        epoch, step_in_epoch = divmod(step, run.per_epoch)
        t0 = self._clock()
        self.members.admit()
        results = await self.members.step(ps.params(), ps.version, step, epoch, step_in_epoch)
        n, loss_sum, correct = await self._apply(ps, results, step)
        run.samples += n
        self._metrics.train_steps.inc()
        self._metrics.step_seconds.labels("coordinator").observe(self._clock() - t0)
        if step_in_epoch == run.per_epoch - 1 or step == run.total - 1:
            run.test_loss, run.test_acc = await asyncio.to_thread(ps.evaluate)
        if (step + 1) % self.cfg.checkpoint_every_steps == 0 and step + 1 < run.total:
            await asyncio.to_thread(self._checkpoint, ps, step + 1)
        elapsed = max(self._clock() - run.t_start, 1e-9)
        await self._jobs.update(
            self.job,
            progress={
                "step": step + 1,
                "steps": run.total,
                "epoch": epoch + 1,
                "epochs": run.epochs,
                "loss": loss_sum / max(n, 1),
                "train_accuracy": correct / max(n, 1),
                "test_accuracy": run.test_acc,
                "test_loss": run.test_loss,
                "samples_per_s": run.samples / elapsed,
                "workers": len(self.members.live),
            },
        )

    async def _apply(
        self, ps: ParameterServer, results: dict[int, ShardResult], step: int
    ) -> tuple[int, float, int]:
        counts = [r.samples for r in results.values()]
        if sum(counts) == 0:
            raise JobFailed(f"step {step}: no shard had samples")
        grads = weighted_average([r.grads for r in results.values()], counts)
        await asyncio.to_thread(ps.step, grads)
        return (
            sum(counts),
            sum(r.loss_sum for r in results.values()),
            sum(r.correct for r in results.values()),
        )

    def _checkpoint(self, ps: ParameterServer, next_step: int) -> None:
        """Atomically write (next step, parameter-server state) to the checkpoint file."""
        self.checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint_path.with_suffix(".tmp")
        tmp.write_bytes(next_step.to_bytes(8, "little") + ps.state())
        tmp.replace(self.checkpoint_path)

    def _restore(self, ps: ParameterServer) -> int:
        """Load the checkpoint if one exists; return the step to start from."""
        if not self.checkpoint_path.exists():
            return 0
        data = self.checkpoint_path.read_bytes()
        ps.load_state(data[8:])
        step = int.from_bytes(data[:8], "little")
        log.info("train_resumed", job_id=self.job.job_id, step=step)
        return step


def _save_model(ps: ParameterServer, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    ps.save(path)
