"""The ``train`` job with ``strategy: allreduce``: DDP on the workers, elastic generations.

The job's workers form a ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA) in
child processes of the worker daemons and train with ``DistributedDataParallel``; the
coordinator is their rendezvous (``coordinator.training.allreduce_generation``). Rank 0 sends its
state (model, optimizer, lr schedule, grad scaler, step) every ``checkpoint_every_steps``
and at every epoch's end: the coordinator checkpoints it to disk, evaluates it on the test
split, and keeps the best model (``coordinator.training.best_model``: in memory, written at
checkpoints and at the job's end).

Elastic membership: when a member dies or drains, the survivors' collectives fail (or time
out after ``collective_timeout_s``) and their children keep their replicas. The coordinator
opens a new generation with the survivors plus idle ALIVE workers, up to ``workers`` and at
least ``min_workers`` (waiting up to ``queue_timeout_s`` for them). The survivor holding the
newest step becomes rank 0 and broadcasts its state; with no survivor, the coordinator's
newest state is sent instead. The next step's rows are split over the new ranks
(``shared.training.partition``), so every row of an epoch is trained on exactly once.
A generation never waits forever: a rank that does not join the group, or stays silent
once another rank has ended, for ``2 x collective_timeout_s + 10 s``
(``Generation.liveness_s``) is given up on like a dead one, and after
``MAX_STALLED_GENERATIONS`` generations in a row without a step of progress the job fails
with the last generation's reasons. A
worker that turns up while the job has fewer than ``workers`` ranks is taken in at the next
generation, which the coordinator opens by asking the ranks to stop at their next control
point.

With ``sharding: fsdp`` (``worker.allreduce.fsdp_replica``) no rank holds the whole state:
rank 0 gathers it for every state it sends, and when a generation stops for a rescale it
sends one more (a checkpoint). A new generation always starts from the coordinator's newest
full state, sharded anew over its ranks; after a member died that is the last checkpoint,
and the steps since are trained again.

A paced job (``coordinator.jobs.pacing``) runs each generation up to the epochs granted
(``stop_at_step``): there rank 0 sends its full state (a checkpoint) and the ranks end the
generation, their children keeping their replicas while the job waits for the next grant.

With ``sampling: prioritized`` each window of ``resample_every_steps`` steps (default: one
epoch) is one generation: the coordinator draws the window's rows and weights at its start
(``coordinator.training.prioritized``), sends them to every rank with the generation, and
the generation ends at the window's end (rank 0 sending its full state there). When it ended
cleanly, the ranks' per-sample losses set the rows' strengths
(``coordinator.training.allreduce_windows``), and at an epoch's end the strengths decay. A
generation that ends early (a rank failed, a rescale) is run again from the window's start
with the coordinator's state of that step: the same rows, weights and state, so the job
equals an undisturbed run.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from coordinator.jobs.jobs import JobFailed, JobRecord, JobStore
from coordinator.jobs.pacing import next_epoch
from coordinator.placement.membership import WorkerRecord
from coordinator.training.allreduce_generation import Generation, GenerationOutcome, GenerationPlan
from coordinator.training.allreduce_windows import AllreduceSteps, window_losses
from coordinator.training.best_model import BestModel
from coordinator.training.checkpoints import read_checkpoint, save_model, write_checkpoint
from coordinator.training.epoch_figures import EpochFigures
from coordinator.training.evaluation import evaluate
from coordinator.training.prioritized import PrioritizedSampling, PriorityStore
from coordinator.training.saved_models import initial_state
from coordinator.training.tensorboard_log import TrainBoard
from coordinator.training.train_history import history_task, train_accuracy
from coordinator.training.train_job import job_device
from coordinator.training.train_sets import TrainSets, open_job_source
from shared.config import ConfigError, CoordinatorConfig, TrainJobSpec
from shared.logging import get_logger
from shared.metrics import Metrics
from shared.proto import worker_pb2
from shared.rpc.peers import WorkerClients
from shared.training.models import build_model
from shared.training.packed_state import is_packed, load_packed
from shared.training.partition import (
    allreduce_steps_per_epoch,
    allreduce_total_steps,
    global_batch_size,
    step_rows,
)
from shared.training.tasks import task_of

log = get_logger(__name__)

# Generations in a row that may end without a step of progress before the job fails.
MAX_STALLED_GENERATIONS = 5
# How long a worker may take to start its training process and open the store, seconds.
START_TIMEOUT_S = 120.0


@dataclass
class _EpochStats:
    """What the ranks reported for one epoch: rows trained, loss summed (nats), correct."""

    samples: int = 0
    loss_sum: float = 0.0
    correct: int = 0
    seconds: float = 0.0  # rank 0's seconds in the epoch's training steps


@dataclass
class _Progress:
    """The job's position and what it accumulated.

    Attributes:
        applied: steps applied (the newest step any replica or the coordinator holds).
        rows: epoch -> rows of the applied steps of that epoch.
        epochs: epoch -> what the ranks reported.
    """

    applied: int = 0
    rows: dict[int, int] = field(default_factory=dict)
    epochs: dict[int, _EpochStats] = field(default_factory=dict)
    lr: float = float("nan")
    test_loss: float = float("nan")
    test_acc: float = float("nan")
    test_metrics: dict[str, float] = field(default_factory=dict)
    best_acc: float = float("-inf")
    best_score: float = float("-inf")  # accuracy, or minus the test loss (not classification)
    history: list[dict[str, Any]] = field(default_factory=list)


class AllreduceJob:
    """Runs one allreduce train job to completion; ``run`` returns the result document."""

    def __init__(
        self,
        job: JobRecord,
        workers: list[WorkerRecord],
        cfg: CoordinatorConfig,
        clients: WorkerClients,
        jobs: JobStore,
        metrics: Metrics,
        alive: Callable[[], list[WorkerRecord]],
        train_sets: TrainSets,
        clock: Callable[[], float] = time.perf_counter,
        store: PriorityStore | None = None,
    ) -> None:
        """Prepare the job; nothing runs until ``run``.

        Args:
            job: a record whose spec is a ``TrainJobSpec`` with ``strategy: allreduce``.
            workers: the workers the scheduler picked (the first generation's ranks).
            cfg: the coordinator's config (timeouts in seconds, checkpoint interval, data
                dir, chunk size).
            clients: channels to the workers.
            jobs: where progress is published.
            metrics: step counters.
            alive: the ALIVE workers now.
            train_sets: where workers fetch a file data set's rows (all of them, one shard).
            clock: seconds, for throughput.
            store: the memory store a ``sampling: prioritized`` job keeps its priority
                table in (None: prioritized jobs fail).
        """
        assert isinstance(job.spec, TrainJobSpec)
        self.job, self.spec, self.cfg = job, job.spec, cfg
        self._workers, self._clients, self._jobs = workers, clients, jobs
        self._metrics, self._alive, self._train_sets, self._clock = (
            metrics,
            alive,
            train_sets,
            clock,
        )
        self._invited: set[str] = set()
        self._contributed: dict[str, int] = {}  # worker -> generations it trained in
        self._state = b""  # the newest state received (or restored), torch.save bytes
        self._state_step = 0
        self._final = b""
        self._chunks: dict[str, list[bytes]] = {}
        self._progress = _Progress()
        self.generations = 0
        self.failures = 0
        self._device = "cpu"  # where the last generation trained
        data_dir = Path(cfg.data_dir)
        self.checkpoint_path = data_dir / "checkpoints" / f"{job.job_id}.ckpt"
        self.run_path = data_dir / "checkpoints" / f"{job.job_id}.run"  # history, best
        self.model_path = data_dir / "models" / f"{job.job_id}.pt"
        self.best_model_path = data_dir / "models" / f"{job.job_id}.best.pt"
        self._best = BestModel(self.best_model_path)
        self.board = TrainBoard(cfg.tensorboard_dir() / job.job_id, job.job_id)
        self.figures = EpochFigures()
        self._wire = 0  # bytes of the job's messages through the coordinator, both ways
        self._store = store
        self._sampling: PrioritizedSampling | None = None
        self._steps: AllreduceSteps | None = None
        self._last_ranks: list[str] = []  # the last generation's workers in rank order
        # prioritized: the current window's first step and the full state of that step (a
        # window that did not end whole runs again from it)
        self._window_first = -1
        self._window_start: tuple[int, bytes] | None = None
        self._restored_sampling: dict[str, Any] | None = None  # the checkpoint's running mean
        self._checkpointed = -1  # the step of the last checkpoint written

    async def run(self) -> dict[str, Any]:
        """Train to the spec's epochs/steps and return the result.

        Raises:
            JobFailed: the data or model was refused, a worker refused the job, fewer than
                ``min_workers`` stayed ALIVE for ``queue_timeout_s``, or generations kept
                ending without progress (FAILED).
        """
        try:
            return await self._run()
        finally:
            self._train_sets.close(self.job.job_id)
            await self._stop_children()
            await asyncio.to_thread(self.board.close)
            if self._jobs.on_change is not None:  # else a shutdown: resumed from the checkpoint
                # a failed or cancelled job's too (a succeeded one's is written already)
                await asyncio.to_thread(self._best.write_at_end, self.job.job_id)

    async def _run(self) -> dict[str, Any]:
        spec = self.spec
        dataset = await open_job_source(spec, self.cfg, self._train_sets.hashes)
        self._dataset = dataset
        self._task = await asyncio.to_thread(task_of, spec, self.cfg.allowed_losses)
        self._model = await asyncio.to_thread(
            build_model,
            spec.model,
            dataset.input_shape,
            dataset.num_classes,
            spec.seed,
            self.cfg.allowed_models,
        )
        n_train = dataset.n_train
        self._global_batch = global_batch_size(spec)
        self._per_epoch = allreduce_steps_per_epoch(n_train, self._global_batch)
        self._total = allreduce_total_steps(spec, n_train)
        resumed = await asyncio.to_thread(self._restore)
        if resumed == 0 and spec.init is not None:  # rank 0 starts from it, broadcasts it
            self._state = await asyncio.to_thread(self._initial_state)
        await asyncio.to_thread(self.board.open, resumed)
        self._train_sets.open(self.job.job_id, dataset, 1, self._invited.__contains__)
        t0 = self._clock()
        await self._open_sampling(n_train, resumed)
        await self._generations()
        seconds = max(self._clock() - t0, 1e-9)
        result = await asyncio.to_thread(self._result, resumed, seconds)
        if self._sampling is not None:
            result |= await self._sampling.result_fields()
            await self._sampling.close()
        return result

    async def _open_sampling(self, n_train: int, resumed: int) -> None:
        """The job's priority table and draws (``sampling: prioritized``); nothing: uniform.

        Raises:
            JobFailed: no store, or the table could not be made or found (FAILED).
        """
        if self.spec.sampling.name != "prioritized":
            return
        if self._store is None:
            raise JobFailed("sampling.name: prioritized needs the coordinator's memory store")
        self._steps = AllreduceSteps(n_train, self._global_batch, self._per_epoch, self._total)
        self._sampling = PrioritizedSampling(
            self.job.job_id, self.spec, self._steps, n_train, self._store
        )
        self._sampling.load_doc(self._restored_sampling)
        await self._sampling.open(fresh=resumed == 0)

    async def _generations(self) -> None:
        members = list(self._workers)
        held: dict[str, int] = {}
        stalled, last_reason = 0, ""
        failed: set[str] = set()
        while not self._final:
            stop_at = await self._paced() if self.spec.paced else 0
            if stop_at < 0:  # a paced job's finish: the model as of its last boundary
                self._final, self._total = self._state, self._progress.applied
                return
            window = None
            if self._sampling is not None:
                window = await self._sampling.window(self._state_step)
                stop_at = min(stop_at or self._total, window[1])
                if self._window_first != window[0]:
                    self._window_first, self._window_start = window[0], None
                if self._state and self._state_step == window[0]:
                    self._window_start = (self._state_step, self._state)
            members = await self._fill(members, failed)
            before = self._progress.applied
            outcome = await self._generation(members, held, stop_at, window)
            self.generations += 1
            self.failures += len(outcome.failed)
            failed = set(outcome.failed)  # sat out for one generation, in case they are down
            held = {n: s for n, s in outcome.held.items() if self._is_alive(n)}
            members = [w for w in members if w.name in held]
            if outcome.done and not self._final:
                raise JobFailed("the workers finished without sending the final state")
            self._advance(max(held.values(), default=self._progress.applied))
            if window is not None:
                await self._end_window(window, outcome)
            stalled = 0 if self._progress.applied > before else stalled + 1
            last_reason = "; ".join([*outcome.failed.values(), *outcome.reasons])[:500]
            if stalled >= MAX_STALLED_GENERATIONS and not self._final:
                raise JobFailed(
                    f"{stalled} generations in a row made no progress; last: {last_reason}"
                )

    async def _end_window(
        self, window: tuple[int, int, Any, Any], outcome: GenerationOutcome
    ) -> None:
        """Record a window's losses when its generation ran it whole; decay at an epoch end.

        A generation that ended before the window's end (a failure, a rescale) records
        nothing: the next one runs the window again from its start.
        """
        assert self._sampling is not None and self._steps is not None
        first, stop = window[0], window[1]
        ranks = self._last_ranks
        whole = not outcome.failed and all(outcome.held.get(n) == stop for n in ranks)
        losses = window_losses(self._steps, ranks, outcome.losses, stop) if whole else {}
        if not whole or set(losses) != set(range(first, stop)):
            # Some rank's losses are lost: run the window again from its start (the rows
            # were drawn once; the state of its first step is the coordinator's).
            if self._window_start is not None:
                self._state_step, self._state = self._window_start
                self._final = b""
            self._rollback(self._state_step)
            return
        await self._sampling.record_window(first, losses)
        if self._checkpointed == stop:
            # the checkpoint of the window's end came before its losses: add them to it
            await asyncio.to_thread(self._write_run, stop)
        if stop % self._per_epoch == 0 or stop >= self._total:
            await self._sampling.end_epoch((stop - 1) // self._per_epoch)

    async def _paced(self) -> int:
        """The step a paced job's next generation stops at; -1 when the job is to finish.

        At an epoch boundary with no epoch left granted it waits for a grant (published as
        ``waiting_for_epoch`` and ``train_rows``) or the finish.
        """
        job, applied = self.job, self._progress.applied
        epoch = applied // self._per_epoch
        if applied % self._per_epoch == 0 and job.epochs_granted <= epoch:
            if not job.finish_requested:
                progress = dict(job.progress) or {"step": applied, "steps": self._total}
                progress |= {
                    "waiting_for_epoch": epoch,
                    "train_rows": self._dataset.n_train,
                    # the last epoch's entry: evaluated after the last progress event
                    "history": self._progress.history[-20:],
                }
                await self._jobs.update(job, progress=progress)
            if not await next_epoch(self._jobs, job, epoch):
                return -1
        return min(self._total, job.epochs_granted * self._per_epoch)

    async def _generation(
        self,
        members: list[WorkerRecord],
        held: dict[str, int],
        stop_at: int = 0,
        window: tuple[int, int, Any, Any] | None = None,
    ) -> GenerationOutcome:
        if self.spec.sharding == "fsdp":
            # Shards do not outlive their generation (and a dead rank takes its shards with
            # it): every generation starts from the coordinator's newest full state, which
            # rank 0 sent at the last checkpoint or when the last generation stopped.
            held, newest = {}, -1
            ranks = sorted(members, key=lambda w: w.name)
            state = self._state
            self._rollback(self._state_step)
        elif window is not None and self._state:
            # prioritized: the window runs from the coordinator's state of its first step;
            # a rank holding exactly that step (it sent it) need not be sent it
            ranks = sorted(members, key=lambda w: (held.get(w.name) != self._state_step, w.name))
            newest = held.get(ranks[0].name, -1)
            state = b"" if newest == self._state_step else self._state
            self._rollback(self._state_step)
        else:
            ranks = sorted(members, key=lambda w: (-held.get(w.name, -1), w.name))
            newest = held.get(ranks[0].name, -1)
            state = b"" if newest >= self._state_step and newest >= 0 else self._state
            if state:
                self._rollback(self._state_step)
            elif newest >= 0:
                self._rollback(newest)
        self._invited.update(w.name for w in ranks)
        self._wire += len(state)
        for w in ranks:
            self._contributed[w.name] = self._contributed.get(w.name, 0) + 1
        plan = GenerationPlan(
            number=self.generations,
            ranks=ranks,
            spec_json=self._spec_json(ranks),
            state=state,
            checkpoint_every=self.cfg.checkpoint_every_steps,
            timeout_s=self.spec.collective_timeout_s,
            start_timeout_s=START_TIMEOUT_S,
            held_before={w.name: held[w.name] for w in ranks if w.name in held},
            stop_at_step=stop_at,
        )
        if window is not None:  # every rank gets the whole window (rank_rows splits it)
            plan.window = (
                window[0],
                window[2].astype("<i8").tobytes(),
                window[3].astype("<f4").tobytes(),
            )
            plan.send_start_state = not self._state
            self._wire += len(ranks) * (len(plan.window[1]) + len(plan.window[2]))
        self._last_ranks = [w.name for w in ranks]
        log.info(
            "allreduce_generation",
            job_id=self.job.job_id,
            generation=plan.number,
            ranks=[w.name for w in ranks],
            from_step=self._state_step if state or newest < 0 else newest,
        )
        return await Generation(
            self.job.job_id,
            plan,
            self._clients,
            self.cfg.chunk_bytes,
            self._on_event,
            self._is_alive,
            lambda: len(ranks) < self.spec.workers and bool(self._idle(ranks)),
        ).run()

    def _spec_json(self, ranks: list[WorkerRecord]) -> str:
        """The spec with ``device`` resolved for this generation's ranks (``job_device``)."""
        device = self._device = job_device(self.spec.device, ranks)
        return self.spec.model_copy(update={"device": device}).model_dump_json(by_alias=True)

    async def _fill(self, members: list[WorkerRecord], failed: set[str]) -> list[WorkerRecord]:
        """Survivors plus idle ALIVE workers, up to ``workers``; wait for ``min_workers``.

        Workers in ``failed`` (their call failed in the last generation, while the
        coordinator may not have declared them DEAD yet) are left out this time, unless the
        job would wait for them: one still (or again, readmitted) ALIVE once the failure
        detector had its chance (``heartbeat_timeout_s`` + 2 heartbeat intervals) may join,
        so that a worker that missed its heartbeats under load does not fail a job that
        needs it.
        """
        spec = self.spec
        min_workers = spec.min_workers or spec.workers
        now = self._clock()
        deadline = now + self.cfg.queue_timeout_s
        detected = now + self.cfg.heartbeat_timeout_s + 2 * self.cfg.heartbeat_interval_s
        while True:
            if failed and self._clock() >= detected:
                failed = set()
            alive = {w.name: w for w in self._alive() if w.name not in failed}
            kept = [alive[w.name] for w in members if w.name in alive]
            idle = [w for w in self._idle(kept) if w.name not in failed]
            kept += idle[: spec.workers - len(kept)]
            if len(kept) >= min_workers:
                return kept
            if self._clock() >= deadline:
                out = (
                    f", besides {sorted(failed)} (failed in the last generation)" if failed else ""
                )
                raise JobFailed(
                    f"only {len(kept)} workers ALIVE for the job{out}, min_workers is "
                    f"{min_workers} (waited {self.cfg.queue_timeout_s:g} s, queue_timeout_s)"
                )
            await asyncio.sleep(0.2)

    def _idle(self, members: list[WorkerRecord]) -> list[WorkerRecord]:
        names = {w.name for w in members}
        return sorted((w for w in self._alive() if w.name not in names), key=lambda w: w.name)

    def _is_alive(self, name: str) -> bool:
        return any(w.name == name for w in self._alive())

    # -- events -----------------------------------------------------------------------------

    async def _on_event(self, name: str, event: worker_pb2.AllreduceEvent) -> None:
        self._wire += event.ByteSize()
        if event.HasField("progress"):
            await self._on_progress(name, event.progress)
        elif event.HasField("state"):
            st = event.state
            self._chunks.setdefault(name, []).append(st.data)
            if st.last:
                data = b"".join(self._chunks.pop(name))
                await self._on_state(int(st.step), st.reason, data)

    async def _on_progress(self, name: str, p: worker_pb2.AllreduceProgress) -> None:
        prog = self._progress
        e = prog.epochs.setdefault(int(p.epoch), _EpochStats())
        e.samples += int(p.samples)
        e.loss_sum += float(p.loss_sum)
        e.correct += int(p.correct)
        e.seconds += float(p.seconds)
        self._advance(int(p.step))
        prog.lr = float(p.lr)
        step_s = float(p.seconds) / max(int(p.steps), 1)
        if int(p.step) == int(p.steps) == 1:  # the job's first step: L_0
            self.figures.set_initial(int(p.samples), float(p.loss_sum))
        for _ in range(int(p.steps)):  # each step counts as its report's mean
            self.figures.add_step(step_s * 1000, self._wire, self.failures)
        if p.steps:
            self._metrics.train_steps.inc(int(p.steps))
            self._metrics.step_seconds.labels("allreduce").observe(step_s)
            loss = float(p.loss_sum) / max(int(p.samples), 1)
            self.board.add_step(int(p.step), loss, prog.lr, {name: (step_s,)})
        await self._publish(e, step_s)

    async def _publish(self, epoch: _EpochStats, step_s: float) -> None:
        prog = self._progress
        await self._jobs.update(
            self.job,
            progress={
                "step": prog.applied,
                "steps": self._total,
                "epoch": min(prog.applied // self._per_epoch + 1, self._epochs),
                "epochs": self._epochs,
                "loss": epoch.loss_sum / max(epoch.samples, 1),
                "train_accuracy": train_accuracy(self.spec.task, epoch.correct, epoch.samples),
                "test_accuracy": prog.test_acc,
                "test_loss": prog.test_loss,
                **prog.test_metrics,
                "samples_per_s": self.spec.workers
                * self.spec.batch_size
                * self.spec.grad_accum_steps
                / max(step_s, 1e-9),
                "workers": len(self._contributed),
                "generation": self.generations,
                "history": prog.history[-20:],  # the result holds them all
            },
        )

    @property
    def _epochs(self) -> int:
        return -(-self._total // self._per_epoch)

    async def _on_state(self, step: int, reason: str, data: bytes) -> None:
        """A state from rank 0: full (checkpoint, final) or the model alone (epoch)."""
        self._advance(step)
        if reason == "final":
            self._final = data
        if reason in ("checkpoint", "final"):
            self._state, self._state_step = data, step
            if step == self._window_first:  # prioritized: the step-0 state a window starts at
                self._window_start = (step, data)
        if reason == "checkpoint":
            await asyncio.to_thread(self._checkpoint, step, data)
        at_epoch_end = step > 0 and (step % self._per_epoch == 0 or step >= self._total)
        if at_epoch_end and step not in {h["step"] for h in self._progress.history}:
            await asyncio.to_thread(self._evaluate, step, data)

    def _advance(self, step: int) -> None:
        """Count the rows of the steps applied up to ``step`` into their epochs."""
        prog = self._progress
        for s in range(prog.applied, step):
            epoch, in_epoch = divmod(s, self._per_epoch)
            prog.rows[epoch] = prog.rows.get(epoch, 0) + self._rows_of(in_epoch)
        prog.applied = max(prog.applied, step)

    def _rollback(self, step: int) -> None:
        """Training goes on from ``step``: the rows of later steps will be trained again."""
        prog = self._progress
        for s in range(step, prog.applied):
            epoch, in_epoch = divmod(s, self._per_epoch)
            prog.rows[epoch] -= self._rows_of(in_epoch)
        prog.applied = min(prog.applied, step)

    def _rows_of(self, step_in_epoch: int) -> int:
        return step_rows(self._dataset.n_train, self._global_batch, step_in_epoch)

    # -- state, evaluation, files -----------------------------------------------------------

    def _load(self, data: bytes) -> None:
        """Load rank 0's model into the coordinator's copy (from a full state or the model's).

        An epoch's state is the model alone, ``pack_state``'s bytes; a checkpoint's or the
        final one is torch.save bytes of the full state.
        """
        if is_packed(data):
            load_packed(self._model, data)
            return
        state: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        full = "model" in state and "optimizer" in state and "step" in state
        self._model.load_state_dict(state["model"] if full else state)

    def _evaluate(self, step: int, data: bytes) -> None:
        """Evaluate rank 0's state at an epoch's end; keep the history and the best model."""
        self._load(data)
        prog = self._progress
        metrics = evaluate(self._model, self._dataset, self._task)
        prog.test_loss = metrics.pop("test_loss")
        prog.test_acc = metrics.pop("test_accuracy", float("nan"))
        prog.test_metrics = metrics
        epoch = (step - 1) // self._per_epoch
        stats = prog.epochs.get(epoch, _EpochStats())
        samples_per_s = stats.samples / max(stats.seconds, 1e-9)
        _, tokens_per_sample = history_task(self.spec.task, self._dataset.input_shape)
        entry = {
            "epoch": epoch + 1,
            "step": step,
            "train_loss": stats.loss_sum / max(stats.samples, 1),
            "train_accuracy": train_accuracy(self.spec.task, stats.correct, stats.samples),
            "test_loss": prog.test_loss,
            "test_accuracy": prog.test_acc,
            **metrics,
            "lr": prog.lr,
            "samples": prog.rows.get(epoch, 0),
            "samples_per_s": samples_per_s,
        }
        if tokens_per_sample:
            entry["tokens_per_s"] = samples_per_s * tokens_per_sample
        entry |= self.figures.end(entry["train_loss"], self._wire, self.failures)
        self._metrics.convergence_ratio.labels(self.job.job_id).set(entry["convergence"])
        prog.history.append(entry)
        self.board.add_epoch(step, entry)
        by_accuracy = self._task.scored_by_accuracy
        score = prog.test_acc if by_accuracy else -prog.test_loss
        if score > prog.best_score:
            prog.best_score = score
            if by_accuracy:
                prog.best_acc = prog.test_acc
            self._best.keep(self._model)  # written at the next checkpoint or the end

    def _checkpoint(self, step: int, data: bytes) -> None:
        """Rank 0's state, and beside it the job's history and best accuracy (JSON).

        The event files are flushed first: a resumed job keeps what they hold up to here.
        """
        self.board.flush()
        self._write_run(step)
        write_checkpoint(self.checkpoint_path, step, data)
        self._checkpointed = step

    def _write_run(self, step: int) -> None:
        """The job's history, best score and (prioritized) running mean loss, as of ``step``.

        The best model kept since the last write goes to its file first, so the best score
        the run file records is always the model's in ``JOB.best.pt``.
        """
        self._best.write()
        prog = self._progress
        run = {
            "history": prog.history,
            "best_acc": prog.best_acc,
            "best_score": prog.best_score,
            "initial_loss": self.figures.initial_loss,
        }
        if self._sampling is not None:  # a window's losses are in it once the window ended
            run["sampling"] = self._sampling.to_doc()
        write_checkpoint(self.run_path, step, json.dumps(run).encode())

    def _initial_state(self) -> bytes:
        """The ``init`` model as a state of the model and step 0 alone (``DdpReplica.load_state``).

        Raises:
            JobFailed: the saved model is gone or no longer fits the job's model.
        """
        try:
            initial_state(self.spec, self._model, self.cfg)
        except ConfigError as exc:
            raise JobFailed(str(exc)) from None
        buf = io.BytesIO()
        torch.save({"model": self._model.state_dict(), "step": 0}, buf)
        return buf.getvalue()

    def _restore(self) -> int:
        """Load the checkpoint if one exists; return the step it holds (0: none)."""
        saved = read_checkpoint(self.checkpoint_path)
        if saved is None:
            return 0
        self._state_step, self._state = saved
        self._advance(self._state_step)
        run = read_checkpoint(self.run_path)
        if run is not None:
            doc = json.loads(run[1])
            prog = self._progress
            prog.history = [h for h in doc["history"] if h["step"] <= self._state_step]
            prog.best_acc = float(doc["best_acc"])
            prog.best_score = float(doc.get("best_score", prog.best_acc))
            self.figures.initial_loss = float(doc.get("initial_loss", math.nan))
            self._restored_sampling = doc.get("sampling")
            if prog.history:
                prog.test_loss = prog.history[-1]["test_loss"]
                prog.test_acc = prog.history[-1]["test_accuracy"]
        log.info("train_resumed", job_id=self.job.job_id, step=self._state_step)
        return self._state_step

    def _result(self, resumed: int, seconds: float) -> dict[str, Any]:
        if self._final:  # else a paced job finished before its first epoch: the initial model
            self._load(self._final)
        save_model(self._model, self.model_path)
        self._best.write()
        self.checkpoint_path.unlink(missing_ok=True)
        self.run_path.unlink(missing_ok=True)
        prog = self._progress
        samples = sum(e.samples for e in prog.epochs.values())
        training_s = sum(e.seconds for e in prog.epochs.values())  # rank 0's steps
        return {
            "strategy": "allreduce",
            "device": self._device,
            "test_accuracy": prog.test_acc,
            "test_loss": prog.test_loss,
            "best_test_accuracy": prog.best_acc if self._task.scored_by_accuracy else math.nan,
            **prog.test_metrics,
            "steps": self._total,
            "epochs": self._epochs,
            "samples": samples,
            # Throughput of the training steps (rank 0's clock; not the processes' start-up).
            "samples_per_s": samples / max(training_s, 1e-9),
            "seconds": seconds,
            "model_path": str(self.model_path.resolve()),
            "best_model_path": str(self.best_model_path.resolve()),
            "resumed_from_step": resumed,
            "generations": self.generations,
            "worker_failures": self.failures,
            "history": prog.history,
            "workers": {n: {"generations": g} for n, g in sorted(self._contributed.items())},
        }

    async def _stop_children(self) -> None:
        """StopTraining on every worker invited (kills its child; errors ignored)."""
        req = worker_pb2.StopTrainingRequest(job_id=self.job.job_id)
        alive = {w.name: w for w in self._alive()}
        await asyncio.gather(
            *(
                self._clients.stub(n, alive[n].address).StopTraining(req, timeout=5.0)
                for n in self._invited
                if n in alive
            ),
            return_exceptions=True,
        )
