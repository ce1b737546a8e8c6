"""Paced jobs: grants are counted, refused past the spec's epochs or once finishing, kept
across a restart; the wait at a boundary ends on a grant or a finish."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from coordinator.jobs.jobs import JobRecord, JobState, JobStore
from coordinator.jobs.pacing import BadGrant, PacingRefused, grant, next_epoch
from coordinator.persistence import StateStore
from shared.config import TrainJobSpec


def _paced(jobs: JobStore, epochs: int = 3) -> JobRecord:
    return jobs.submit(TrainJobSpec(kind="train", epochs=epochs, paced=True))


def test_grants_add_up_to_the_specs_epochs_and_no_further() -> None:
    job = _paced(JobStore())

    assert grant(job, 1) == 1
    assert grant(job, 2) == 3
    with pytest.raises(PacingRefused, match=r"^epochs: job .* may run 3 epochs"):
        grant(job, 1)
    assert job.epochs_granted == 3


@pytest.mark.parametrize(
    ("setup", "error", "message"),
    [
        (lambda j: None, BadGrant, "epochs: must be at least 1, got 0"),
        (lambda j: setattr(j, "finish_requested", True), PacingRefused, "is finishing"),
        (lambda j: setattr(j, "state", JobState.SUCCEEDED), PacingRefused, "is SUCCEEDED"),
    ],
)
def test_refused_grants_change_nothing(setup, error, message) -> None:
    job = _paced(JobStore())
    setup(job)
    with pytest.raises(error, match=message):
        grant(job, 0 if error is BadGrant else 1)
    assert job.epochs_granted == 0


def test_a_plain_job_takes_no_grant() -> None:
    job = JobStore().submit(TrainJobSpec(kind="train", epochs=3))
    with pytest.raises(PacingRefused, match="is not paced"):
        grant(job, 1)


def test_paced_with_steps_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="paced: a paced job runs whole epochs"):
        TrainJobSpec(kind="train", steps=10, paced=True)


async def test_the_wait_ends_on_a_grant_or_a_finish() -> None:
    jobs = JobStore()
    job = _paced(jobs)
    waiting = asyncio.create_task(next_epoch(jobs, job, 0))
    await asyncio.sleep(0)
    assert not waiting.done()

    grant(job, 1)
    await jobs.update(job)
    assert await asyncio.wait_for(waiting, 5) is True

    waiting = asyncio.create_task(next_epoch(jobs, job, 1))
    await asyncio.sleep(0)
    job.finish_requested = True
    await jobs.update(job)
    assert await asyncio.wait_for(waiting, 5) is False
    # an epoch granted before the finish still runs
    assert await next_epoch(jobs, job, 0) is True


def test_grants_survive_a_restart(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    jobs = JobStore()
    job = _paced(jobs)
    store.save_job(job)
    store.save_pacing(job.job_id, 2, True)
    store.close()

    (loaded,) = StateStore(tmp_path).load_jobs()

    assert (loaded.epochs_granted, loaded.finish_requested) == (2, True)
