"""The ``neuroshard.v1.Coordinator`` service: validates, calls ``Cluster``, maps errors."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc
from grpc import aio

from coordinator.cluster import Cluster
from coordinator.jobs import JobNotFound, JobRecord
from coordinator.membership import WorkerState
from shared.config import ConfigError
from shared.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc

_WORKER_STATE = {
    WorkerState.ALIVE: common_pb2.WORKER_STATE_ALIVE,
    WorkerState.DEAD: common_pb2.WORKER_STATE_DEAD,
    WorkerState.DRAINING: common_pb2.WORKER_STATE_DRAINING,
}


def job_to_pb(job: JobRecord) -> coordinator_pb2.Job:
    """Convert a job record to its wire form."""
    return coordinator_pb2.Job(
        job_id=job.job_id,
        kind=job.kind,
        state=common_pb2.JobState.Value(f"JOB_STATE_{job.state.value}"),
        spec_json=job.spec_json,
        result_json=json.dumps(job.result) if job.result is not None else "",
        error=job.error,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        workers=job.workers,
    )


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Thin RPC layer over ``Cluster``."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster

    async def RegisterWorker(
        self, request: coordinator_pb2.RegisterWorkerRequest, context: aio.ServicerContext
    ) -> coordinator_pb2.RegisterWorkerResponse:
        """Register (or re-register) a worker. INVALID_ARGUMENT: empty name or address."""
        if not request.name or not request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name and address are required")
        self._cluster.register_worker(request.name, request.address, request.device or "cpu")
        return coordinator_pb2.RegisterWorkerResponse(
            heartbeat_interval_s=self._cluster.cfg.heartbeat_interval_s
        )

    async def Heartbeat(
        self, request: coordinator_pb2.HeartbeatRequest, context: aio.ServicerContext
    ) -> coordinator_pb2.HeartbeatResponse:
        """Record a heartbeat; ``registered=false`` asks the worker to register again."""
        known = self._cluster.heartbeat(request.name, request.memories)
        return coordinator_pb2.HeartbeatResponse(registered=known)

    async def GetClusterStatus(
        self, request: coordinator_pb2.GetClusterStatusRequest, context: aio.ServicerContext
    ) -> coordinator_pb2.ClusterStatus:
        """Workers with their state, and job counts by state."""
        c = self._cluster
        workers = [
            common_pb2.WorkerInfo(
                name=w.name,
                address=w.address,
                state=_WORKER_STATE[w.state],
                device=w.device,
                heartbeat_age_s=c.membership.heartbeat_age_s(w),
                memories=w.memories,
            )
            for w in c.membership.all()
        ]
        return coordinator_pb2.ClusterStatus(workers=workers, jobs_by_state=c.jobs.counts())

    async def SubmitJob(
        self, request: coordinator_pb2.SubmitJobRequest, context: aio.ServicerContext
    ) -> coordinator_pb2.Job:
        """Validate and queue a job. INVALID_ARGUMENT names the offending field."""
        try:
            job = self._cluster.submit(request.spec_json)
        except ConfigError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return job_to_pb(job)

    async def GetJob(
        self, request: coordinator_pb2.JobRequest, context: aio.ServicerContext
    ) -> coordinator_pb2.Job:
        """One job. NOT_FOUND: unknown id."""
        return job_to_pb(await self._job(request.job_id, context))

    async def ListJobs(
        self, request: coordinator_pb2.ListJobsRequest, context: aio.ServicerContext
    ) -> coordinator_pb2.ListJobsResponse:
        """All jobs in submission order."""
        return coordinator_pb2.ListJobsResponse(
            jobs=[job_to_pb(j) for j in self._cluster.jobs.list()]
        )

    async def CancelJob(
        self, request: coordinator_pb2.JobRequest, context: aio.ServicerContext
    ) -> coordinator_pb2.Job:
        """Cancel a queued or running job (a finished one is returned as is). NOT_FOUND."""
        await self._job(request.job_id, context)
        job = await self._cluster.scheduler.cancel(request.job_id)
        return job_to_pb(job)

    async def WatchJob(
        self, request: coordinator_pb2.JobRequest, context: aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.JobEvent]:
        """Stream the job's state and progress until it reaches a terminal state. NOT_FOUND."""
        job = await self._job(request.job_id, context)
        seen = -1
        while True:
            if job.version == seen:
                await self._cluster.jobs.wait_change(job, seen)
            seen = job.version
            yield coordinator_pb2.JobEvent(
                job=job_to_pb(job), progress_json=json.dumps(job.progress)
            )
            if job.state.terminal:
                return

    async def _job(self, job_id: str, context: aio.ServicerContext) -> JobRecord:
        try:
            return self._cluster.jobs.get(job_id)
        except JobNotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
            raise  # unreachable: abort raises
