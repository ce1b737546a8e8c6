"""A train job's TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``).

One run directory per job, ``DATA_DIR/tensorboard/JOB_ID/``
(``CoordinatorConfig.tensorboard_dir``), removed with the job's other files by
``job_retention``. Every scalar's step is the job's global step: optimizer steps
applied (diloco: outer steps), so a step's figures, and an epoch's figures at the step that
ended it, line up on one axis. The tags:

- ``train/loss`` (mean training loss of the step's rows, nats) and ``train/lr`` (the rate the
  step applied): every step (allreduce: every progress report of rank 0, a few steps);
- ``epoch/FIELD``: every numeric field of the job's history entry for the epoch
  (``train_loss``, ``test_loss``, ``test_accuracy``, ``lr``, ``samples_per_s``...; the
  ``epoch`` field and allreduce's ``step`` are the axis, not scalars);
- ``workers/NAME/step_ms``, ``compute_ms``, ``transfer_ms``: per worker per step, the
  milliseconds of its calls as the coordinator saw them, of their forward and backward passes,
  and the rest (wall minus compute, as ``LinkStats`` counts it); allreduce: ``step_ms`` of rank
  0, the mean of the steps of each progress report (the ranks step in lockstep).

Writing never holds up a step: the step loop only appends (tag, value, step) to a list;
the board's own thread turns them into events and ``SummaryWriter`` (with its own writer
thread) writes the file, a batch at a time; the file is flushed to disk at an epoch's end
when the last flush is ``EPOCH_FLUSH_S`` or more ago (the first epoch's end always: a short
epoch's flush cost the coordinator about as much CPU as the epoch's evaluation, issue 25),
before each checkpoint, and when the job ends, fails or is cancelled (closed). A writer
that fails (a full disk) is logged and dropped: the job goes on without its event files.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from coordinator.training.step_types import StepOutcome
from shared.logging import get_logger
from shared.private_files import private_dir

log = get_logger(__name__)

# Scalars the step loop buffers before the board's thread writes them: a few steps' worth.
BATCH = 512
# Events ``SummaryWriter`` queues for its writer thread.
MAX_QUEUE = 1000
# The writer thread's own flush interval, seconds: within a long epoch.
FLUSH_S = 60.0
# An epoch's end flushes the file when the last flush is this many seconds ago or more.
EPOCH_FLUSH_S = 5.0
# History fields that are the axis rather than a scalar.
_AXIS_FIELDS = frozenset({"epoch", "step"})


def worker_times(outcome: StepOutcome) -> dict[str, tuple[float, float]]:
    """Per worker, its accepted calls' (wall seconds, compute seconds) in one step, summed."""
    times: dict[str, tuple[float, float]] = {}
    for r in outcome.results.values():
        wall_s, compute_s = times.get(r.worker, (0.0, 0.0))
        times[r.worker] = (wall_s + r.wall_s, compute_s + r.compute_s)
    return times


