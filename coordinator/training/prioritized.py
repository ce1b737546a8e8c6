"""Prioritized training (``sampling: prioritized``): the job's priority table and its draws.

A sync, diloco or allreduce job with ``sampling: prioritized`` keeps one memory per training
row in a table of its own, ``job-<id>-priorities`` (id = the row's index, strength 1 at the
start), in the cluster's memory store (``coordinator.memory``). The parameter-server loop
(``coordinator.training.train_job``) asks this module, around each step:

- ``fill``: the step's pieces as its strategy planned them (``StepPlan``: the uniform plan's
  pieces, each the size it has today), their rows replaced by drawn rows. The rows of a
  *window* are drawn at its start, in one draw of the store's exact seeded sampler
  (``coordinator.memory.sampling.Sampler``: P(i) = w_i / W, w_i the integer form of
  s_i^alpha), as many as the window's steps have rows, with the seed ``draw_seed`` of the
  job's seed, the epoch and the window's first step; the drawn rows fill the pieces of the
  window's steps in order (step by step, piece by piece, each piece's rows in order). Each
  drawn row carries its importance weight (``importance_weights``: (N P(i))^-beta_t over the
  window's draw, divided by its max, beta_t annealed over the job, ``annealed_beta``), sent
  with the piece; the worker's loss is mean_i(w_i l_i) over its rows, so the sample-weighted
  average of the pieces is the mean over the step's batch. ``sync``: a window is one step.
  ``diloco``: a window is ``resample_every_steps`` inner steps (a multiple of ``inner_steps``:
  whole outer steps, default one), cut at epoch ends; its outer steps' rows are drawn together
  at the first, because an outer step's pieces carry all its inner steps' rows to the workers
  at once and their losses come back only when it ends, so a draw cannot come sooner than
  an outer step's start nor use losses from inside it.
  ``allreduce``: a window is ``resample_every_steps`` steps (default: one epoch), cut at epoch
  ends; ``coordinator.training.allreduce_job`` runs one generation per window and sends its
  rows and weights to the ranks at its start (``window``), the losses come back when the
  generation ends (``record_window``).
- ``record``: the per-sample losses the workers returned (unweighted) set the drawn rows'
  strengths, ``strengths_of_losses`` of the running mean loss (this step's included), through
  the store's bulk priority update (``MemoryRouter.update_strengths``) with a request id of the
  job, the table's incarnation and the step, so a retry is applied once. A row drawn twice in
  a step takes the loss of its last occurrence in draw order (the update's rule: the last
  occurrence of an id wins); in diloco that is the most recent loss. Rows of a piece left
  out (``straggler.mode: drop``, a rejected gradient) keep their strength.
- ``end_epoch``: every strength decays by ``decay_rate`` (the store's decay, exactly once per
  epoch by its op id): priorities not refreshed by a draw fade.

A job starting at step 0 starts from a fresh table (dropping one a crashed run left), so a
re-run from the start is the same job. A job resumed from a checkpoint at step c finds its
table as the previous process left it: its strengths may already hold steps after c, which the
resumed steps draw from (the job then differs from an undisturbed run), and the running mean
comes from the checkpoint. The table is dropped when the job ends (``close``), but not when a
coordinator shutdown interrupts it (the next process resumes it).

Shape letters: K rows of a draw, R rows of one piece.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from coordinator.jobs.jobs import JobFailed
from coordinator.memory.memory_ops import BulkOpError, MemoryOps
from coordinator.memory.sampling import Sampler, SampleRefused
from coordinator.memory.tables import Tables
from coordinator.placement.rebalance import Rebalancer
from coordinator.training.priority_rules import (
    RunningLoss,
    annealed_beta,
    draw_seed,
    importance_weights,
    strengths_of_losses,
)
from coordinator.training.step_types import StepOutcome, StepPlan, StepPlanner
from shared.client.memory import MemoryRouter, RoutingError
from shared.config import TrainJobSpec
from shared.memory.tables import TableNotFound
from shared.memory.validation import MemoryInputError
from shared.rpc.limits import BudgetExceeded

LOAD_BATCH = 100_000  # memories per upsert while the table is filled
_STORE_ERRORS = (
    BulkOpError,
    RoutingError,
    SampleRefused,
    MemoryInputError,
    TableNotFound,
    BudgetExceeded,
)


def priority_table(job_id: str) -> str:
    """The name of a job's priority table: ``job-<id>-priorities``."""
    return f"job-{job_id}-priorities"


