"""coordinator/jobs/scheduler.py without a cluster: a job waits QUEUED until the workers it asks
for are alive, fails after ``queue_timeout_s`` with a reason, starts in submission order, and
can be cancelled queued or running. Fake runners; clocks injected; state awaited by polling
with a deadline, never by sleeping a fixed time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from coordinator.jobs.jobs import JobFailed, JobNotFound, JobRecord, JobState, JobStore
from coordinator.jobs.scheduler import Scheduler
from coordinator.placement.membership import Membership, WorkerRecord
from shared.config import MemoryJobSpec

QUEUE_TIMEOUT_S = 5.0


async def eventually(predicate: Callable[[], object], timeout_s: float = 5.0) -> None:
    """Yield to the event loop until ``predicate`` holds, failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the scheduler")
        await asyncio.sleep(0.001)


class FakeRunner:
    """Records each job it is given and holds it until the test releases it."""

    def __init__(self) -> None:
        self.started: list[tuple[str, list[str]]] = []
        self.release = asyncio.Event()
        self.outcome: dict[str, Any] | BaseException = {"ok": True}
        self.cancelled: list[str] = []

    async def __call__(self, job: JobRecord, workers: list[WorkerRecord]) -> dict[str, Any]:
        self.started.append((job.job_id, [w.name for w in workers]))
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(job.job_id)
            raise
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


