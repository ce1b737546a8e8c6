"""The ``train`` job, synchronous parameter server (docs/architecture.md, "Invariants").

Each step the coordinator streams the current parameters and buffers to the job's workers,
each computes the gradient of the mean loss over one data shard's rows of the step
(``grad_accum_steps`` micro-batches), and the coordinator averages them weighted by sample
count, clips, and steps the optimizer and the lr schedule; the workers' buffers (BatchNorm
running statistics) are averaged into the model the same way. With equal shards this equals
single-process training on the concatenated global batch. With fp16 the coordinator keeps the
loss scale (``coordinator.training.loss_scale``). Failed workers' shards are recomputed by the
survivors (``coordinator.training.train_members``); every ``checkpoint_every_steps`` the parameter
server's state is checkpointed so a restarted coordinator resumes the job where it was. Every
epoch the model is evaluated, an entry is added to the history
(``coordinator.training.train_history``) and the model is kept as the best one when its test
accuracy improved (``coordinator.training.best_model``: written at checkpoints and at the
job's end).

What a strategy decides is asked of its ``StepScheme``: the step counts, each step's pieces,
the parameter server's optimizer, schedule and clipping, and its fields of the result.
``strategy: sync`` is ``coordinator.training.sync.SyncSteps``; ``strategy: diloco`` (Douillard
et al. 2023) is ``coordinator.training.diloco.DilocoSteps``, where a step is an OUTER step whose
pieces are a shard's rows of ``inner_steps`` consecutive inner steps, the worker answers the
pseudo-gradient of its local steps on them, and the parameter server's step is the outer
Nesterov step on their sample-weighted average. The coordinator picks the scheme in one place
(``coordinator.cluster``). With ``sampling: prioritized`` the planned pieces' rows are drawn
from the job's priority table and the workers' per-sample losses written back to it
(``coordinator.training.prioritized``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from coordinator.jobs.jobs import JobFailed, JobRecord, JobStore
from coordinator.jobs.pacing import next_epoch
from coordinator.network.link_stats import LinkStats
from coordinator.placement.membership import WorkerRecord
from coordinator.training.aggregation import average_buffers
from coordinator.training.best_model import BestModel
from coordinator.training.checkpoints import read_checkpoint, save_model, write_checkpoint
from coordinator.training.epoch_figures import EpochFigures
from coordinator.training.parameter_server import ParameterServer, StepControls
from coordinator.training.prioritized import PrioritizedSampling, PriorityStore
from coordinator.training.robust_aggregation import aggregate, global_norm, norm_outliers
from coordinator.training.saved_models import initial_state
from coordinator.training.step_monitor import StepMonitor
from coordinator.training.step_types import StepPlanner
from coordinator.training.tensorboard_log import TrainBoard, worker_times
from coordinator.training.train_history import TrainHistory, history_task, train_accuracy
from coordinator.training.train_members import Members, StepOrder, StepOutcome, StepPolicy
from coordinator.training.train_sets import TrainSets, open_job_source
from shared.config import ConfigError, CoordinatorConfig, TrainJobSpec
from shared.logging import get_logger
from shared.metrics import Metrics
from shared.rpc.peers import WorkerClients
from shared.training.compression import sync_compressor

log = get_logger(__name__)


class StepScheme(StepPlanner, Protocol):
    """What the parameter-server loop asks of a job's strategy (sync, diloco).

    Built from the spec and the data set's training rows N once the data is loaded; its
    step counts and plans are ``StepPlanner``'s.
    """

    def controls(self, model: nn.Module) -> StepControls:
        """The parameter server's optimizer, lr schedule and clipping, built on ``model``."""
        ...

    def result_fields(self) -> dict[str, Any]:
        """The strategy's fields added to the job's result document."""
        ...