def left_tables(tables: Iterable[str], ended_jobs: Iterable[str]) -> list[str]:
    """The priority tables of jobs that ended, found among ``tables`` (by name, sorted).

    A job's table is dropped when it ends; one is left behind when the drop failed, or when
    a job that was running is failed by the next coordinator process ("crashed the
    coordinator twice"). Only the tables of the jobs named are returned, so a table a user
    made under another name is never taken for one.

    Args:
        tables: the names of the cluster's tables.
        ended_jobs: the ids of prioritized train jobs in a terminal state.
    """
    names = set(tables)
    return sorted(n for n in (priority_table(j) for j in ended_jobs) if n in names)


@dataclass(frozen=True)
class PriorityStore:
    """The coordinator's memory store, as a prioritized job uses it.

    Attributes:
        tables: creates and drops the job's table.
        sampler: draws from it.
        memory: its decay and statistics.
        router: its keyed writes (the fill, the priority updates).
        rebalancer: the slot map, waited on until it settles before the table is made.
        max_sample_batch: the most rows one draw may ask for (larger ones go in parts).
        settle_timeout_s: how long the slot map may take to settle, seconds.
    """

    tables: Tables
    sampler: Sampler
    memory: MemoryOps
    router: MemoryRouter
    rebalancer: Rebalancer
    max_sample_batch: int
    settle_timeout_s: float


@dataclass(frozen=True)
class _Window:
    """One draw and the steps it serves: step -> (offset, rows) in the draw."""

    first: int
    spans: dict[int, tuple[int, int]]
    rows: np.ndarray  # [K] int64
    weights: np.ndarray  # [K] float32


