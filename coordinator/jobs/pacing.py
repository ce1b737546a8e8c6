"""Paced train jobs (spec ``paced: true``): one epoch per grant from the job's owner.

A paced job waits at every epoch boundary, its first included, until the epochs granted
(``RunEpochs``) exceed the epochs it has run, or until its finish is asked for (``FinishJob``):
then it ends SUCCEEDED with the model as trained so far. ``DistributedLearner.run_epoch``
grants one epoch at a time. The grants live in the job's record and in the coordinator's
database (``coordinator.persistence``), so a restarted coordinator resumes the job from its
checkpoint (a paced job checkpoints at every epoch's end) and waits for, or runs, what was
granted. Waiting holds no RPC open to the workers: their sessions stay, their heartbeats and
other jobs go on. A wait has no time limit: the job waits until it is granted, finished or
cancelled (and counts towards ``max_jobs_per_client`` meanwhile).
"""

from __future__ import annotations

from coordinator.jobs.jobs import JobRecord, JobStore
from shared.config import TrainJobSpec


class PacingRefused(RuntimeError):
    """The job cannot take that grant or finish (FAILED_PRECONDITION); the message says why."""


class BadGrant(ValueError):
    """A grant of fewer than one epoch (INVALID_ARGUMENT); the message names ``epochs``."""


def check_paced(job: JobRecord) -> TrainJobSpec:
    """The job's spec, when the job is a paced train job that has not ended.

    Raises:
        PacingRefused: not a train job, not paced, or ended (FAILED_PRECONDITION).
    """
    spec = job.spec
    if not isinstance(spec, TrainJobSpec) or not spec.paced:
        raise PacingRefused(
            f"job {job.job_id!r} is not paced: only a train job submitted with paced: true "
            "runs epochs on demand"
        )
    if job.state.terminal:
        raise PacingRefused(f"job {job.job_id!r} is {job.state.value}: it runs no more epochs")
    return spec


def grant(job: JobRecord, epochs: int) -> int:
    """Grant ``epochs`` more epochs to a paced job; return the epochs granted in all.

    Args:
        job: a paced train job that has not ended.
        epochs: epochs to add, >= 1.

    Raises:
        BadGrant: ``epochs`` < 1 (INVALID_ARGUMENT).
        PacingRefused: not a paced job, ended, its finish asked for, or the grant would pass
            the spec's ``epochs`` (FAILED_PRECONDITION).
    """
    if epochs < 1:
        raise BadGrant(f"epochs: must be at least 1, got {epochs}")
    spec = check_paced(job)
    if job.finish_requested:
        raise PacingRefused(f"job {job.job_id!r} is finishing: it runs no more epochs")
    cap = spec.epochs or 0
    if job.epochs_granted + epochs > cap:
        raise PacingRefused(
            f"epochs: job {job.job_id!r} may run {cap} epochs (its spec's epochs) and "
            f"{job.epochs_granted} are granted already; {epochs} more would pass it"
        )
    job.epochs_granted += epochs
    return job.epochs_granted


async def next_epoch(jobs: JobStore, job: JobRecord, epoch: int) -> bool:
    """Wait until epoch ``epoch`` (from 0) is granted (True) or the finish is asked (False).

    A granted epoch runs even when the finish is asked for after its grant.
    """
    while True:
        seen = job.version
        if job.epochs_granted > epoch:
            return True
        if job.finish_requested:
            return False
        await jobs.wait_change(job, seen)
