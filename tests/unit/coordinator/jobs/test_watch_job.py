"""WatchJob's last event is the terminal state, even when the job ends while the previous
event is in flight (``submit --follow --json`` printed RUNNING for a job that failed at once)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from coordinator.coordinator_servicer import CoordinatorServicer
from coordinator.data_servicer import DataServicer
from coordinator.jobs.jobs import JobState, JobStore
from shared.config import MemoryJobSpec
from shared.proto import common_pb2, coordinator_pb2


async def test_a_job_ending_during_an_event_still_sends_its_terminal_state() -> None:
    jobs = JobStore()
    job = jobs.submit(MemoryJobSpec(kind="memory"))
    await jobs.update(job, state=JobState.RUNNING)
    cluster: Any = SimpleNamespace(jobs=jobs)
    servicer = CoordinatorServicer(cluster, DataServicer(cluster))
    stream: Any = servicer.WatchJob(coordinator_pb2.JobRequest(job_id=job.job_id), None)

    first = await stream.__anext__()
    # The job fails while the RUNNING event is on its way to the client.
    await jobs.update(job, state=JobState.FAILED, error="load: no array 'strengths'")
    rest = [event async for event in stream]

    assert first.job.state == common_pb2.JOB_STATE_RUNNING
    assert [e.job.state for e in rest] == [common_pb2.JOB_STATE_FAILED]
    assert rest[-1].job.error == "load: no array 'strengths'"