class PrioritizedSampling:
    """A prioritized job's table, draws, priority updates and decays."""

    def __init__(
        self,
        job_id: str,
        spec: TrainJobSpec,
        scheme: StepPlanner,
        n_train: int,
        store: PriorityStore,
    ) -> None:
        """Nothing is made until ``open``.

        Args:
            job_id: the job.
            spec: its spec (``sampling``, ``strategy``, ``inner_steps``, ``seed``).
            scheme: its strategy's steps.
            n_train: N, its training rows (the table's memories).
            store: the coordinator's memory store.
        """
        self.job_id, self.spec, self.scheme, self.n_train = job_id, spec, scheme, n_train
        self.store = store
        self.table = priority_table(job_id)
        self.running = RunningLoss()
        self._table_id = 0
        self._window: _Window | None = None
        self._digest = hashlib.sha256()
        self.drawn = 0
        self.histogram: list[int] = []  # the table's strengths in 10 bins, at the last epoch end
        every = spec.sampling.resample_every_steps or spec.inner_steps
        self._outer_per_window = every // spec.inner_steps if spec.strategy == "diloco" else 1
        if spec.strategy == "allreduce":
            self._outer_per_window = spec.sampling.resample_every_steps or scheme.per_epoch

    async def open(self, fresh: bool) -> None:
        """Wait for the slot map to settle, then make the table (``fresh``) or find it.

        Args:
            fresh: the job starts at step 0: any table of the job is dropped and a new one
                filled (rows 0..N-1, strength 1); else the existing one is kept (made
                afresh only when it is missing).

        Raises:
            JobFailed: the map did not settle, or the store refused or failed (FAILED).
        """
        await self._settled()
        try:
            exists = self.table in {t.name for t in self.store.tables.specs()}
            if exists and fresh:
                await self.store.tables.drop(self.table)
            if fresh or not exists:
                spec = await self.store.tables.create(self.table)
                ids = np.arange(self.n_train, dtype=np.uint64)
                for start in range(0, self.n_train, LOAD_BATCH):
                    part = ids[start : start + LOAD_BATCH]
                    await self.store.router.upsert(
                        part, np.ones(len(part), np.float32), None, table=self.table
                    )
            else:
                spec = self.store.tables.spec(self.table)
        except _STORE_ERRORS as exc:
            raise JobFailed(f"sampling: the priority table {self.table}: {exc}") from None
        self._table_id = int(spec.id)

    async def fill(self, step: int, plan: StepPlan) -> StepPlan:
        """The step's plan with its pieces' rows drawn (module docstring) and weighted.

        Args:
            step: the global step (diloco: outer step), from 0.
            plan: the strategy's plan of the step.

        Raises:
            JobFailed: the draw failed (FAILED).
        """
        window = self._window
        if window is None or step not in window.spans:
            window = self._window = await self._draw(step)
        offset, size = window.spans[step]
        total = sum(len(p.rows) for p in plan.pieces)
        if total != size:  # the sizes come from the same plan: a bug if they differ
            raise JobFailed(f"sampling: step {step} has {total} rows, its draw {size}")
        pieces = []
        for p in plan.pieces:
            stop = offset + len(p.rows)
            rows, weights = window.rows[offset:stop], window.weights[offset:stop]
            pieces.append(dataclasses.replace(p, rows=rows, weights=weights, shard=-1))
            offset = stop
        return dataclasses.replace(plan, pieces=pieces)

    async def window(self, step: int) -> tuple[int, int, np.ndarray, np.ndarray]:
        """allreduce: the window that contains ``step``, drawn at its first use.

        Args:
            step: a global step, from 0.

        Returns:
            (first step, stop step (exclusive), rows [K] int64, weights [K] float32): the
            global batches of the window's steps in turn.

        Raises:
            JobFailed: the draw failed (FAILED).
        """
        window = self._window
        if window is None or step not in window.spans:
            window = self._window = await self._draw(step)
        return window.first, max(window.spans) + 1, window.rows, window.weights

    async def record_window(self, first: int, losses_by_step: dict[int, np.ndarray]) -> None:
        """allreduce: set the strengths of the window's rows from their losses, step by step.

        Each step in turn adds its losses to the running mean and maps them to strengths
        with it (as ``record`` after each step of sync); the window's rows then go in one
        update (the last occurrence of a row wins). Steps missing from ``losses_by_step``
        keep their rows' strengths.

        Args:
            first: the window's first step (the one ``window`` returned).
            losses_by_step: step -> [G'] float32 unweighted per-sample losses of the step's
                rows, in draw order.

        Raises:
            JobFailed: the priority update failed, or the window is not the current one
                (FAILED).
        """
        window = self._window
        if window is None or window.first != first:
            raise JobFailed(f"sampling: the window of step {first} is not the current one")
        ids, strengths = [], []
        for step in sorted(losses_by_step):
            offset, size = window.spans[step]
            loss = losses_by_step[step]
            if len(loss) != size:
                raise JobFailed(f"sampling: step {step} has {size} rows, {len(loss)} losses")
            self.running.add(loss)
            ids.append(window.rows[offset : offset + size])
            strengths.append(strengths_of_losses(loss, self.running.mean))
        if not ids:
            return
        request_id = f"{self.job_id}/{self._table_id}/s{first}".encode()
        try:
            await self.store.router.update_strengths(
                np.concatenate(ids).astype(np.uint64),
                np.concatenate(strengths),
                request_id,
                table=self.table,
            )
        except _STORE_ERRORS as exc:
            raise JobFailed(f"sampling: updating window {first}'s priorities: {exc}") from None

    async def _draw(self, step: int) -> _Window:
        """Draw the rows of the window that starts at (or contains) ``step``."""
        scheme = self.scheme
        epoch, in_epoch = divmod(step, scheme.per_epoch)
        first = step - in_epoch % self._outer_per_window
        stop = min(first + self._outer_per_window, (epoch + 1) * scheme.per_epoch, scheme.total)
        spans, offset = {}, 0
        plans = {s: scheme.plan(s, [], {}) for s in range(first, stop)}
        for s, p in plans.items():
            size = sum(len(piece.rows) for piece in p.pieces)
            spans[s], offset = (offset, size), offset + size
        inner = plans[first].inner_steps
        t, total = (inner.first, inner.total) if inner is not None else (first, scheme.total)
        sampling = self.spec.sampling
        beta = annealed_beta(sampling.beta, sampling.beta_final, t, total)
        rows, probabilities, size = await self._sample(offset, epoch, first)
        self._digest.update(rows.astype("<i8").tobytes())
        self.drawn += len(rows)
        weights = importance_weights(probabilities, size, beta)
        return _Window(first, spans, rows, weights)

    async def _sample(self, n: int, epoch: int, first: int) -> tuple[np.ndarray, np.ndarray, int]:
        """N rows from the table: (rows [K] int64, P(i) [K] float64, N), in parts if large."""
        rows, probabilities, size = [], [], self.n_train
        limit = self.store.max_sample_batch
        try:
            for chunk, start in enumerate(range(0, n, limit)):
                r = await self.store.sampler.sample(
                    min(limit, n - start),
                    self.spec.sampling.alpha,
                    draw_seed(self.spec.seed, epoch, first, chunk),
                    with_payloads=False,
                    table=self.table,
                )
                rows.append(r.ids.astype(np.int64))
                probabilities.append(r.probabilities)
                size = r.size
        except _STORE_ERRORS as exc:
            raise JobFailed(f"sampling: drawing step {first}'s rows: {exc}") from None
        if not rows:
            return np.empty(0, np.int64), np.empty(0, np.float64), size
        return np.concatenate(rows), np.concatenate(probabilities), size

    async def record(self, step: int, plan: StepPlan, outcome: StepOutcome) -> None:
        """Set the strengths of the step's drawn rows from the losses the workers returned.

        Args:
            step: the global step (diloco: outer step).
            plan: the plan ``fill`` returned.
            outcome: the step's answers (pieces left out keep their rows' strengths).

        Raises:
            JobFailed: the priority update failed (FAILED).
        """
        rows, losses = [], []
        for p in plan.pieces:
            r = outcome.results.get(p.index)
            if r is not None and r.losses is not None:
                rows.append(p.rows)
                losses.append(r.losses)
        if not rows:
            return
        ids, loss = np.concatenate(rows).astype(np.uint64), np.concatenate(losses)
        self.running.add(loss)
        strengths = strengths_of_losses(loss, self.running.mean)
        request_id = f"{self.job_id}/{self._table_id}/s{step}".encode()
        try:
            await self.store.router.update_strengths(ids, strengths, request_id, table=self.table)
        except _STORE_ERRORS as exc:
            raise JobFailed(f"sampling: updating step {step}'s priorities: {exc}") from None

    async def end_epoch(self, epoch: int) -> None:
        """Decay every strength of the table by ``decay_rate`` (once per epoch; 0: nothing).

        Then reads the table's 10-bin strength histogram into ``histogram`` (the job's
        progress and the dashboard show it).

        Raises:
            JobFailed: the decay failed (FAILED).
        """
        rate = self.spec.sampling.decay_rate
        op_id = f"{self.job_id}/{self._table_id}/e{epoch}".encode()
        try:
            if rate > 0:
                await self.store.memory.decay(rate, op_id, self.table)
            q = await self.store.memory.quality(self.table)
        except _STORE_ERRORS as exc:
            raise JobFailed(f"sampling: decaying epoch {epoch}'s priorities: {exc}") from None
        self.histogram = [int(c) for c in q.histogram]

    async def result_fields(self) -> dict[str, Any]:
        """The result's ``sampling``: the draws and the table's strengths at the end.

        ``rows_sha256`` is the SHA-256 of every row this process drew, int64 little-endian in
        draw order (a test compares it with a reference's draws).
        """
        try:
            q = await self.store.memory.quality(self.table)
        except _STORE_ERRORS as exc:
            raise JobFailed(f"sampling: reading the priority table: {exc}") from None
        return {
            "sampling": {
                "name": "prioritized",
                "table": self.table,
                "rows_drawn": self.drawn,
                "rows_sha256": self._digest.hexdigest(),
                "running_mean_loss": self.running.mean,
                "strength": {"count": q.count, "mean": q.mean, "min": q.min, "max": q.max},
            }
        }

    async def close(self) -> None:
        """Drop the job's table (errors are logged by the caller, not raised)."""
        try:
            await self.store.tables.drop(self.table)
        except TableNotFound:
            pass

    def to_doc(self) -> dict[str, Any]:
        """What a checkpoint keeps: the running mean loss."""
        return {"running_loss": self.running.to_doc()}

    def load_doc(self, doc: dict[str, Any] | None) -> None:
        """Restore what ``to_doc`` saved (None: nothing saved)."""
        self.running = RunningLoss.from_doc((doc or {}).get("running_loss"))

    async def _settled(self) -> None:
        """Wait until the published map matches the membership and no slot lacks a copy.

        Raises:
            JobFailed: not within ``settle_timeout_s`` (FAILED).
        """
        try:
            await self.store.rebalancer.wait_settled(self.store.settle_timeout_s)
        except TimeoutError as exc:
            raise JobFailed(f"sampling: {exc}") from None