class WallClock:
    """A wall clock the test sets by hand (seconds since the epoch, as ``created_at``)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def membership() -> Membership:
    return Membership(heartbeat_timeout_s=60.0)


@pytest.fixture
async def setup(
    membership: Membership,
) -> AsyncIterator[tuple[Scheduler, JobStore, FakeRunner, WallClock]]:
    jobs, runner, clock = JobStore(), FakeRunner(), WallClock(1_000.0)
    scheduler = Scheduler(jobs, membership, {"memory": runner}, QUEUE_TIMEOUT_S, clock=clock)
    yield scheduler, jobs, runner, clock
    runner.release.set()
    for job in jobs.list():
        if job.task is not None:
            await asyncio.gather(job.task, return_exceptions=True)


def _submit(jobs: JobStore, workers: int, created_at: float = 1_000.0) -> JobRecord:
    job = jobs.submit(MemoryJobSpec(kind="memory", workers=workers))
    job.created_at = created_at
    return job


async def test_a_job_waits_queued_until_enough_workers_are_alive(
    setup: tuple[Scheduler, JobStore, FakeRunner, WallClock], membership: Membership
) -> None:
    scheduler, jobs, runner, _ = setup
    membership.register("w0", "h:0", "cpu")
    membership.register("w1", "h:1", "cpu")
    membership.set_draining("w1")  # a draining worker does not count
    job = _submit(jobs, workers=2)

    scheduler.schedule_once()
    await asyncio.sleep(0)  # let anything wrongly started take a step
    assert job.state is JobState.QUEUED and runner.started == []

    membership.register("w2", "h:2", "cpu")
    scheduler.schedule_once()

    assert job.state is JobState.RUNNING  # synchronously: the next pass will not start it
    assert job.workers == ["w0", "w2"]
    await eventually(lambda: runner.started)
    assert runner.started == [(job.job_id, ["w0", "w2"])]
    runner.release.set()
    await eventually(lambda: job.state is JobState.SUCCEEDED)
    assert job.result == {"ok": True} and job.error == ""


async def test_a_job_that_waits_past_the_queue_timeout_fails_with_a_reason(
    setup: tuple[Scheduler, JobStore, FakeRunner, WallClock], membership: Membership
) -> None:
    scheduler, jobs, runner, clock = setup
    membership.register("w0", "h:0", "cpu")
    job = _submit(jobs, workers=3, created_at=1_000.0)

    clock.now = 1_000.0 + QUEUE_TIMEOUT_S  # exactly the timeout: still waiting
    scheduler.schedule_once()
    await asyncio.sleep(0)
    assert job.state is JobState.QUEUED

    clock.now += 0.01
    scheduler.schedule_once()

    await eventually(lambda: job.state is JobState.FAILED)
    assert job.error == "waited 5 s for 3 alive workers, 1 alive"
    assert runner.started == []


async def test_jobs_start_in_submission_order_and_spread_over_the_least_loaded_workers(
    setup: tuple[Scheduler, JobStore, FakeRunner, WallClock], membership: Membership
) -> None:
    scheduler, jobs, runner, _ = setup
    membership.register("w1", "h:1", "cpu")
    membership.register("w0", "h:0", "cpu")
    first, second, third = (_submit(jobs, workers=1) for _ in range(3))

    scheduler.schedule_once()

    await eventually(lambda: len(runner.started) == 3)
    assert runner.started == [
        (first.job_id, ["w0"]),
        (second.job_id, ["w1"]),
        (third.job_id, ["w0"]),
    ]


async def test_a_job_that_must_wait_does_not_hold_back_a_later_smaller_one(
    setup: tuple[Scheduler, JobStore, FakeRunner, WallClock], membership: Membership
) -> None:
    scheduler, jobs, runner, _ = setup
    membership.register("w0", "h:0", "cpu")
    big, small = _submit(jobs, workers=2), _submit(jobs, workers=1)

    scheduler.schedule_once()

    await eventually(lambda: runner.started)
    assert (big.state, small.state) == (JobState.QUEUED, JobState.RUNNING)
    assert runner.started == [(small.job_id, ["w0"])]


async def test_cancelling_a_queued_job_means_it_never_starts(
    setup: tuple[Scheduler, JobStore, FakeRunner, WallClock], membership: Membership
) -> None:
    scheduler, jobs, runner, _ = setup
    job = _submit(jobs, workers=1)

    await scheduler.cancel(job.job_id, reason="not needed")
    membership.register("w0", "h:0", "cpu")
    scheduler.schedule_once()
    await asyncio.sleep(0)

    assert (job.state, job.error) == (JobState.CANCELLED, "not needed")
    assert runner.started == []


async def test_cancelling_a_running_job_cancels_its_runner(
    setup: tuple[Scheduler, JobStore, FakeRunner, WallClock], membership: Membership
) -> None:
    scheduler, jobs, runner, _ = setup
    membership.register("w0", "h:0", "cpu")
    job = _submit(jobs, workers=1)
    scheduler.schedule_once()
    await eventually(lambda: runner.started)

    returned = await scheduler.cancel(job.job_id)

    assert returned is job
    assert (job.state, job.error) == (JobState.CANCELLED, "cancelled by user")
    assert runner.cancelled == [job.job_id]
    assert job.finished_at > 0


async def test_cancelling_a_finished_job_leaves_it_as_it_was(
    setup: tuple[Scheduler, JobStore, FakeRunner, WallClock], membership: Membership
) -> None:
    scheduler, jobs, runner, _ = setup
    membership.register("w0", "h:0", "cpu")
    job = _submit(jobs, workers=1)
    runner.release.set()
    scheduler.schedule_once()
    await eventually(lambda: job.state is JobState.SUCCEEDED)

    await scheduler.cancel(job.job_id)

    assert (job.state, job.error) == (JobState.SUCCEEDED, "")


async def test_cancelling_an_unknown_job_is_not_found(
    setup: tuple[Scheduler, JobStore, FakeRunner, WallClock],
) -> None:
    scheduler, _, _, _ = setup

    with pytest.raises(JobNotFound):
        await scheduler.cancel("memory-00000000")


@pytest.mark.parametrize(
    ("outcome", "error"),
    [
        (JobFailed("load: no array 'ids'"), "load: no array 'ids'"),
        (ValueError("boom"), "ValueError: boom"),  # a bug fails the job, not the scheduler
    ],
)
async def test_a_runner_that_raises_fails_its_job_with_the_reason(
    setup: tuple[Scheduler, JobStore, FakeRunner, WallClock],
    membership: Membership,
    outcome: BaseException,
    error: str,
) -> None:
    scheduler, jobs, runner, _ = setup
    membership.register("w0", "h:0", "cpu")
    runner.outcome = outcome
    runner.release.set()
    job = _submit(jobs, workers=1)

    scheduler.schedule_once()

    await eventually(lambda: job.state.terminal)
    assert (job.state, job.error, job.result) == (JobState.FAILED, error, None)


async def test_stopping_the_scheduling_loop_cancels_the_running_jobs(
    setup: tuple[Scheduler, JobStore, FakeRunner, WallClock], membership: Membership
) -> None:
    scheduler, jobs, runner, _ = setup
    membership.register("w0", "h:0", "cpu")
    job = _submit(jobs, workers=1)
    loop_task = asyncio.create_task(scheduler.run())
    scheduler.wake()
    await eventually(lambda: runner.started)

    loop_task.cancel()
    await asyncio.gather(loop_task, return_exceptions=True)

    assert job.state is JobState.CANCELLED
    assert runner.cancelled == [job.job_id]
