"""The job queue and the scheduler that runs it.

A job starts once the workers it asks for are alive, fails after ``queue_timeout_s``
otherwise, and runs to a terminal state.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from coordinator.jobs.jobs import JobFailed, JobNotFound, JobRecord, JobState, JobStore
from coordinator.placement.membership import Membership, WorkerRecord
from shared.logging import get_logger

Runner = Callable[[JobRecord, list[WorkerRecord]], Awaitable[dict[str, Any]]]

log = get_logger(__name__)


class Scheduler:
    """FIFO scheduler; several jobs may run at once on the same workers."""

    def __init__(
        self,
        jobs: JobStore,
        membership: Membership,
        runners: dict[str, Runner],
        queue_timeout_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Schedule ``jobs`` onto ``membership``'s ALIVE workers.

        Args:
            jobs: the queue (``JobStore.queued``) and where state changes go.
            membership: which workers are alive.
            runners: job kind -> coroutine running a job on its workers to a result document.
            queue_timeout_s: seconds a job may wait QUEUED before it fails.
            clock: wall-clock seconds, as ``JobRecord.created_at`` (injected by tests).
        """
        self._jobs = jobs
        self._membership = membership
        self._runners = runners
        self._queue_timeout_s = queue_timeout_s
        self._clock = clock  # wall-clock seconds, as JobRecord.created_at
        self._wake = asyncio.Event()
        self._running: set[asyncio.Task[None]] = set()

    def wake(self) -> None:
        """Re-examine the queue (after a submission or a membership change)."""
        self._wake.set()

    async def run(self) -> None:
        """The scheduling loop; runs until cancelled, then cancels the running jobs."""
        try:
            while True:
                self._wake.clear()
                self.schedule_once()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.25)
                except TimeoutError:
                    pass
        finally:
            for task in list(self._running):
                task.cancel()
            if self._running:
                await asyncio.gather(*self._running, return_exceptions=True)

    def schedule_once(self) -> None:
        """One pass over the queue, in submission order.

        Starts each job whose workers are alive and fails each that has waited longer than
        ``queue_timeout_s``; a job that must wait does not hold back later ones.
        """
        now = self._clock()
        for job in self._jobs.queued():
            wanted = job.spec.workers
            alive = self._membership.alive()
            if len(alive) >= wanted:
                self._start(job, self._pick(alive, wanted))
            elif now - job.created_at > self._queue_timeout_s:
                reason = (
                    f"waited {self._queue_timeout_s:g} s for {wanted} alive workers, "
                    f"{len(alive)} alive"
                )
                asyncio.ensure_future(self._jobs.update(job, state=JobState.FAILED, error=reason))
                log.warning("job_queue_timeout", job_id=job.job_id, reason=reason)

    def _pick(self, alive: list[WorkerRecord], wanted: int) -> list[WorkerRecord]:
        load = Counter(
            w for j in self._jobs.list() if j.state is JobState.RUNNING for w in j.workers
        )
        return sorted(alive, key=lambda w: (load[w.name], w.name))[:wanted]

    def _start(self, job: JobRecord, workers: list[WorkerRecord]) -> None:
        job.workers = [w.name for w in workers]
        job.state = JobState.RUNNING  # synchronously, so the next pass does not start it again
        task = asyncio.create_task(self._run_job(job, workers), name=f"job-{job.job_id}")
        job.task = task
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run_job(self, job: JobRecord, workers: list[WorkerRecord]) -> None:
        # Every log line of this job's task (and the tasks it starts) carries its id.
        structlog.contextvars.bind_contextvars(job_id=job.job_id)
        job.state = JobState.QUEUED  # let update() record the transition and started_at
        await self._jobs.update(job, state=JobState.RUNNING)
        log.info("job_started", job_id=job.job_id, kind=job.kind, workers=job.workers)
        try:
            result = await self._runners[job.kind](job, workers)
        except asyncio.CancelledError:
            await self._jobs.update(job, state=JobState.CANCELLED, error=job.error or "cancelled")
            log.info("job_cancelled", job_id=job.job_id)
            raise
        except JobFailed as exc:
            await self._jobs.update(job, state=JobState.FAILED, error=str(exc))
            log.warning("job_failed", job_id=job.job_id, error=str(exc))
        except Exception as exc:  # a bug or an unexpected worker error: fail the job, keep serving
            msg = f"{type(exc).__name__}: {exc}"
            await self._jobs.update(job, state=JobState.FAILED, error=msg)
            log.exception("job_crashed", job_id=job.job_id, error=msg)
        else:
            await self._jobs.update(job, state=JobState.SUCCEEDED, result=result)
            log.info("job_succeeded", job_id=job.job_id)

    async def cancel(self, job_id: str, reason: str = "cancelled by user") -> JobRecord:
        """Cancel a queued or running job; a finished job is returned unchanged.

        Raises:
            JobNotFound: unknown id (NOT_FOUND).
        """
        job = self._jobs.get(job_id)
        if job.state is JobState.QUEUED:
            await self._jobs.update(job, state=JobState.CANCELLED, error=reason)
        elif job.state is JobState.RUNNING and job.task is not None:
            job.error = reason
            job.task.cancel()
            try:
                await asyncio.shield(job.task)
            except (asyncio.CancelledError, Exception):
                pass
        return job


__all__ = ["JobNotFound", "Scheduler"]