@dataclass
class _Run:
    """A run's step counts and what its steps accumulate.

    Attributes:
        scheme: the strategy's steps.
        per_epoch: global steps in one epoch (``scheme.per_epoch``).
        total: global steps of the job (``scheme.total``).
        t_start: ``clock()`` seconds when this process started (or resumed) the job.
        t_steps: ``clock()`` seconds when its step loop started (after the workers loaded
            their data and built the model): ``samples_per_s`` counts from here, as an
            allreduce job's (rank 0's training steps) and the history's do.
        history: the per-epoch entries and the best test accuracy.
        samples: training samples whose gradients were applied by this process.
        test_loss: mean loss on the test split at the last evaluation (NaN before one).
        test_acc: accuracy on the test split at the last evaluation (NaN before one, and
            for tasks other than classification).
        test_metrics: the task's other metrics at the last evaluation (``test_mse``, ...).
        n_train: training rows of the data set.
        sampling: ``sampling: prioritized``: the job's priority table and draws; None:
            uniform.
    """

    scheme: StepScheme
    per_epoch: int
    total: int
    t_start: float
    n_train: int
    history: TrainHistory
    samples: int = 0
    test_loss: float = float("nan")
    test_acc: float = float("nan")
    test_metrics: dict[str, float] = field(default_factory=dict)
    sampling: PrioritizedSampling | None = None
    t_steps: float = 0.0

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
        scheme: Callable[[TrainJobSpec, int], StepScheme],
        alive: Callable[[], list[WorkerRecord]] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        train_sets: TrainSets | None = None,
        links: LinkStats | None = None,
        store: PriorityStore | None = None,
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
            scheme: builds the strategy's steps from the spec and the training rows N
                (``SyncSteps``, ``DilocoSteps``).
            alive: the ALIVE workers now (replacements for failed members); None: none.
            clock: seconds for step timings and throughput (injected by tests).
            train_sets: where the job's workers fetch their shards' rows; None: a private one.
            links: the cluster's per-worker link telemetry (RTT, step times, health), updated
                by the job; None: a private one.
            store: the memory store a ``sampling: prioritized`` job keeps its priority table
                in; None: such a job fails.
        """
        assert isinstance(job.spec, TrainJobSpec)
        self.job, self.spec, self.cfg = job, job.spec, cfg
        self._jobs, self._metrics, self._clock = jobs, metrics, clock
        self._workers = workers
        self._scheme = scheme
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
        self.members.compressor = sync_compressor(
            job.spec.compression.name, job.spec.compression.ratio
        )
        self.links = links if links is not None else LinkStats()
        self.monitor = StepMonitor(job.job_id, job.spec, self.links, metrics, cfg.step_timeout_s)
        self.checkpoint_path = Path(cfg.data_dir) / "checkpoints" / f"{job.job_id}.ckpt"
        self.model_path = Path(cfg.data_dir) / "models" / f"{job.job_id}.pt"
        self.best_model_path = Path(cfg.data_dir) / "models" / f"{job.job_id}.best.pt"
        self._best = BestModel(self.best_model_path)
        self.board = TrainBoard(cfg.tensorboard_dir() / job.job_id, job.job_id)
        self.figures = EpochFigures()
        self._store = store
        self._sampling: PrioritizedSampling | None = None
        self._restored_run: dict[str, Any] = {}  # the checkpoint's run data, when resumed

    async def run(self) -> dict[str, Any]:
        """Train to the spec's epochs/steps and return the result.

        A paced job (``coordinator.jobs.pacing``) waits at each epoch boundary for a grant,
        and ends early, with the epochs run, when its finish is asked for.

        Raises:
            JobFailed: the spec or data was refused, or every worker failed (FAILED).
        """
        try:
            return await self._run()
        finally:
            self._train_sets.close(self.job.job_id)
            await self._close_sampling()
            await asyncio.to_thread(self.board.close)
            if self._jobs.on_change is not None:  # else a shutdown: resumed from the checkpoint
                # a failed or cancelled job's too (a succeeded one's is written already)
                await asyncio.to_thread(self._best.write_at_end, self.job.job_id)

    async def _close_sampling(self) -> None:
        """Drop the priority table, unless a coordinator shutdown interrupted the job.

        A shutdown leaves the job RUNNING on disk (``JobStore.on_change`` is cleared first,
        ``coordinator.server``), for the next process to resume with its table.
        """
        if self._sampling is None or self._jobs.on_change is None:
            return
        try:
            await self._sampling.close()
        except Exception as exc:  # the job's outcome stands; the table is left behind
            log.warning("priority_table_not_dropped", job_id=self.job.job_id, error=str(exc))

    async def _run(self) -> dict[str, Any]:
        spec = self.spec
        device = job_device(spec.device, self._workers)
        # Workers get the spec with the job's device resolved (``auto`` is decided once, here).
        self.members.spec_json = spec.model_copy(update={"device": device}).model_dump_json(
            by_alias=True
        )
        dataset = await open_job_source(spec, self.cfg, self._train_sets.hashes)
        n_train = dataset.n_train
        scheme = self._scheme(spec, n_train)
        run = _Run(
            scheme=scheme,
            n_train=n_train,
            per_epoch=scheme.per_epoch,
            total=scheme.total,
            t_start=self._clock(),
            history=TrainHistory(self._clock, *history_task(spec.task, dataset.input_shape)),
        )
        ps = await asyncio.to_thread(
            ParameterServer,
            spec,
            dataset,
            self.cfg.allowed_models,
            run.total,
            scheme.controls,
            self.cfg.allowed_losses,
        )
        start_step = await asyncio.to_thread(self._restore, ps, run.history)
        if start_step == 0:  # a resumed job goes on from its checkpoint, not from init
            try:  # the spec's init weights, checked again: the file may have changed
                await asyncio.to_thread(initial_state, spec, ps.model, self.cfg)
            except ConfigError as exc:
                raise JobFailed(str(exc)) from None
        run.sampling = await self._open_sampling(scheme, n_train, start_step)
        await asyncio.to_thread(self.board.open, start_step)
        self._train_sets.open(
            self.job.job_id, dataset, spec.workers, self.members.invited.__contains__
        )
        await self.members.start(self._workers)
        run.history.start()
        run.t_steps = self._clock()
        try:
            for step in range(start_step, run.total):
                if spec.paced and step % run.per_epoch == 0 and not await self._paced(step, run):
                    run.total = step  # finished: the result counts the epochs that ran
                    break
                await self._train_step(ps, step, run)
        finally:
            self.monitor.release(self.members)
            await self.members.stop()
        await asyncio.to_thread(save_model, ps.model, self.model_path)
        await asyncio.to_thread(self._best.write)
        self.checkpoint_path.unlink(missing_ok=True)
        sampled = await run.sampling.result_fields() if run.sampling is not None else {}
        return self._result(ps, run, start_step, device) | sampled

    async def _open_sampling(
        self, scheme: StepScheme, n_train: int, start_step: int
    ) -> PrioritizedSampling | None:
        """The job's priority table and draws (``sampling: prioritized``); None: uniform.

        Raises:
            JobFailed: no store, or the table could not be made or found (FAILED).
        """
        if self.spec.sampling.name != "prioritized":
            return None
        if self._store is None:
            raise JobFailed("sampling.name: prioritized needs the coordinator's memory store")
        self._sampling = PrioritizedSampling(
            self.job.job_id, self.spec, scheme, n_train, self._store
        )
        self._sampling.load_doc(self._restored_run.get("sampling"))
        await self._sampling.open(fresh=start_step == 0)
        return self._sampling

    async def _paced(self, step: int, run: _Run) -> bool:
        """Wait at a paced job's epoch boundary: True to run the next epoch, False to finish.

        The wait is published (``waiting_for_epoch``, from 0, and ``train_rows``) and does
        not count in the next epoch's seconds.
        """
        epoch = step // run.per_epoch
        if self.job.epochs_granted <= epoch and not self.job.finish_requested:
            progress = dict(self.job.progress) or {"step": step, "steps": run.total}
            progress |= {"waiting_for_epoch": epoch, "train_rows": run.n_train}
            await self._jobs.update(self.job, progress=progress)
        go = await next_epoch(self._jobs, self.job, epoch)
        run.history.start()
        return go

    def _wire_bytes(self) -> int:
        """Bytes of the job's step messages so far, both ways (``StepMonitor.bytes``)."""
        return self.monitor.bytes["to_workers"] + self.monitor.bytes["from_workers"]

    def _result(
        self, ps: ParameterServer, run: _Run, start_step: int, device: str
    ) -> dict[str, Any]:
        elapsed = max(self._clock() - run.t_start, 1e-9)
        return self._outcome_doc(ps, run, start_step, device, elapsed) | run.scheme.result_fields()

    def _outcome_doc(
        self, ps: ParameterServer, run: _Run, start_step: int, device: str, elapsed: float
    ) -> dict[str, Any]:
        return {
            "test_accuracy": run.test_acc,
            "test_loss": run.test_loss,
            "best_test_accuracy": run.history.best_test_accuracy,
            **run.test_metrics,
            "steps": run.total,
            "epochs": run.epochs,
            "samples": run.samples,
            "samples_per_s": run.samples / max(self._clock() - run.t_steps, 1e-9),
            "seconds": elapsed,
            "device": device,
            "skipped_steps": ps.skipped_steps,
            "model_path": str(self.model_path.resolve()),
            "best_model_path": str(self.best_model_path.resolve()),
            "history": run.history.entries,
            "resumed_from_step": start_step,
            "worker_failures": self.members.failures,
            **self.monitor.result_doc(),
            "workers": self.monitor.worker_docs(self.members),
        }

    async def _train_step(self, ps: ParameterServer, step: int, run: _Run) -> None:
        """One global step of the job, with its progress event.

        Gradients from the workers, an optimizer step, evaluation (a history entry, the best
        model) at the end of an epoch, a checkpoint every ``checkpoint_every_steps``.
        """
        spec = self.spec
        epoch, step_in_epoch = divmod(step, run.per_epoch)
        t0 = self._clock()
        wire0, failures0 = self._wire_bytes(), self.members.failures
        self.members.admit()
        policy = StepPolicy(
            spec.straggler.mode,
            self.monitor.deadline_s(),
            spec.straggler.min_fraction,
            reject_nonfinite=spec.precision != "fp16",
        )
        lr = ps.lr  # the rate this step applies
        buffers = ps.buffers()
        active = [m.name for m in self.members.active()]
        rates = {n: self.links.get(n).samples_per_s for n in active}
        plan = run.scheme.plan(step, active, rates)
        if run.sampling is not None:
            plan = await run.sampling.fill(step, plan)
        order = StepOrder(
            step,
            epoch,
            plan.step_in_epoch,
            ps.version,
            ps.params() | buffers,
            frozenset(buffers),
            ps.loss_scale.scale,
            plan.inner_steps,
        )
        outcome = await self.members.step(order, plan.pieces, policy)
        self.monitor.observe(outcome, step, self.members)
        n, loss_sum, correct = await self._apply(ps, outcome, step)
        if run.sampling is not None:
            await run.sampling.record(step, plan, outcome)
        if step == 0:  # L_0: the workers computed it at the initial parameters
            self.figures.set_initial(n, loss_sum)
        self.figures.add_step((self._clock() - t0) * 1000, wire0, failures0)
        run.samples += n
        run.history.add_step(n, loss_sum)
        self.board.add_step(step + 1, loss_sum / max(n, 1), lr, worker_times(outcome))
        self._metrics.train_steps.inc()
        self._metrics.step_seconds.labels("coordinator").observe(self._clock() - t0)
        epoch_end = step_in_epoch == run.per_epoch - 1 or step == run.total - 1
        if epoch_end:
            if run.sampling is not None:
                await run.sampling.end_epoch(epoch)
            await self._end_epoch(ps, epoch, lr, run)
            entry = run.history.entries[-1]
            entry |= self.figures.end(
                entry["train_loss"], self._wire_bytes(), self.members.failures
            )
            self._metrics.convergence_ratio.labels(self.job.job_id).set(entry["convergence"])
            await asyncio.to_thread(self.board.add_epoch, step + 1, entry)
        every = (step + 1) % self.cfg.checkpoint_every_steps == 0
        # a paced job checkpoints at every epoch's end: a restart resumes at its boundary
        if (every or (spec.paced and epoch_end)) and step + 1 < run.total:
            await asyncio.to_thread(self._checkpoint, ps, step + 1, run)
        stepping = max(self._clock() - run.t_steps, 1e-9)
        await self._jobs.update(
            self.job,
            progress={
                "step": step + 1,
                "steps": run.total,
                "epoch": epoch + 1,
                "epochs": run.epochs,
                "loss": loss_sum / max(n, 1),
                "train_accuracy": train_accuracy(spec.task, correct, n),
                "test_accuracy": run.test_acc,
                "test_loss": run.test_loss,
                **run.test_metrics,
                "lr": lr,
                "samples_per_s": run.samples / stepping,
                "workers": len(self.members.live),
                "convergence": run.history.entries[-1]["convergence"]
                if run.history.entries
                else float("nan"),
                "history": run.history.recent(),
                # prioritized: the priority table's strengths (10 bins) at the last epoch end
                **({"histogram": run.sampling.histogram} if run.sampling is not None else {}),
            },
        )

    async def _end_epoch(self, ps: ParameterServer, epoch: int, lr: float, run: _Run) -> None:
        """Evaluate, add the epoch's history entry, keep the model if it is the best yet."""
        metrics = await asyncio.to_thread(ps.evaluate)
        run.test_loss = metrics.pop("test_loss")
        run.test_acc = metrics.pop("test_accuracy", float("nan"))
        run.test_metrics = metrics
        if run.history.end_epoch(epoch + 1, run.test_loss, run.test_acc, lr, metrics):
            await asyncio.to_thread(self._best.keep, ps.model)  # written at a checkpoint or the end

    async def _apply(
        self, ps: ParameterServer, outcome: StepOutcome, step: int
    ) -> tuple[int, float, int]:
        """Combine the pieces' gradients and buffers into the parameter server.

        Gradients whose L2 norm is an outlier (``max_grad_norm_ratio``) are rejected first;
        the rest are combined by ``aggregation`` (``coordinator.training.robust_aggregation``). With
        fp16, a step where a piece's gradients are not finite is skipped (the buffers are
        still merged: the forward passes ran, as in single-process AMP training).

        Raises:
            JobFailed: no piece of the step had samples (FAILED).
        """
        results = dict(outcome.results)
        spec = self.spec
        if spec.max_grad_norm_ratio is not None and len(results) >= 3:
            keys = sorted(results)
            norms = [global_norm(results[k].grads) for k in keys]
            for i in norm_outliers(norms, spec.max_grad_norm_ratio):
                r = results.pop(keys[i])
                self.monitor.reject(r.worker, step, f"gradient norm {norms[i]:.3g} is an outlier")
        counts = [r.samples for r in results.values()]
        if sum(counts) == 0:
            raise JobFailed(f"step {step}: no piece of the step had samples")
        finite = all(r.finite for r in results.values())
        skip = ps.loss_scale.enabled and not finite

        def apply() -> None:
            grads = None
            if not skip:  # pieces without rows weigh nothing in every method
                grads = aggregate(
                    [r.grads for r in results.values()], counts, spec.aggregation, spec.trim
                )
            ps.set_buffers(average_buffers([r.buffers for r in results.values()], counts))
            ps.step(grads)

        await asyncio.to_thread(apply)
        return (
            sum(counts),
            sum(r.loss_sum for r in results.values()),
            sum(r.correct for r in results.values()),
        )

    def _checkpoint(self, ps: ParameterServer, next_step: int, run: _Run) -> None:
        """Atomically write (next step, parameter-server state, history) to the checkpoint.

        The event files are flushed first: a resumed job keeps what they hold up to here;
        and the best model kept since the last checkpoint is written before the best score
        the checkpoint records. A prioritized job's running mean loss goes with it.
        """
        self.board.flush()
        self._best.write()
        kept: dict[str, Any] = {
            "history": run.history.to_doc(),
            "initial_loss": self.figures.initial_loss,
        }
        if run.sampling is not None:
            kept["sampling"] = run.sampling.to_doc()
        write_checkpoint(self.checkpoint_path, next_step, ps.state(kept))

    def _restore(self, ps: ParameterServer, history: TrainHistory) -> int:
        """Load the checkpoint if one exists; return the step to start from."""
        saved = read_checkpoint(self.checkpoint_path)
        if saved is None:
            return 0
        step, state = saved
        run = ps.load_state(state)
        history.load_doc(run.get("history", {}))
        self.figures.initial_loss = float(run.get("initial_loss", float("nan")))
        self._restored_run = run
        log.info("train_resumed", job_id=self.job.job_id, step=step)
        return step


def job_device(spec_device: str, workers: list[WorkerRecord]) -> str:
    """The device the job's workers train on: ``cpu`` or ``cuda``.

    ``auto`` is ``cuda`` only when every worker of the job trains on CUDA (its registered
    ``train_device``), so that no worker is left out and the job's arithmetic is the same on
    every worker.

    Args:
        spec_device: the spec's ``device`` (``auto``, ``cpu`` or ``cuda``).
        workers: the workers the scheduler picked.

    Raises:
        JobFailed: ``cuda`` asked for and a worker has no CUDA device (FAILED).
    """
    without = sorted(w.name for w in workers if not w.train_device.startswith("cuda"))
    if spec_device == "cuda" and without:
        raise JobFailed(f"device: cuda asked for, but worker {without[0]} trains on cpu")
    if spec_device == "auto":
        return "cuda" if workers and not without else "cpu"
    return spec_device
