"""Job records, their state machine, and progress events for watchers.

States: QUEUED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED. Watchers wait on a per-job
condition and always see the latest state and progress (slow watchers get coalesced events,
never a stale terminal state).
"""

from __future__ import annotations

import asyncio
import builtins
import itertools
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from shared.config import JobSpec


class JobState(StrEnum):
    """Where a job is in its life: QUEUED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED."""

    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        """True for SUCCEEDED, FAILED and CANCELLED: the state is final."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class JobNotFound(KeyError):
    """No job with that id (NOT_FOUND)."""


class JobFailed(RuntimeError):
    """A job cannot go on; the message is the user-facing reason."""


class JobQuotaExceeded(RuntimeError):
    """The submitter has ``max_jobs_per_client`` unfinished jobs (RESOURCE_EXHAUSTED)."""


@dataclass
class JobRecord:
    """One job: its spec, state, result and progress, and what watchers wait on.

    Attributes:
        job_id: ``<kind>-<8 hex digits>``.
        spec: the admitted spec.
        state: where the job is in its life.
        result: the runner's result document once SUCCEEDED.
        error: why it FAILED or was CANCELLED ("" otherwise).
        created_at: wall-clock seconds of the submission.
        started_at: wall-clock seconds it started RUNNING (0 before).
        finished_at: wall-clock seconds it reached a terminal state (0 before).
        workers: names of the workers it was started on.
        progress: the latest progress event (step, loss, ... or iteration stats).
        version: bumped on every change; watchers wait for it to grow.
        changed: notified on every change.
        task: the asyncio task running it, while it runs in this process.
        seq: submission order, unique per coordinator (survives restarts).
        owner: the submitting token's subject ("" without auth).
        epochs_granted: a paced train job's epochs its owner granted so far
            (``coordinator.jobs.pacing``); 0 for others.
        finish_requested: a paced job is to end SUCCEEDED at its next epoch boundary.
    """

    job_id: str
    spec: JobSpec
    state: JobState = JobState.QUEUED
    result: dict[str, Any] | None = None
    error: str = ""
    created_at: float = field(default_factory=time.time)
    started_at: float = 0.0
    finished_at: float = 0.0
    workers: list[str] = field(default_factory=list)
    progress: dict[str, Any] = field(default_factory=dict)
    version: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition, repr=False)
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    seq: int = 0
    owner: str = ""  # the submitting token's subject ("" without auth)
    epochs_granted: int = 0
    finish_requested: bool = False

    @property
    def kind(self) -> str:
        """``train`` or ``memory``."""
        return self.spec.kind

    @property
    def spec_json(self) -> str:
        """The spec as JSON, with its keys as users write them."""
        return self.spec.model_dump_json(by_alias=True)


class JobStore:
    """All jobs of this coordinator, in submission order."""

    def __init__(self) -> None:
        """An empty store; set ``on_change`` to persist every change."""
        self._jobs: dict[str, JobRecord] = {}
        self._counter = itertools.count(1)
        self.on_change: Callable[[JobRecord], None] | None = None  # persistence hook
        self.on_state: Callable[[JobRecord], None] | None = None  # each state change (events)

    def restore(self, jobs: builtins.list[JobRecord]) -> None:
        """Re-insert jobs loaded from disk (after a coordinator restart)."""
        for job in jobs:
            self._jobs[job.job_id] = job
        self._counter = itertools.count(max((j.seq for j in jobs), default=0) + 1)

    def submit(self, spec: JobSpec, owner: str = "") -> JobRecord:
        """Queue a validated spec for ``owner``; return its record (state QUEUED)."""
        job_id = f"{spec.kind}-{uuid.uuid4().hex[:8]}"
        rec = JobRecord(job_id=job_id, spec=spec, seq=next(self._counter), owner=owner)
        self._jobs[job_id] = rec
        if self.on_change is not None:
            self.on_change(rec)
        return rec

    def get(self, job_id: str) -> JobRecord:
        """Raises: JobNotFound (NOT_FOUND)."""
        try:
            return self._jobs[job_id]
        except KeyError:
            raise JobNotFound(f"no job with id {job_id!r}") from None

    def list(self) -> builtins.list[JobRecord]:
        """Every job, in submission order."""
        return sorted(self._jobs.values(), key=lambda j: j.seq)

    def prune(
        self, max_jobs: int, max_age_s: float, now: float | None = None
    ) -> builtins.list[str]:
        """Drop old finished jobs; return the ids dropped.

        Dropped: finished jobs older than ``max_age_s`` and the oldest finished ones beyond
        ``max_jobs``. Queued and running jobs are never dropped.

        Args:
            max_jobs: finished jobs to keep at most.
            max_age_s: seconds since a job finished after which it is dropped.
            now: wall-clock seconds; None for ``time.time()``.
        """
        now = time.time() if now is None else now
        finished = sorted(
            (j for j in self._jobs.values() if j.state.terminal), key=lambda j: j.finished_at
        )
        excess = max(0, len(finished) - max_jobs)
        dropped = [
            j.job_id
            for i, j in enumerate(finished)
            if i < excess or now - j.finished_at > max_age_s
        ]
        for job_id in dropped:
            del self._jobs[job_id]
        return dropped

    def active(self, owner: str) -> int:
        """Queued plus running jobs of ``owner``."""
        return sum(1 for j in self._jobs.values() if j.owner == owner and not j.state.terminal)

    def queued(self) -> builtins.list[JobRecord]:
        """QUEUED jobs, in submission order."""
        return [j for j in self.list() if j.state is JobState.QUEUED]

    def counts(self) -> dict[str, int]:
        """Number of jobs per state (every state present, zeros included)."""
        out = {s.value: 0 for s in JobState}
        for j in self._jobs.values():
            out[j.state.value] += 1
        return out

    async def update(
        self,
        job: JobRecord,
        *,
        state: JobState | None = None,
        progress: dict[str, Any] | None = None,
        result: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        """Change a job and wake its watchers. A terminal state is final."""
        if job.state.terminal and state is not None:
            return
        if state is JobState.RUNNING:
            job.started_at = time.time()
        elif state is not None and state.terminal:
            job.finished_at = time.time()
        if state is not None and state is not job.state:
            job.state = state
            if self.on_state is not None:
                self.on_state(job)
        if progress is not None:
            job.progress = progress
        if result is not None:
            job.result = result
        if error is not None:
            job.error = error
        job.version += 1
        if self.on_change is not None and (state or result is not None or error is not None):
            self.on_change(job)
        async with job.changed:
            job.changed.notify_all()

    async def wait_change(self, job: JobRecord, seen_version: int) -> None:
        """Block until the job's version exceeds ``seen_version``."""
        async with job.changed:
            await job.changed.wait_for(lambda: job.version > seen_version)


def progress_json(job: JobRecord) -> str:
    """The job's latest progress as JSON."""
    return json.dumps(job.progress)
