"""The ``neuroshard.v1.Coordinator`` service: validates, calls ``Cluster``, maps errors.

Composed from parts by delegation, as the worker's service is (``worker.worker_servicer``'s
docstring says why): the one servicer registered holds its parts (here ``DataServicer``, the
data set RPCs) and hands each of their RPCs to its part in a one-line method; its own RPCs
(membership, jobs, bulk memory) it serves itself. Domain errors map to status codes through
one table, ``_ERRORS`` (``shared.rpc.status_table``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc import aio

from coordinator.cluster import Cluster
from coordinator.data_servicer import DataServicer
from coordinator.forget import WorkerNotDead, WorkerUnknown, forget_worker
from coordinator.jobs.admission import LimitExceeded
from coordinator.jobs.jobs import JobNotFound, JobQuotaExceeded, JobRecord
from coordinator.jobs.pacing import BadGrant, PacingRefused
from coordinator.memory.memory_ops import BulkOpError
from coordinator.memory.sampling import SampleRefused
from coordinator.memory.store_export import ExportsBusy, ExportUnavailable, StoreExport
from coordinator.memory.tables import TableExists
from coordinator.placement.failure_detector import NotSlotPrimary, TooManyReports
from coordinator.placement.membership import WorkerState
from coordinator.placement.readmission import ReadmissionRefused
from coordinator.training.saved_models import ModelMissing, model_chunks, model_file, saved_model
from shared.client.memory import RoutingError
from shared.config import ConfigError
from shared.memory.sampling import new_seed, validate_sample
from shared.memory.stats import quality_to_pb
from shared.memory.tables import DEFAULT_TABLE, TableNotFound
from shared.memory.validation import (
    MemoryInputError,
    as_slots,
    validate_k,
    validate_op_id,
    validate_rate,
    validate_request_id,
    validate_upsert,
)
from shared.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from shared.rpc.codec import f32_from_bytes, f32_to_bytes, ids_from_bytes, ids_to_bytes
from shared.rpc.limits import BudgetExceeded
from shared.rpc.status_table import BadRequest, Status, StatusTable
from shared.security.auth import AddressRefused, address_error, current_principal, may_see_job
from shared.security.confinement import PathRefused
from shared.security.tokens import DataTokenRefused, Principal
from shared.training.entry_points import EntryPointRefused

# Mints a data-plane token for a caller: (token, expiry in Unix seconds).
DataTokenMinter = Callable[[Principal], tuple[str, float]]


class InsertFailed(Exception):
    """A capped insert's write or eviction failed at a worker: with that worker's status.

    A refusal such as INVALID_ARGUMENT, or UNAVAILABLE: retry with the same request id.
    """

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        """Carry the worker's ``code``."""
        super().__init__(message)
        self.code = code


DEFAULT_SAMPLE_TIMEOUT_S = 30.0  # how long a Sample's min_size waits when not told