class TrainBoard:
    """The event files of one train job; every method is a no-op before ``open``.

    ``add_step`` and ``add_epoch`` may be called from different threads (the event loop, a
    job's evaluation thread); ``flush`` and ``close`` block on file I/O, so async code calls
    them through ``asyncio.to_thread``.
    """

    def __init__(self, log_dir: Path, job_id: str) -> None:
        """Nothing is written until ``open``.

        Args:
            log_dir: the job's run directory (``cfg.tensorboard_dir() / job_id``).
            job_id: the job, for logs.
        """
        self.log_dir, self.job_id = log_dir, job_id
        self._writer: SummaryWriter | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._pending: list[tuple[str, float, int]] = []
        self._lock = threading.Lock()
        self._flushed_at = -math.inf  # time.monotonic() of the last flush

    def open(self, resumed_step: int = 0) -> None:
        """Start a new event file in the run directory (blocks: it creates the file).

        Args:
            resumed_step: steps the job had applied when it (re)started from a checkpoint;
                when > 0, TensorBoard drops the events an earlier process wrote after that
                step (``purge_step``), since the job computes those steps again.
        """
        try:
            private_dir(self.log_dir)
            self._writer = SummaryWriter(
                str(self.log_dir),
                purge_step=resumed_step + 1 if resumed_step > 0 else None,
                max_queue=MAX_QUEUE,
                flush_secs=FLUSH_S,
            )
            for path in self.log_dir.iterdir():  # the event file: 0600 whatever the umask
                path.chmod(0o600)
        except OSError as exc:
            self._fail(exc)
            return
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"tensorboard-{self.job_id}")

    def add_step(
        self,
        step: int,
        loss: float,
        lr: float,
        times: Mapping[str, tuple[float, ...]] | None = None,
    ) -> None:
        """Buffer one step's (or progress report's) scalars.

        Args:
            step: global steps applied with this one, from 1.
            loss: mean training loss of its rows, nats.
            lr: the learning rate it applied.
            times: worker -> (wall seconds, compute seconds) of its calls in the step, or
                (wall seconds,) when the compute share is not known.
        """
        scalars = {"train/loss": loss, "train/lr": lr}
        for name, seconds in (times or {}).items():
            scalars[f"workers/{name}/step_ms"] = seconds[0] * 1e3
            if len(seconds) > 1:
                scalars[f"workers/{name}/compute_ms"] = seconds[1] * 1e3
                scalars[f"workers/{name}/transfer_ms"] = max(0.0, seconds[0] - seconds[1]) * 1e3
        self._add(step, scalars)

    def add_epoch(self, step: int, entry: Mapping[str, Any]) -> None:
        """Buffer an epoch's history entry as ``epoch/FIELD`` scalars; maybe flush (blocks).

        The file is flushed when the last flush is ``EPOCH_FLUSH_S`` or more ago.

        Args:
            step: global steps applied at the epoch's end.
            entry: the job's history entry for the epoch; fields that are not numbers, and
                ``epoch`` and ``step``, are left out.
        """
        self._add(
            step,
            {
                f"epoch/{k}": float(v)
                for k, v in entry.items()
                if k not in _AXIS_FIELDS and isinstance(v, int | float) and not isinstance(v, bool)
            },
        )
        if time.monotonic() - self._flushed_at >= EPOCH_FLUSH_S:
            self.flush()

    def flush(self) -> None:
        """Write every buffered scalar and flush the file to disk (blocks until done)."""
        self._flushed_at = time.monotonic()
        thread = self._thread
        if thread is not None:
            try:
                thread.submit(self._write, self._take(), True).result()
            except RuntimeError:  # closed meanwhile (a cancelled job's evaluation thread)
                pass

    def close(self) -> None:
        """Write what is buffered and close the file (blocks); later calls do nothing.

        Called when the job ends, fails or is cancelled.
        """
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.submit(self._write, self._take(), True).result()
        thread.shutdown()
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except OSError as exc:
                log.warning("tensorboard_close_failed", job_id=self.job_id, error=str(exc))

    def _add(self, step: int, scalars: Mapping[str, float]) -> None:
        """Buffer the scalars; hand a full batch to the board's thread."""
        with self._lock:
            if self._thread is None:
                return
            # NaN: not measured yet (no evaluation before the first epoch's end).
            self._pending += [(t, v, step) for t, v in scalars.items() if not math.isnan(v)]
            if len(self._pending) < BATCH:
                return
            batch, self._pending = self._pending, []
            self._thread.submit(self._write, batch, False)

    def _take(self) -> list[tuple[str, float, int]]:
        with self._lock:
            batch, self._pending = self._pending, []
        return batch

    def _write(self, batch: list[tuple[str, float, int]], flush: bool) -> None:
        """On the board's thread: the batch into the writer's queue, then maybe to disk."""
        writer = self._writer
        if writer is None:
            return
        try:
            for tag, value, step in batch:
                writer.add_scalar(tag, value, step)
            if flush:
                writer.flush()
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        """Drop the writer: the job goes on without event files."""
        log.warning("tensorboard_write_failed", job_id=self.job_id, error=str(exc))
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except OSError:
                pass