# Domain errors of the coordinator's RPCs and the status each maps to.
_ERRORS = StatusTable(
    [
        (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),
        (MemoryInputError, grpc.StatusCode.INVALID_ARGUMENT),
        (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
        (PathRefused, grpc.StatusCode.INVALID_ARGUMENT),
        (AddressRefused, grpc.StatusCode.PERMISSION_DENIED),
        (EntryPointRefused, grpc.StatusCode.PERMISSION_DENIED),
        (DataTokenRefused, grpc.StatusCode.UNAUTHENTICATED),
        # A DEAD worker held down: when to retry, also as gRPC's retry pushback.
        (ReadmissionRefused, lambda e: Status(grpc.StatusCode.UNAVAILABLE, e.pushback())),
        (NotSlotPrimary, grpc.StatusCode.FAILED_PRECONDITION),
        (TooManyReports, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (BulkOpError, grpc.StatusCode.UNAVAILABLE),
        (TableNotFound, grpc.StatusCode.NOT_FOUND),
        (SampleRefused, grpc.StatusCode.FAILED_PRECONDITION),
        (BudgetExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (ExportUnavailable, grpc.StatusCode.UNAVAILABLE),
        (ExportsBusy, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (JobQuotaExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (LimitExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (JobNotFound, grpc.StatusCode.NOT_FOUND),
        (BadGrant, grpc.StatusCode.INVALID_ARGUMENT),
        (PacingRefused, grpc.StatusCode.FAILED_PRECONDITION),
        (ModelMissing, grpc.StatusCode.NOT_FOUND),
        (WorkerUnknown, grpc.StatusCode.NOT_FOUND),
        (WorkerNotDead, grpc.StatusCode.FAILED_PRECONDITION),
        (TableExists, grpc.StatusCode.ALREADY_EXISTS),
        (InsertFailed, lambda e: Status(e.code)),
    ]
)

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
    """Thin RPC layer over ``Cluster``; the data set RPCs are handed to ``DataServicer``."""

    def __init__(
        self,
        cluster: Cluster,
        data: DataServicer,
        data_tokens: DataTokenMinter | None = None,
    ) -> None:
        """Serve ``cluster``'s state and decisions, and ``data``'s RPCs.

        Args:
            cluster: the coordinator's state.
            data: the data set RPCs (PutDataset, ListDatasets, FetchShard).
            data_tokens: mints the data-plane tokens GetSlotMap hands to callers with a
                token (``DaemonSecurity.data_token_minter``); None without auth.
        """
        self._cluster = cluster
        self.data = data
        self._data_tokens = data_tokens
        self._exports = 0  # ExportMemories streams running (max_concurrent_exports)

    # -- data sets ------------------------------------------------------------------------------

    async def PutDataset(
        self,
        request_iterator: AsyncIterator[coordinator_pb2.DatasetChunk],
        context: aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[coordinator_pb2.DatasetReply]:
        """See ``DataServicer.PutDataset``."""
        # An async generator itself: grpc.aio streams replies from async generator functions.
        async for reply in self.data.PutDataset(request_iterator, context):
            yield reply

    async def ListDatasets(
        self, request: coordinator_pb2.ListDatasetsRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.ListDatasetsResponse:
        """See ``DataServicer.ListDatasets``."""
        return await self.data.ListDatasets(request, context)

    async def FetchShard(
        self, request: coordinator_pb2.FetchShardRequest, context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[coordinator_pb2.ShardChunk]:
        """See ``DataServicer.FetchShard``."""
        async for chunk in self.data.FetchShard(request, context):  # see PutDataset
            yield chunk

    # -- membership, memory, jobs ---------------------------------------------------------------

    async def RegisterWorker(
        self, request: coordinator_pb2.RegisterWorkerRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.RegisterWorkerResponse:
        """Register (or re-register) a worker; the reply carries the slot count and limits.

        A worker declared DEAD is admitted again only after its hold-down and once the
        coordinator reaches its address (``coordinator.placement.readmission``).

        Raises:
            grpc.aio.AbortError: INVALID_ARGUMENT for an empty name or address;
                PERMISSION_DENIED for an address whose host the worker's certificate does
                not name (the name itself is bound to the certificate by the interceptor);
                UNAVAILABLE for a DEAD worker held down or unreachable, saying why and
                when to retry (also as ``grpc-retry-pushback-ms``).
        """
        async with _ERRORS.mapped(context):
            if not request.name or not request.address:
                raise BadRequest("name and address are required")
            refused = address_error(current_principal(), request.address)
            if refused is not None:
                raise AddressRefused(refused)
            await self._cluster.readmission.check(request.name, request.address)
        self._cluster.register_worker(
            request.name,
            request.address,
            request.device or "cpu",
            request.incarnation,
            request.train_device or "cpu",
        )
        # Only the slot count: the map itself is pushed by the rebalancer once this worker's
        # data (or lack of it) is accounted for.
        return coordinator_pb2.RegisterWorkerResponse(
            heartbeat_interval_s=self._cluster.cfg.heartbeat_interval_s,
            slot_map=self._cluster.rebalancer.wire_map(placement=False),
        )

    async def Heartbeat(
        self, request: coordinator_pb2.HeartbeatRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.HeartbeatResponse:
        """Record a heartbeat; ``registered=false`` asks the worker to register again."""
        held = dict(zip(request.held_slots, request.held_memories, strict=False))
        known = self._cluster.heartbeat(
            request.name, request.memories, request.slot_map_epoch, held
        )
        return coordinator_pb2.HeartbeatResponse(
            registered=known, slot_map_epoch=self._cluster.rebalancer.current.epoch
        )

    async def GetClusterStatus(
        self,
        request: coordinator_pb2.GetClusterStatusRequest,
        context: aio.ServicerContext[Any, Any],
    ) -> coordinator_pb2.ClusterStatus:
        """Workers with their state, and job counts by state."""
        c = self._cluster
        slots = c.slot_summary()
        workers = [
            common_pb2.WorkerInfo(
                name=w.name,
                address=w.address,
                state=_WORKER_STATE[w.state],
                device=w.device,
                train_device=w.train_device,
                heartbeat_age_s=c.membership.heartbeat_age_s(w),
                readmit_holddown_s=c.membership.readmit_wait_s(w.name),
                memories=w.memories,
                slots_primary=slots["per_worker"].get(w.name, (0, 0))[0],
                slots_replica=slots["per_worker"].get(w.name, (0, 0))[1],
                **c.link_figures(w.name),
            )
            for w in c.membership.all()
        ]
        return coordinator_pb2.ClusterStatus(
            workers=workers,
            jobs_by_state=c.jobs.counts(),
            slots=slots["slots"],
            replication_factor=slots["replication_factor"],
            under_replicated_slots=slots["under_replicated_slots"],
            slot_map_epoch=slots["epoch"],
            memories=sum(w.memories for w in c.membership.alive()),
        )

    async def GetSlotMap(
        self, request: coordinator_pb2.GetSlotMapRequest, context: aio.ServicerContext[Any, Any]
    ) -> common_pb2.SlotMap:
        """The current slot map with worker addresses (clients route with it).

        With auth on, a caller with a token also gets a data-plane token for its keyed
        calls to workers (``SlotMap.data_token``): its subject, role reader or writer,
        audience ``neuroshard-data``, ``auth.data_token_ttl_s`` at most.
        """
        slot_map = self._cluster.rebalancer.wire_map()
        principal = current_principal()
        if self._data_tokens is not None and principal is not None and not principal.is_daemon:
            async with _ERRORS.mapped(context):
                slot_map.data_token, slot_map.data_token_expires_at = self._data_tokens(principal)
        return slot_map

    async def ReportFailure(
        self, request: coordinator_pb2.ReportFailureRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.ReportFailureResponse:
        """A primary reports a replica it could not update, or a client a worker it could not reach.

        From a primary (a ``reporter`` named, and a worker certificate when auth is on) the
        replica's copies of the reported slots stop being trusted and it is probed. From a
        client (no ``reporter``, or a reader, writer or admin token) the worker is only
        probed, and DEAD only if it has also missed a heartbeat
        (``FailureDetector.suspect``); clients' reports are rate-limited per caller.

        Raises:
            grpc.aio.AbortError: FAILED_PRECONDITION when the reporter is not the primary of
                every reported slot; INVALID_ARGUMENT for a slot out of range, or a client's
                report without a worker; RESOURCE_EXHAUSTED for a client's report over
                ``report_rate_per_s``.
        """
        principal = current_principal()
        async with _ERRORS.mapped(context):
            if not request.reporter or (principal is not None and principal.role != "worker"):
                if not request.worker:
                    raise BadRequest("worker: empty")
                subject = principal.subject if principal is not None else context.peer()
                if not self._cluster.reports.allow(subject):
                    raise TooManyReports(
                        f"ReportFailure: more than report_rate_per_s "
                        f"{self._cluster.cfg.report_rate_per_s} reports a second from {subject!r}"
                    )
                self._cluster.failures.suspect(request.worker, request.reason)
                return coordinator_pb2.ReportFailureResponse()
            slots = as_slots(list(request.slots), self._cluster.cfg.slots).tolist()
            self._cluster.report_failure(request.reporter, request.worker, request.reason, slots)
        return coordinator_pb2.ReportFailureResponse()

    async def DrainWorker(
        self, request: coordinator_pb2.DrainWorkerRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.DrainWorkerResponse:
        """Hand a worker's slots to the others; ``drained`` once it holds none.

        Raises:
            grpc.aio.AbortError: NOT_FOUND for an unknown worker.
        """
        async with _ERRORS.mapped(context):
            drained = self._cluster.drain(request.name)
        return coordinator_pb2.DrainWorkerResponse(drained=drained)

    async def Decay(
        self, request: coordinator_pb2.DecayRequest, context: aio.ServicerContext[Any, Any]
    ) -> common_pb2.DecayResponse:
        """Decay every memory once: ``s = clip(s - rate, 0, 1)``.

        A request repeating an ``op_id`` (a retry) completes that decay where it is missing
        and applies it nowhere twice.

        Raises:
            grpc.aio.AbortError: INVALID_ARGUMENT for a rate outside [0, 1] or not finite, or
                an op_id over 64 bytes; UNAVAILABLE when a primary still failed after retries.
        """
        async with _ERRORS.mapped(context):
            rate = float(validate_rate(request.rate))
            op_id = validate_op_id(request.op_id)
            table = self._wire_table(request.table)
            n = await self._cluster.memory.decay(rate, op_id, table)
        return common_pb2.DecayResponse(memories=n)

    async def Quality(
        self, request: coordinator_pb2.QualityRequest, context: aio.ServicerContext[Any, Any]
    ) -> common_pb2.QualityStats:
        """Count, sum, mean, min, max and 10-bin histogram of all strengths.

        Raises:
            grpc.aio.AbortError: NOT_FOUND naming an unknown table; UNAVAILABLE when a
                primary failed.
        """
        async with _ERRORS.mapped(context):
            table = self._wire_table(request.table)
            q = await self._cluster.memory.quality(table)
        return quality_to_pb(q)

    async def TopK(
        self, request: coordinator_pb2.TopKRequest, context: aio.ServicerContext[Any, Any]
    ) -> common_pb2.TopKResponse:
        """The exact global top-k by strength (ties: smaller id).

        Raises:
            grpc.aio.AbortError: INVALID_ARGUMENT for k <= 0 or above ``topk_max``;
                UNAVAILABLE when a primary failed.
        """
        async with _ERRORS.mapped(context):
            k = validate_k(request.k, self._cluster.cfg.topk_max)
            table = self._wire_table(request.table)
            ids, strengths = await self._cluster.memory.topk(k, table)
        return common_pb2.TopKResponse(ids=ids_to_bytes(ids), strengths=f32_to_bytes(strengths))

    async def Sample(
        self, request: coordinator_pb2.SampleRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.SampleResponse:
        """Draw n memories with replacement, P(i) = w_i / W, exact over the whole table.

        Seeded draws are a function of the seed, alpha and the table's content
        (docs/architecture.md, "Sampling"); without a seed one is drawn and answered.

        Raises:
            grpc.aio.AbortError: NOT_FOUND for an unknown table;
                INVALID_ARGUMENT for n <= 0 or above ``max_sample_batch``, alpha negative or
                not finite, without_replacement, or a negative timeout_s;
                FAILED_PRECONDITION for an empty table without min_size, or min_size not
                reached in timeout_s (names the size); RESOURCE_EXHAUSTED for a reply over
                the message limit; UNAVAILABLE when a primary still failed after retries.
        """
        async with _ERRORS.mapped(context):
            table = self._cluster.tables.check(request.table)
            alpha = validate_sample(
                request.n,
                request.alpha,
                self._cluster.cfg.max_sample_batch,
                replacement=not request.without_replacement,
            )
            if not request.timeout_s >= 0:
                raise BadRequest(f"timeout_s: {request.timeout_s!r} must be >= 0")
            r = await self._cluster.sampler.sample(
                request.n,
                alpha,
                request.seed if request.has_seed else new_seed(),
                min_size=request.min_size,
                timeout_s=request.timeout_s or DEFAULT_SAMPLE_TIMEOUT_S,
                with_payloads=not request.without_payloads,
                table=table,
            )
            size = 24 * len(r.ids) + sum(len(p) + 6 for p in r.payloads) + 64
            if size > self._cluster.cfg.max_message_bytes:
                raise BudgetExceeded(
                    f"Sample reply of {len(r.ids)} draws would be {size} bytes, over "
                    f"max_message_bytes {self._cluster.cfg.max_message_bytes}; ask for fewer"
                )
        return coordinator_pb2.SampleResponse(
            ids=ids_to_bytes(r.ids),
            strengths=f32_to_bytes(r.strengths),
            payloads=r.payloads if not request.without_payloads else [],
            probabilities=r.probabilities.astype("<f8").tobytes(),
            seed=r.seed,
            size=r.size,
            total_weight=r.total_weight,
        )

    async def Sweep(
        self, request: coordinator_pb2.SweepRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.SweepResponse:
        """Decay every memory once, then the statistics and exact global top-k after it.

        Equal to ``Decay`` then ``Quality`` and ``TopK`` with no write in between, in one
        RPC per worker. A repeated ``op_id`` completes that decay as ``Decay`` does.

        Raises:
            grpc.aio.AbortError: INVALID_ARGUMENT for a rate outside [0, 1] or not finite, an
                op_id over 64 bytes, or k above ``topk_max``; UNAVAILABLE when a primary still
                failed after retries.
        """
        async with _ERRORS.mapped(context):
            rate = float(validate_rate(request.rate))
            op_id = validate_op_id(request.op_id)
            k = validate_k(request.k, self._cluster.cfg.topk_max) if request.k else 0
            table = self._wire_table(request.table)
            r = await self._cluster.memory.sweep(rate, op_id, k, request.want_quality, table)
        reply = coordinator_pb2.SweepResponse(
            memories=r.memories,
            topk=common_pb2.TopKResponse(
                ids=ids_to_bytes(r.ids), strengths=f32_to_bytes(r.strengths)
            ),
        )
        if r.quality is not None:
            reply.quality.CopyFrom(quality_to_pb(r.quality))
        return reply

    def _wire_table(self, name: str) -> str:
        """The table a bulk request names, as workers take it ("" for the default one).

        Raises:
            TableNotFound: no such table (NOT_FOUND).
        """
        table = self._cluster.tables.check(name)
        return "" if table == DEFAULT_TABLE else table

    async def CreateTable(
        self, request: coordinator_pb2.CreateTableRequest, context: aio.ServicerContext[Any, Any]
    ) -> common_pb2.TableSpec:
        """Create a replay table (admin); answered once the map listing it is published.

        Raises:
            grpc.aio.AbortError: INVALID_ARGUMENT naming the field out of range (name,
                capacity, eviction, max_payload_bytes, forget_below); ALREADY_EXISTS.
        """
        spec = common_pb2.TableSpec()
        async with _ERRORS.mapped(context):
            spec = await self._cluster.tables.create(
                request.name,
                request.capacity,
                request.eviction,
                request.max_payload_bytes,
                request.forget_below if request.has_forget_below else None,
            )
        return spec

    async def Insert(
        self, request: coordinator_pb2.InsertRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.InsertResponse:
        """Upsert into a capped table, evicting per its policy (``CappedInserts``).

        Raises:
            grpc.aio.AbortError: NOT_FOUND naming an unknown table; INVALID_ARGUMENT for bad
                values (payloads over the table's limit, naming the index), a request_id over
                64 bytes or a table without a capacity (nothing applied); UNAVAILABLE when a
                primary could not be reached (retry with the same request_id).
        """
        reply = coordinator_pb2.InsertResponse()
        async with _ERRORS.mapped(context):
            spec = self._cluster.tables.spec(request.table)
            if not spec.capacity:
                raise BadRequest(f"table {spec.name!r} has no capacity: upsert to the workers")
            validate_request_id(request.request_id)
            payloads = list(request.payloads) if len(request.payloads) else None
            ids, strengths, plain = validate_upsert(
                ids_from_bytes(request.ids, "ids"),
                f32_from_bytes(request.strengths, "strengths"),
                payloads,
                spec.max_payload_bytes,
            )
            wire = None if plain is None else [p or b"" for p in plain]  # bytes on the wire
            try:
                applied, evicted = await self._cluster.inserts.insert(
                    spec.name, ids, strengths, wire, request.request_id
                )
            except RoutingError as exc:
                raise InsertFailed(str(exc), exc.code) from None
            reply = coordinator_pb2.InsertResponse(applied=applied, evicted=evicted)
        return reply

    async def ListTables(
        self, request: coordinator_pb2.ListTablesRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.ListTablesResponse:
        """Every replay table, "default" first, then by name."""
        return coordinator_pb2.ListTablesResponse(tables=self._cluster.tables.list())

    async def DropTable(
        self, request: coordinator_pb2.DropTableRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.DropTableResponse:
        """Drop a replay table and its memories (admin); answered once the map is published.

        Raises:
            grpc.aio.AbortError: NOT_FOUND naming the table; INVALID_ARGUMENT for "default".
        """
        async with _ERRORS.mapped(context):
            await self._cluster.tables.drop(request.name)
        return coordinator_pb2.DropTableResponse()

    async def SubmitJob(
        self, request: coordinator_pb2.SubmitJobRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.Job:
        """Admit and queue a job, owned by the caller's token subject.

        Nothing is queued, imported or opened for a refused spec.

        Raises:
            grpc.aio.AbortError: INVALID_ARGUMENT for an invalid spec, or a path outside the
                data roots (names the key); PERMISSION_DENIED for a model entry not in
                the coordinator's ``allowed_models``; RESOURCE_EXHAUSTED over an admission cap
                (names the cap and the value), or with too many unfinished jobs.
        """
        principal = current_principal()
        owner = principal.subject if principal else ""
        async with _ERRORS.mapped(context):
            job = await self._cluster.submit(request.spec_json, owner)
        return job_to_pb(job)

    async def GetJob(
        self, request: coordinator_pb2.JobRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.Job:
        """One job.

        Raises:
            grpc.aio.AbortError: NOT_FOUND for an unknown id, or another subject's job (the
                same answer).
        """
        async with _ERRORS.mapped(context):
            return job_to_pb(self._job(request.job_id))

    async def ListJobs(
        self, request: coordinator_pb2.ListJobsRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.ListJobsResponse:
        """The jobs the caller may see, in submission order.

        Its own jobs; every job for admin, and without auth.
        """
        return coordinator_pb2.ListJobsResponse(
            jobs=[job_to_pb(j) for j in self._cluster.jobs.list() if may_see_job(j.owner)]
        )

    async def CancelJob(
        self, request: coordinator_pb2.JobRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.Job:
        """Cancel a queued or running job; a finished one is returned as is.

        Raises:
            grpc.aio.AbortError: NOT_FOUND for an unknown id, or another subject's job
                (admin may cancel any).
        """
        async with _ERRORS.mapped(context):
            self._job(request.job_id)
        job = await self._cluster.scheduler.cancel(request.job_id)
        return job_to_pb(job)

    async def RunEpochs(
        self, request: coordinator_pb2.RunEpochsRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.RunEpochsResponse:
        """Grant a paced train job more epochs (``coordinator.jobs.pacing``).

        Raises:
            grpc.aio.AbortError: NOT_FOUND for an unknown id, or another subject's job
                (admin may grant any); INVALID_ARGUMENT for epochs < 1; FAILED_PRECONDITION
                for a job that is not paced, has ended or is finishing, or a grant past its
                spec's epochs. Nothing changes on a refusal.
        """
        reply = coordinator_pb2.RunEpochsResponse()
        async with _ERRORS.mapped(context):
            job = self._job(request.job_id)
            granted = await self._cluster.run_epochs(job, request.epochs)
            reply = coordinator_pb2.RunEpochsResponse(job=job_to_pb(job), epochs_granted=granted)
        return reply

    async def FinishJob(
        self, request: coordinator_pb2.JobRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.Job:
        """Ask a paced job to end SUCCEEDED at its next epoch boundary; answers at once.

        Raises:
            grpc.aio.AbortError: NOT_FOUND for an unknown id, or another subject's job
                (admin: any); FAILED_PRECONDITION for a job that is not paced.
        """
        reply = coordinator_pb2.Job()
        async with _ERRORS.mapped(context):
            job = self._job(request.job_id)
            await self._cluster.finish(job)
            reply = job_to_pb(job)
        return reply

    async def WatchJob(
        self, request: coordinator_pb2.JobRequest, context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[coordinator_pb2.JobEvent]:
        """Stream the job's state and progress until it reaches a terminal state.

        Raises:
            grpc.aio.AbortError: NOT_FOUND for an unknown id, or another subject's job.
        """
        async with _ERRORS.mapped(context):
            job = self._job(request.job_id)
        seen = -1
        while True:
            if job.version == seen:
                await self._cluster.jobs.wait_change(job, seen)
            seen = job.version
            # Decide on the snapshot sent: the job may end while the event is in flight, and
            # then that terminal state must still be sent as the last event.
            terminal = job.state.terminal
            yield coordinator_pb2.JobEvent(
                job=job_to_pb(job), progress_json=json.dumps(job.progress)
            )
            if terminal:
                return

    async def GetModel(
        self, request: coordinator_pb2.GetModelRequest, context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[coordinator_pb2.ModelChunk]:
        """Stream a train job's saved model: a header, then the file in ``chunk_bytes`` pieces.

        The file is named by the job id only, looked up in the job store first.

        Raises:
            grpc.aio.AbortError: NOT_FOUND for an unknown id, another subject's job (admin:
                any), or a job without that saved model (not finished, or never evaluated
                for ``best``).
        """
        async with _ERRORS.mapped(context):
            job = self._job(request.job_id)
            if job.kind != "train":
                raise ModelMissing(f"job {job.job_id!r} is not a train job: it has no model")
            path = model_file(self._cluster.cfg.data_dir, job.job_id, request.best)
            try:
                size, sha, pieces = await asyncio.to_thread(
                    model_chunks, path, self._cluster.cfg.chunk_bytes
                )
            except ModelMissing:
                which = "best" if request.best else "final"
                raise ModelMissing(f"job {job.job_id!r} has no saved {which} model") from None
        yield coordinator_pb2.ModelChunk(
            header=coordinator_pb2.ModelHeader(
                job_id=job.job_id, best=request.best, bytes=size, sha256=sha
            )
        )
        try:
            while piece := await asyncio.to_thread(next, pieces, b""):
                yield coordinator_pb2.ModelChunk(data=piece)
        finally:
            pieces.close()  # a cancelled stream closes the file now, not at collection

    async def ListModels(
        self, request: coordinator_pb2.ListModelsRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.ListModelsResponse:
        """The jobs the caller may see (``may_see_job``) that have a saved model."""
        data_dir = self._cluster.cfg.data_dir
        jobs = [j for j in self._cluster.jobs.list() if may_see_job(j.owner)]
        found = await asyncio.to_thread(lambda: [saved_model(j, data_dir) for j in jobs])
        return coordinator_pb2.ListModelsResponse(
            models=[
                coordinator_pb2.ModelEntry(
                    job_id=m.job.job_id,
                    kind=m.job.kind,
                    strategy=getattr(m.job.spec, "strategy", ""),
                    best_test_accuracy=m.best_test_accuracy,
                    bytes=m.bytes,
                    best_bytes=m.best_bytes,
                    saved_at=m.saved_at,
                )
                for m in found
                if m is not None
            ]
        )

    def _job(self, job_id: str) -> JobRecord:
        """The job ``job_id`` if the caller may see it.

        Raises:
            JobNotFound: otherwise (NOT_FOUND): another subject's job gets the very answer of
                an unknown id (no existence oracle).
        """
        job = self._cluster.jobs.get(job_id)
        if not may_see_job(job.owner):
            raise JobNotFound(f"no job with id {job_id!r}")
        return job

    async def ExportMemories(
        self,
        request: coordinator_pb2.ExportMemoriesRequest,
        context: aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[coordinator_pb2.ExportChunk]:
        """Stream every memory of a table: a header, then chunks slot by slot (``StoreExport``).

        Each slot is a point-in-time copy from its primary; writes during the export may or
        may not be included.

        Raises:
            grpc.aio.AbortError: NOT_FOUND naming an unknown table; UNAVAILABLE when a slot
                has no live primary or a primary failed past the retry budget;
                RESOURCE_EXHAUSTED when ``max_concurrent_exports`` exports are running already.
        """
        c = self._cluster
        limit = c.cfg.max_concurrent_exports
        async with _ERRORS.mapped(context):
            if self._exports >= limit:
                raise ExportsBusy(
                    f"{self._exports} exports are running, max_concurrent_exports is {limit}; "
                    "retry when one has finished"
                )
            export = StoreExport(
                c.rebalancer,
                c.membership,
                c.clients,
                c.cfg.rpc_timeout_s,
                c.cfg.chunk_bytes,
                batch_bytes=c.cfg.export_batch_bytes,
                batch_memories=c.cfg.export_batch_memories,
                table=self._wire_table(request.table),
            )
            self._exports += 1
            try:
                async for chunk in export.chunks():
                    yield chunk
            finally:
                self._exports -= 1

    async def ForgetWorker(
        self, request: coordinator_pb2.ForgetWorkerRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.ForgetWorkerResponse:
        """Report what forgetting a DEAD worker loses; with ``confirm``, forget it.

        Raises:
            grpc.aio.AbortError: NOT_FOUND for an unknown worker; FAILED_PRECONDITION for
                one that is ALIVE or DRAINING.
        """
        c = self._cluster
        async with _ERRORS.mapped(context):
            r = forget_worker(
                request.name, request.confirm, c.membership, c.rebalancer, c.state, c.events
            )
        return coordinator_pb2.ForgetWorkerResponse(
            forgotten=r.forgotten,
            lost_slots=r.lost_slots,
            lost_memories=r.lost_memories or 0,
            memories_known=r.lost_memories is not None,
            slots_kept=r.slots_kept,
        )
