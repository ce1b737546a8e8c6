"""The async client ``Client``: jobs, cluster status and the memory store over gRPC.

Errors surface as ``NeuroshardError`` with the gRPC status code and a one-line message.
Keyed memory operations go straight to the workers holding the ids' slots
(``shared.client.memory``); everything else goes to the coordinator.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import numpy.typing as npt
from grpc import aio

from shared import rpc
from shared.client.datasets import CHUNK_BYTES as UPLOAD_CHUNK_BYTES
from shared.client.datasets import (
    UploadRefused,
    entries_from_pb,
    info_from_pb,
    put_file,
    upload_timeout_s,
)
from shared.client.direct_sample import direct_sample
from shared.client.memory import MemoryRouter, Progress, RoutingError
from shared.client.models import ModelStreamError, model_to_file, models_from_pb
from shared.client.npz_stream import array_files, npz_size
from shared.client.sampling import SampleBatch, sample_from_pb, sample_request
from shared.client.store_io import (
    ExportProgress,
    ExportStreamError,
    export_to_file,
    forget_doc,
    load_export,
    upsert_export,
)
from shared.client.table_reads import direct_quality, direct_topk
from shared.memory.export_file import IMPORT_BATCH
from shared.memory.files import MemoryFileError
from shared.memory.sampling import new_seed
from shared.memory.stats import quality_to_pb
from shared.memory.tables import DEFAULT_TABLE, table_name
from shared.memory.validation import (
    MemoryInputError,
    as_ids,
    validate_reinforce,
    validate_upsert,
)
from shared.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from shared.rpc.codec import f32_from_bytes, f32_to_bytes, ids_from_bytes, ids_to_bytes
from shared.security.transport import ChannelSecurity, explain_unavailable

DEFAULT_ADDRESS = "localhost:50051"
T = TypeVar("T")
Req = TypeVar("Req")
Resp = TypeVar("Resp")


def default_address() -> str:
    """Return the coordinator address to use: ``$NEUROSHARD_COORDINATOR`` or ``localhost:50051``."""
    return os.environ.get("NEUROSHARD_COORDINATOR") or DEFAULT_ADDRESS


class NeuroshardError(Exception):
    """An RPC failed; ``code`` is the gRPC status code, ``str()`` a one-line message.

    Input the client refuses before sending anything is INVALID_ARGUMENT too.
    """

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN) -> None:
        """Keep ``code`` beside the message."""
        super().__init__(message)
        self.code = code


@contextmanager
def _refused_input() -> Iterator[None]:
    """Raise a ``MemoryInputError`` of the block as INVALID_ARGUMENT: nothing was sent.

    Raises:
        NeuroshardError: INVALID_ARGUMENT with the error's message (it names the field).
    """
    try:
        yield
    except MemoryInputError as exc:
        raise NeuroshardError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None


def _error(
    exc: aio.AioRpcError, address: str, security: ChannelSecurity | None = None
) -> NeuroshardError:
    """A failed call as one line for people: the coordinator's address, a TLS hint."""
    code = exc.code()
    if code is grpc.StatusCode.UNAVAILABLE:
        details = explain_unavailable(exc.details() or "", security)
        msg = f"cannot reach the coordinator at {address}: {details}"
    elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
        msg = f"the coordinator at {address} did not answer in time"
    else:
        msg = exc.details() or code.name
    return NeuroshardError(msg, code)


def _checked_upsert(
    ids: npt.ArrayLike,
    strengths: npt.ArrayLike,
    payloads: Sequence[bytes] | None,
    limit: int,
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32], list[bytes] | None]:
    """Validate an upsert as ``Client.upsert`` takes it; return what the router sends.

    Args:
        ids: [N] integers >= 0.
        strengths: [N] in [0, 1].
        payloads: None, or N bytes.
        limit: the cluster's ``max_payload_bytes``.

    Returns:
        ids [N] uint64, strengths [N] float32, and N payloads as bytes (or None).

    Raises:
        NeuroshardError: INVALID_ARGUMENT naming the field and index.
    """
    with _refused_input():
        ids_N, strengths_N, checked = validate_upsert(ids, strengths, payloads, limit)
    if checked is not None and None in checked:
        # The wire has no "leave this payload alone" per item: b"" removes a payload.
        i = checked.index(None)
        raise NeuroshardError(
            f"payloads[{i}]: None; pass b'' to remove a payload, or payloads=None to "
            "leave every payload alone",
            grpc.StatusCode.INVALID_ARGUMENT,
        )
    return ids_N, strengths_N, None if checked is None else [bytes(p or b"") for p in checked]


@dataclass
class JobInfo:
    """A job as the client sees it.

    Attributes:
        job_id: the coordinator's id of the job.
        kind: ``train`` or ``memory``.
        state: ``QUEUED``, ``RUNNING``, ``SUCCEEDED``, ``FAILED`` or ``CANCELLED``.
        spec: the spec as the coordinator stored it (data paths resolved).
        result: the final result document, once the job succeeded.
        error: why the job failed or was cancelled; "" otherwise.
        workers: names of the workers running it.
        created_at: submission time, Unix seconds.
        started_at: start time, Unix seconds (0 while queued).
        finished_at: end time, Unix seconds (0 while not finished).
    """

    job_id: str
    kind: str
    state: str
    spec: dict[str, Any]
    result: dict[str, Any] | None
    error: str
    workers: list[str] = field(default_factory=list)
    created_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0

    @property
    def terminal(self) -> bool:
        """Whether the job has ended (SUCCEEDED, FAILED or CANCELLED): it changes no more."""
        return self.state in ("SUCCEEDED", "FAILED", "CANCELLED")

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.Job) -> JobInfo:
        """Decode a ``Job`` message (its spec and result are JSON documents)."""
        return cls(
            job_id=pb.job_id,
            kind=pb.kind,
            state=common_pb2.JobState.Name(pb.state).removeprefix("JOB_STATE_"),
            spec=json.loads(pb.spec_json) if pb.spec_json else {},
            result=json.loads(pb.result_json) if pb.result_json else None,
            error=pb.error,
            workers=list(pb.workers),
            created_at=pb.created_at,
            started_at=pb.started_at,
            finished_at=pb.finished_at,
        )

    def summary(self) -> dict[str, Any]:
        """Return the document ``submit --json`` prints: id, state, kind, result, error."""
        return {
            "job_id": self.job_id,
            "state": self.state,
            "kind": self.kind,
            "result": self.result,
            "error": self.error or None,
        }


class Client:
    """Async client of a coordinator (and, for keyed memory operations, of its workers).

    Every call has a deadline (``timeout_s``); ``watch`` has none. Use it as an async
    context manager, or call ``close()``, to close its channels.
    """

    def __init__(
        self,
        address: str | None = None,
        timeout_s: float = 30.0,
        max_message_bytes: int = 64 * 1024 * 1024,
        security: ChannelSecurity | None = None,
    ) -> None:
        """Open a channel to the coordinator (connected at the first call).

        Args:
            address: the coordinator's ``host:port``; default ``default_address()``.
            timeout_s: deadline of every call, seconds (an upload's grows with its size).
            max_message_bytes: message limit of every channel, bytes.
            security: TLS files and token (``shared.security.transport.client_security``);
                None is plaintext without a token.
        """
        self.address = address or default_address()
        self.timeout_s = timeout_s
        self._max_message_bytes = max_message_bytes
        self._security = security
        self._channel = rpc.channel(self.address, max_message_bytes, security)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._router = MemoryRouter(self._stub, timeout_s, max_message_bytes, security=security)

    async def __aenter__(self) -> Client:
        """Return the client itself; leaving the block closes it."""
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close the client."""
        await self.close()

    async def close(self) -> None:
        """Close the channels to the coordinator and to the workers."""
        await self._router.close()
        await self._channel.close()

    async def _call(
        self,
        rpc: aio.UnaryUnaryMultiCallable[Req, Resp],
        request: Req,
        timeout_s: float | None = None,
    ) -> Resp:
        """Call a unary coordinator RPC with the client's deadline.

        Raises:
            NeuroshardError: the call failed (its status).
        """
        try:
            return await rpc(request, timeout=timeout_s or self.timeout_s)
        except aio.AioRpcError as exc:
            raise _error(exc, self.address, self._security) from None

    async def submit(self, spec: dict[str, Any]) -> JobInfo:
        """Submit a job spec (a dict as in configs/jobs/*.yaml); the job starts QUEUED.

        Raises:
            NeuroshardError: INVALID_ARGUMENT (the message names the field),
                PERMISSION_DENIED (an import or path the coordinator does not allow),
                RESOURCE_EXHAUSTED (over an admission cap), UNAVAILABLE.
        """
        pb: coordinator_pb2.Job = await self._call(
            self._stub.SubmitJob, coordinator_pb2.SubmitJobRequest(spec_json=json.dumps(spec))
        )
        return JobInfo.from_pb(pb)

    async def get_job(self, job_id: str) -> JobInfo:
        """Return a job's current state.

        Raises:
            NeuroshardError: NOT_FOUND for an unknown id, or a job of another user.
        """
        return JobInfo.from_pb(
            await self._call(self._stub.GetJob, coordinator_pb2.JobRequest(job_id=job_id))
        )

    async def jobs(self) -> list[JobInfo]:
        """List the jobs the caller may see (its own; every job for an admin or without auth).

        Raises:
            NeuroshardError: UNAVAILABLE, UNAUTHENTICATED, ...
        """
        reply: coordinator_pb2.ListJobsResponse = await self._call(
            self._stub.ListJobs, coordinator_pb2.ListJobsRequest()
        )
        return [JobInfo.from_pb(j) for j in reply.jobs]

    async def cancel(self, job_id: str) -> JobInfo:
        """Cancel a job that has not ended; return its state after the request.

        Raises:
            NeuroshardError: NOT_FOUND for an unknown id, or a job of another user.
        """
        return JobInfo.from_pb(
            await self._call(self._stub.CancelJob, coordinator_pb2.JobRequest(job_id=job_id))
        )

    async def run_epochs(self, job_id: str, epochs: int = 1) -> int:
        """Grant a paced train job (spec ``paced: true``) ``epochs`` more epochs.

        Returns:
            The epochs granted to the job in all.

        Raises:
            NeuroshardError: NOT_FOUND for an unknown id or another user's job;
                INVALID_ARGUMENT for epochs < 1; FAILED_PRECONDITION for a job that is not
                paced, has ended or is finishing, or past its spec's epochs;
                PERMISSION_DENIED for a reader's token.
        """
        reply: coordinator_pb2.RunEpochsResponse = await self._call(
            self._stub.RunEpochs, coordinator_pb2.RunEpochsRequest(job_id=job_id, epochs=epochs)
        )
        return int(reply.epochs_granted)

    async def finish(self, job_id: str) -> JobInfo:
        """Ask a paced train job to end SUCCEEDED at its next epoch boundary; answers at once.

        Raises:
            NeuroshardError: NOT_FOUND for an unknown id or another user's job;
                FAILED_PRECONDITION for a job that is not paced.
        """
        return JobInfo.from_pb(
            await self._call(self._stub.FinishJob, coordinator_pb2.JobRequest(job_id=job_id))
        )

    async def watch(self, job_id: str) -> AsyncGenerator[tuple[JobInfo, dict[str, Any]], None]:
        """Follow a job until it ends: yield its state and progress at every event.

        There is no overall deadline: a training job may run for hours.

        Yields:
            ``(job, progress)``: the job's state and the event's progress document (``step``,
            ``loss``, ``test_accuracy``, ``samples_per_s``, or ``iteration``, ``iteration_ms``
            for memory jobs; keys vary by kind and phase).

        Raises:
            NeuroshardError: NOT_FOUND, UNAVAILABLE.
        """
        call = self._stub.WatchJob(coordinator_pb2.JobRequest(job_id=job_id))
        try:
            async for event in call:
                yield JobInfo.from_pb(event.job), json.loads(event.progress_json or "{}")
        except aio.AioRpcError as exc:
            raise _error(exc, self.address, self._security) from None
        finally:  # a caller that stops early (aclosing) ends the stream now
            call.cancel()

    async def wait(self, job_id: str) -> JobInfo:
        """Wait until the job ends, without a deadline; return its final state.

        Raises:
            NeuroshardError: NOT_FOUND, UNAVAILABLE.
        """
        final: JobInfo | None = None
        async for job, _ in self.watch(job_id):
            final = job
        assert final is not None
        return final

    async def put_dataset(
        self,
        path: str | os.PathLike[str],
        name: str | None = None,
        replace: bool = False,
        progress: Callable[[int], None] | None = None,
        chunk_bytes: int = UPLOAD_CHUNK_BYTES,
    ) -> dict[str, Any]:
        """Upload a local ``.npz``, a directory of ``.npy`` or a ``.pt`` state dict.

        An ``.npz`` is stored as ``NAME.npz``: a job then names it ``data: {path: NAME.npz}``
        (or ``load: NAME.npz``); the coordinator validates it as it arrives and serves the
        workers their rows. A ``.pt`` file (a ``torch.save`` of a state dict, read with
        ``weights_only=True``) is stored as ``NAME.pt``, for ``init: {dataset: NAME}``.

        Args:
            path: the file: arrays ``x`` [N, ...] and ``y`` of any numeric dtype (a
                training set, maybe with ``x_test``, ``y_test``), ``ids`` and ``strengths``
                (a memory set), or a ``.pt`` state dict; or a directory of ``x.npy``
                (``y.npy``, ``x_test.npy``, ``y_test.npy``), streamed as an uncompressed
                ``.npz`` built as it is sent (the coordinator memory-maps its members).
            name: ``[A-Za-z0-9][A-Za-z0-9._-]*``, at most 128 characters; default the
                file's stem; a trailing ``.npz`` is dropped (``.pt`` is added for a
                ``.pt`` file).
            replace: overwrite a data set of that name.
            progress: called with each chunk's size in bytes as it is sent.
            chunk_bytes: bytes of the file per message, >= 1 (default 1 MiB).

        Returns:
            ``name``, ``path`` (in the data root), ``bytes``, ``sha256`` (hex), ``kind``
            (``train``, ``memory`` or ``weights``) and ``arrays`` (name, dtype, shape of
            each).

        Raises:
            NeuroshardError: INVALID_ARGUMENT (no such local file, a bad name, not a valid
                data set, chunk_bytes < 1), RESOURCE_EXHAUSTED (over the coordinator's
                max_dataset_bytes), ALREADY_EXISTS (the name is taken and ``replace`` is
                false), UNAVAILABLE.
        """
        if chunk_bytes < 1:
            raise NeuroshardError(
                f"chunk_bytes: must be at least 1, got {chunk_bytes}",
                grpc.StatusCode.INVALID_ARGUMENT,
            )
        p = Path(path)
        if await asyncio.to_thread(p.is_dir):
            files = await asyncio.to_thread(array_files, p)
            if not files or files[0].name != "x.npy":
                raise NeuroshardError(
                    f"{p}: a data set directory needs x.npy (and y.npy, x_test.npy, "
                    "y_test.npy as the set has them)",
                    grpc.StatusCode.INVALID_ARGUMENT,
                )
            size = await asyncio.to_thread(npz_size, files)
        elif await asyncio.to_thread(p.is_file):
            size = (await asyncio.to_thread(p.stat)).st_size
        else:
            raise NeuroshardError(f"{p}: no such file", grpc.StatusCode.INVALID_ARGUMENT)
        is_dir = await asyncio.to_thread(p.is_dir)
        stem = (p.name if is_dir else p.stem) if name is None else name
        if p.suffix == ".pt" and not stem.endswith(".pt"):
            stem += ".pt"  # a state dict: stored as NAME.pt, not as an .npz data set
        header = coordinator_pb2.DatasetHeader(name=stem, total_bytes=size, replace=replace)
        try:
            info = await put_file(
                self._stub,
                p,
                header,
                progress,
                upload_timeout_s(self.timeout_s, size),
                chunk_bytes,
            )
        except aio.AioRpcError as exc:
            raise _error(exc, self.address, self._security) from None
        except UploadRefused as exc:
            raise NeuroshardError(str(exc), exc.code) from None
        return info_from_pb(info)

    async def list_datasets(self) -> list[dict[str, Any]]:
        """List the .npz and .npy files in the coordinator's data roots.

        Returns:
            One dict per file: ``path`` (relative to its root), ``bytes``, ``modified_at``
            (Unix seconds), ``root`` (index of the root).

        Raises:
            NeuroshardError: UNAVAILABLE, UNAUTHENTICATED, ...
        """
        return entries_from_pb(
            await self._call(self._stub.ListDatasets, coordinator_pb2.ListDatasetsRequest())
        )

    async def get_model(
        self,
        job_id: str,
        path: str | os.PathLike[str],
        best: bool = False,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Write a train job's saved model (a ``torch.save`` state dict) to ``path``, streamed.

        The file appears only once the whole model arrived and matched its header's size
        and SHA-256; load it with ``torch.load(path, weights_only=True)``.

        Args:
            job_id: a train job of the caller's (any job for an admin).
            path: the file to create or replace; its directory must exist.
            best: the best model by test accuracy instead of the final one.
            timeout_s: deadline of the whole stream, seconds; None: the client's.

        Returns:
            ``job_id``, ``best``, ``path``, ``bytes`` and ``sha256`` (hex).

        Raises:
            NeuroshardError: NOT_FOUND (unknown job, another user's, or no such saved
                model), INVALID_ARGUMENT (the file cannot be written), INTERNAL (a stream
                that does not match its header).
        """
        try:
            return await model_to_file(
                self._stub, job_id, path, best, timeout_s or max(self.timeout_s, 300.0)
            )
        except aio.AioRpcError as exc:
            raise _error(exc, self.address, self._security) from None
        except ModelStreamError as exc:
            raise NeuroshardError(str(exc), grpc.StatusCode.INTERNAL) from None
        except OSError as exc:
            raise NeuroshardError(
                f"{path}: cannot write it ({exc.strerror or exc})", grpc.StatusCode.INVALID_ARGUMENT
            ) from None

    async def list_models(self) -> list[dict[str, Any]]:
        """List the caller's jobs (every job for an admin) that have a saved model.

        Returns:
            One dict per job (``shared.client.models.models_from_pb``): ``job_id``,
            ``kind``, ``strategy``, ``best_test_accuracy`` (None: never evaluated),
            ``bytes``, ``best_bytes`` and ``saved_at`` (Unix seconds).

        Raises:
            NeuroshardError: UNAVAILABLE, UNAUTHENTICATED, ...
        """
        return models_from_pb(
            await self._call(self._stub.ListModels, coordinator_pb2.ListModelsRequest())
        )

    async def status(self) -> dict[str, Any]:
        """Return the cluster's status as ``neuroshard status --json`` prints it.

        Returns:
            ``workers`` (name, address, state, device (memory kernels), train_device
            (training), heartbeat_age_s, memories, slots_primary, slots_replica, and the
            coordinator's link figures rtt_ms, bandwidth_mbit, step_ms (None until measured),
            health in [0, 1], excluded and excluded_reason of each, and readmit_holddown_s:
            seconds before a DEAD worker may register again, 0 when no hold-down runs),
            ``jobs`` (count by state), ``slots``, ``replication_factor``,
            ``under_replicated_slots``, ``slot_map_epoch`` and ``memories`` (primary copies,
            as the alive workers last reported them).

        Raises:
            NeuroshardError: UNAVAILABLE, UNAUTHENTICATED, ...
        """
        s: coordinator_pb2.ClusterStatus = await self._call(
            self._stub.GetClusterStatus, coordinator_pb2.GetClusterStatusRequest()
        )
        return {
            "workers": [
                {
                    "name": w.name,
                    "address": w.address,
                    "state": common_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_"),
                    "device": w.device,
                    "train_device": w.train_device,
                    "heartbeat_age_s": round(w.heartbeat_age_s, 3),
                    "memories": w.memories,
                    "slots_primary": w.slots_primary,
                    "slots_replica": w.slots_replica,
                    "rtt_ms": _measured(w.rtt_ms),
                    "bandwidth_mbit": _measured(w.bandwidth_mbit),
                    "step_ms": _measured(w.step_ms),
                    "health": round(w.health, 3),
                    "excluded": w.excluded,
                    "excluded_reason": w.excluded_reason or None,
                    "readmit_holddown_s": round(w.readmit_holddown_s, 3),
                }
                for w in s.workers
            ],
            "jobs": dict(s.jobs_by_state),
            "slots": s.slots,
            "replication_factor": s.replication_factor,
            "under_replicated_slots": s.under_replicated_slots,
            "slot_map_epoch": s.slot_map_epoch,
            "memories": s.memories,
        }

    # -- memory store ---------------------------------------------------------------------

    async def _routed(self, work: Awaitable[T]) -> T:
        """Await a routed operation, turning its failures into ``NeuroshardError``."""
        try:
            return await work
        except RoutingError as exc:
            raise NeuroshardError(str(exc), exc.code) from None
        except aio.AioRpcError as exc:
            raise _error(exc, self.address, self._security) from None

    async def _payload_limit(self, table: str = DEFAULT_TABLE) -> int:
        """A table's ``max_payload_bytes``, from the slot map.

        Raises:
            NeuroshardError: NOT_FOUND naming an unknown table.
        """
        return int((await self._routed(self._router.table_spec(table))).max_payload_bytes)

    async def upsert(
        self,
        ids: npt.ArrayLike,
        strengths: npt.ArrayLike,
        payloads: Sequence[bytes] | None = None,
        progress: Progress | None = None,
        table: str = DEFAULT_TABLE,
    ) -> int:
        """Insert or overwrite memories of a table; acknowledged once both copies applied them.

        Args:
            ids: [N] uint64 (any integer array of non-negative values).
            strengths: [N] float32 in [0, 1].
            payloads: None, or [N] bytes (b"" removes a payload), each at most the
                table's ``max_payload_bytes``.
            progress: called with the number of items of each part of the batch as its
                primary acknowledges it (both copies applied it), while other parts may
                still wait, e.g. for the failover of a dead worker; the calls add up to N.
            table: the table written (ids are per table). Into a table with a capacity the
                batch goes to the coordinator, which orders the table's inserts, writes them
                and evicts what exceeds the capacity before answering (one message: at most
                ``max_message_bytes``).

        Returns:
            Distinct ids written.

        Raises:
            NeuroshardError: INVALID_ARGUMENT naming the field and index (nothing is sent);
                NOT_FOUND naming an unknown table (nothing is sent); UNAVAILABLE when the
                batch could not be delivered.
        """
        spec = await self._routed(self._router.table_spec(table))
        ids, strengths, plain = _checked_upsert(ids, strengths, payloads, spec.max_payload_bytes)
        if spec.capacity:  # the coordinator orders a capped table's inserts and evicts
            reply: coordinator_pb2.InsertResponse = await self._call(
                self._stub.Insert,
                coordinator_pb2.InsertRequest(
                    table=spec.name,
                    ids=ids_to_bytes(ids),
                    strengths=f32_to_bytes(strengths),
                    payloads=plain or [],
                    request_id=uuid.uuid4().bytes,
                ),
            )
            if progress is not None:
                progress(len(ids))
            return int(reply.applied)
        work = self._router.upsert(ids, strengths, plain, None, progress, _wire(table))
        return int(await self._routed(work))

    async def update_strengths(
        self,
        ids: npt.ArrayLike,
        strengths: npt.ArrayLike,
        progress: Progress | None = None,
        table: str = DEFAULT_TABLE,
    ) -> int:
        """Set the strengths of many stored memories in one call (a bulk priority update).

        An upsert that keeps payloads and never inserts: ids not stored (never written,
        deleted) are skipped and not counted. Exactly-once as ``upsert``: one request id
        for every part and retry, applied on both copies before the reply.

        Args:
            ids: [N] uint64 (any integer array of non-negative values); the last
                occurrence of an id in the batch wins.
            strengths: [N] float32 in [0, 1].
            progress: as ``upsert``.
            table: the table updated (a capped one too: an update inserts nothing, so it
                goes straight to the workers and evicts nothing).

        Returns:
            Distinct ids found and updated (N minus the absent ones, for distinct ids).

        Raises:
            NeuroshardError: INVALID_ARGUMENT naming the field and index (nothing is sent);
                NOT_FOUND naming an unknown table; UNAVAILABLE when the batch could not be
                delivered.
        """
        with _refused_input():
            ids, values = validate_upsert(ids, strengths, None, 0)[:2]
        await self._payload_limit(table)  # NOT_FOUND before anything is sent
        work = self._router.update_strengths(ids, values, None, progress, _wire(table))
        return int(await self._routed(work))

    async def reinforce(
        self,
        ids: npt.ArrayLike,
        boosts: npt.ArrayLike,
        progress: Progress | None = None,
        table: str = DEFAULT_TABLE,
    ) -> int:
        """Add boosts to the strengths of stored memories, then clip them to [0, 1].

        Args:
            ids: [N] uint64 (any integer array of non-negative values); duplicates add up.
            boosts: [N] float32, finite and >= 0.
            progress: as ``upsert``.
            table: as ``upsert``.

        Returns:
            Ids found (unknown ids are skipped).

        Raises:
            NeuroshardError: INVALID_ARGUMENT naming the field and index (nothing is sent);
                NOT_FOUND as ``upsert``; UNAVAILABLE when the batch could not be delivered.
        """
        with _refused_input():
            ids, boosts = validate_reinforce(ids, boosts)
        await self._payload_limit(table)  # NOT_FOUND before anything is sent
        work = self._router.reinforce(ids, boosts, None, progress, _wire(table))
        return int(await self._routed(work))

    async def delete(
        self, ids: npt.ArrayLike, progress: Progress | None = None, table: str = DEFAULT_TABLE
    ) -> int:
        """Delete memories of a table from both copies; return how many existed.

        Args:
            ids: [N] uint64 (any integer array of non-negative values).
            progress: as ``upsert``.
            table: as ``upsert``.

        Raises:
            NeuroshardError: INVALID_ARGUMENT for bad ids (nothing is sent); NOT_FOUND as
                ``upsert``; UNAVAILABLE.
        """
        with _refused_input():
            ids = as_ids(ids)
        await self._payload_limit(table)
        return int(await self._routed(self._router.delete(ids, None, progress, _wire(table))))

    async def get(
        self, ids: npt.ArrayLike, with_payloads: bool = False, table: str = DEFAULT_TABLE
    ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.float32], list[bytes | None]]:
        """Read memories of a table from their primaries.

        Args:
            ids: [N] uint64 (any integer array of non-negative values).
            with_payloads: also fetch the payloads.
            table: as ``upsert``.

        Returns:
            found [N] bool, strengths [N] float32 (0 where missing), payloads [N] (None where
            missing or absent; only when ``with_payloads``).

        Raises:
            NeuroshardError: INVALID_ARGUMENT for bad ids (nothing is sent); NOT_FOUND as
                ``upsert``; UNAVAILABLE.
        """
        with _refused_input():
            ids = as_ids(ids)
        await self._payload_limit(table)
        return await self._routed(self._router.get(ids, with_payloads, _wire(table)))

    async def decay(
        self, rate: float, op_id: bytes | None = None, table: str = DEFAULT_TABLE
    ) -> int:
        """Decay every memory of a table once: ``s = clip(s - rate, 0, 1)``.

        The call carries an operation id that its automatic retries keep, so a retry after a
        failure completes the decay where it is missing and never applies it twice. To retry
        a call that raised, pass the same ``op_id`` again.

        Args:
            rate: subtracted from every strength, in [0, 1].
            op_id: the operation id, up to 64 bytes; None: a new random UUID.
            table: the table decayed.

        Returns:
            Memories decayed (the primary copies of the table).

        Raises:
            NeuroshardError: INVALID_ARGUMENT for a rate outside [0, 1]; NOT_FOUND naming an
                unknown table; PERMISSION_DENIED for a role other than admin; UNAVAILABLE.
        """
        op_id = uuid.uuid4().bytes if op_id is None else op_id
        reply: common_pb2.DecayResponse = await self._call(
            self._stub.Decay,
            coordinator_pb2.DecayRequest(rate=rate, op_id=op_id, table=_wire(table)),
        )
        return int(reply.memories)

    async def quality(self, table: str = DEFAULT_TABLE) -> dict[str, Any]:
        """Summarize every strength of a table, exactly (merged from the primaries).

        Asked of the primaries of the cached slot map at once and merged here
        (``shared.client.table_reads``); the coordinator's ``Quality`` when the map does not
        serve (a stale epoch twice, a failover, a table the map lacks).

        Returns:
            ``count``, ``sum``, ``mean``, ``min``, ``max`` and ``histogram`` (10 counts of
            bins of width 0.1 over [0, 1]).

        Raises:
            NeuroshardError: UNAVAILABLE, UNAUTHENTICATED, ...
        """
        direct = await self._routed(direct_quality(self._router, _wire(table), self.timeout_s))
        if direct is not None:
            return _quality_dict(quality_to_pb(direct))
        q: common_pb2.QualityStats = await self._call(
            self._stub.Quality, coordinator_pb2.QualityRequest(table=_wire(table))
        )
        return _quality_dict(q)

    async def topk(
        self, k: int, table: str = DEFAULT_TABLE
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]:
        """Return the exact global top-k of a table, strongest first, ties by smaller id.

        Each primary's local top-k, merged exactly here, as ``quality``.

        Returns:
            ids [k'] uint64 and strengths [k'] float32, k' = min(k, memories).

        Raises:
            NeuroshardError: INVALID_ARGUMENT when k <= 0 or above the coordinator's topk_max.
        """
        if k < 1:
            raise NeuroshardError(f"k: {k} must be >= 1", grpc.StatusCode.INVALID_ARGUMENT)
        direct = await self._routed(direct_topk(self._router, k, _wire(table), self.timeout_s))
        if direct is not None:
            return direct
        r: common_pb2.TopKResponse = await self._call(
            self._stub.TopK, coordinator_pb2.TopKRequest(k=k, table=_wire(table))
        )
        return ids_from_bytes(r.ids), f32_from_bytes(r.strengths)

    async def sample(
        self,
        n: int,
        alpha: float = 0.6,
        replacement: bool = True,
        seed: int | None = None,
        min_size: int = 0,
        timeout_s: float = 30.0,
        table: str = "default",
        with_payloads: bool = True,
    ) -> SampleBatch:
        """Draw n memories by priority: P(i) = s_i^alpha / sum_j s_j^alpha, over the table.

        Exact over every worker's memories, on integer weights w_i = rint(s_i^alpha * 2^32)
        (0 for strength 0), so P(i) = w_i / W (docs/architecture.md, "Sampling"); alpha 0
        is uniform over the memories of non-zero strength. With a seed the draws are a
        function of the seed, alpha and the table's content, whatever the workers.

        Drawn by the client through the primaries of its slot map (``direct_sample``: the
        coordinator's two phases without the hop through it, the same draws); through the
        coordinator's ``Sample`` with ``min_size``, without replacement, and whenever the
        plain case does not hold (an empty table, a map that moved, a refusal).

        Args:
            n: draws, 1 .. the coordinator's ``max_sample_batch``.
            alpha: priority exponent, finite and >= 0.
            replacement: must be True (sampling without replacement is refused).
            seed: the generator's seed, 0 .. 2**64 - 1; None: a fresh one (returned).
            min_size: wait until the table holds this many memories (0: no wait).
            timeout_s: how long ``min_size`` may wait, seconds.
            table: the table; only ``default`` exists.
            with_payloads: also return the payloads.

        Returns:
            The draws (``SampleBatch``).

        Raises:
            NeuroshardError: NOT_FOUND for another table; INVALID_ARGUMENT for n <= 0 or
                above the limit, alpha negative or not finite, or replacement False;
                FAILED_PRECONDITION for an empty table without min_size, or min_size not
                reached within timeout_s (the message names the size); UNAVAILABLE.
        """
        if n < 1:
            raise NeuroshardError(f"n: {n} must be >= 1", grpc.StatusCode.INVALID_ARGUMENT)
        if replacement and not min_size and (seed is None or 0 <= seed < 2**64):
            drawn = new_seed() if seed is None else seed
            direct = await direct_sample(
                self._router, n, alpha, drawn, with_payloads, _wire(table), self.timeout_s
            )
            if direct is not None:
                return direct
        request = sample_request(
            table, n, alpha, replacement, seed, min_size, timeout_s, with_payloads
        )
        reply = await self._call(self._stub.Sample, request, self.timeout_s + timeout_s)
        return sample_from_pb(reply)

    async def sweep(
        self,
        rate: float,
        k: int = 0,
        want_quality: bool = True,
        op_id: bytes | None = None,
        table: str = DEFAULT_TABLE,
    ) -> tuple[int, dict[str, Any] | None, npt.NDArray[np.uint64], npt.NDArray[np.float32]]:
        """Decay every memory once, then summarize the store and take its top-k, in one call.

        Equal to ``decay(rate)`` then ``quality()`` and ``topk(k)`` with no write in between,
        but one RPC to the coordinator and one per worker (a memory iteration's step). The
        decay is exactly-once as ``decay``'s (same ``op_id`` rules).

        Args:
            rate: subtracted from every strength, in [0, 1]; 0: no decay (a read).
            k: top-k size, 0 (none) up to the coordinator's topk_max.
            want_quality: also compute the statistics.
            op_id: the decay's operation id, up to 64 bytes; None: a new random UUID.
            table: the table swept.

        Returns:
            ``(memories decayed, quality as ``quality()`` returns it or None, top-k ids
            [k'] uint64, strengths [k'] float32)``, k' = min(k, memories).

        Raises:
            NeuroshardError: INVALID_ARGUMENT for a rate outside [0, 1] or k out of range;
                PERMISSION_DENIED for a role other than admin; UNAVAILABLE.
        """
        if k < 0:
            raise NeuroshardError(f"k: {k} must be >= 0", grpc.StatusCode.INVALID_ARGUMENT)
        op_id = uuid.uuid4().bytes if op_id is None else op_id
        r: coordinator_pb2.SweepResponse = await self._call(
            self._stub.Sweep,
            coordinator_pb2.SweepRequest(
                rate=rate, op_id=op_id, k=k, want_quality=want_quality, table=_wire(table)
            ),
        )
        q = _quality_dict(r.quality) if want_quality else None
        return int(r.memories), q, ids_from_bytes(r.topk.ids), f32_from_bytes(r.topk.strengths)

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until the cluster has a slot map with no under-replicated slot, then fetch it.

        Args:
            timeout_s: how long to wait, seconds.

        Raises:
            NeuroshardError: DEADLINE_EXCEEDED when the map did not settle in time.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            s = await self.status()
            if s["slot_map_epoch"] > 0 and s["under_replicated_slots"] == 0:
                await self._routed(self._router.slot_map(refresh=True))
                return
            if loop.time() > deadline:
                raise NeuroshardError(
                    "the slot map did not settle in time", grpc.StatusCode.DEADLINE_EXCEEDED
                )
            await asyncio.sleep(0.05)

    # -- operator commands ----------------------------------------------------------------

    async def export_memories(
        self,
        path: str | os.PathLike[str],
        progress: ExportProgress | None = None,
        timeout_s: float | None = None,
        table: str = DEFAULT_TABLE,
    ) -> dict[str, Any]:
        """Write every memory of a table to ``path``, a plain ``.npz`` (streamed).

        The file (``shared/memory/export_file.py``) appears only once the export completed.
        Each slot is a point-in-time copy from its primary; writes during the export may or
        may not be in it.

        Args:
            path: the file to create or replace; its directory must exist.
            progress: called after each chunk with (memories so far, memories expected).
            timeout_s: deadline of the whole export, seconds; None: none.
            table: the table exported.

        Returns:
            ``path``, ``memories``, ``payloads`` (payload bytes), ``file_bytes``, ``slots``
            and ``slot_map_epoch`` (the map the export started with).

        Raises:
            NeuroshardError: UNAVAILABLE (a slot has no live primary, e.g. all its holders
                are dead), PERMISSION_DENIED (a role other than reader, writer or admin),
                INVALID_ARGUMENT (the file cannot be written), INTERNAL (a malformed stream).
        """
        try:
            summary = await export_to_file(self._stub, path, timeout_s, progress, _wire(table))
        except aio.AioRpcError as exc:
            raise _error(exc, self.address, self._security) from None
        except ExportStreamError as exc:
            raise NeuroshardError(str(exc), grpc.StatusCode.INTERNAL) from None
        except OSError as exc:
            raise NeuroshardError(
                f"{path}: cannot write it ({exc.strerror or exc})", grpc.StatusCode.INVALID_ARGUMENT
            ) from None
        return summary.to_doc()

    async def import_memories(
        self,
        path: str | os.PathLike[str],
        batch: int = IMPORT_BATCH,
        progress: Callable[[int], None] | None = None,
        checked: Callable[[int], None] | None = None,
        table: str = DEFAULT_TABLE,
    ) -> dict[str, Any]:
        """Upsert every memory of an export file (``export_memories``) into a table.

        The whole file is read and checked first (format, dtypes, equal lengths, strengths
        finite in [0, 1], unique ids, payload sizes): a bad file writes nothing. Then it is
        upserted in batches; memories already stored under other ids are kept.

        Args:
            path: the export ``.npz``.
            batch: memories per upsert call, >= 1.
            progress: called with each batch's size once it is acknowledged.
            checked: called with the number of memories once the file passed its checks.
            table: the table written (NOT_FOUND naming it when it does not exist).

        Returns:
            ``path``, ``memories`` (in the file), ``written`` (distinct ids written) and
            ``payloads`` (whether the file carries payloads).

        Raises:
            NeuroshardError: INVALID_ARGUMENT naming the file and the array (nothing is
                written), PERMISSION_DENIED (a role other than writer or admin),
                UNAVAILABLE (a batch could not be delivered: batches before it are written;
                importing again completes it).
        """
        if batch < 1:
            raise NeuroshardError(f"batch: {batch} must be >= 1", grpc.StatusCode.INVALID_ARGUMENT)
        limit = await self._payload_limit(table)
        try:
            data = await load_export(path, limit)
        except MemoryFileError as exc:
            raise NeuroshardError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
        if checked is not None:
            checked(len(data.ids))

        async def upsert(
            ids: npt.NDArray[np.uint64], s: npt.NDArray[np.float32], p: list[bytes] | None
        ) -> int:
            return await self.upsert(ids, s, p, table=table)

        written = await upsert_export(data, upsert, batch, progress)
        return {
            "path": str(path),
            "memories": len(data.ids),
            "written": written,
            "payloads": data.offsets is not None,
        }

    # -- replay tables --------------------------------------------------------------------

    async def create_table(
        self,
        name: str,
        capacity: int = 0,
        eviction: str = "fifo",
        max_payload_bytes: int = 0,
        forget_below: float | None = None,
    ) -> dict[str, Any]:
        """Create a replay table (admin); ids are per table.

        Args:
            name: ``[a-z0-9][a-z0-9_-]*``, at most 64 characters, not "default".
            capacity: most memories the table holds, >= 0 (0: unlimited).
            eviction: "fifo" (oldest insert first) or "weakest" (lowest strength first,
                ties by smaller id): what an insert into a full table evicts.
            max_payload_bytes: largest payload of one memory, bytes (0: the cluster's).
            forget_below: None, or a strength in [0, 1): memories a decay leaves at or below
                it are removed.

        Returns:
            The table as ``list_tables`` shows it.

        Raises:
            NeuroshardError: INVALID_ARGUMENT naming the field out of range; ALREADY_EXISTS;
                PERMISSION_DENIED for a role other than admin.
        """
        if capacity < 0:  # the wire fields are unsigned
            raise NeuroshardError(
                f"capacity: {capacity} must be >= 0 (0: unlimited)",
                grpc.StatusCode.INVALID_ARGUMENT,
            )
        if not 0 <= max_payload_bytes < 2**32:
            raise NeuroshardError(
                f"max_payload_bytes: {max_payload_bytes} is out of range",
                grpc.StatusCode.INVALID_ARGUMENT,
            )
        request = coordinator_pb2.CreateTableRequest(
            name=name,
            capacity=capacity,
            eviction=eviction,
            max_payload_bytes=max_payload_bytes,
            has_forget_below=forget_below is not None,
            forget_below=forget_below or 0.0,
        )
        spec: common_pb2.TableSpec = await self._call(self._stub.CreateTable, request)
        await self._routed(self._router.slot_map(refresh=True))
        return table_doc(spec)

    async def list_tables(self) -> list[dict[str, Any]]:
        """Return every replay table, "default" first, then by name (``table_doc`` each)."""
        reply: coordinator_pb2.ListTablesResponse = await self._call(
            self._stub.ListTables, coordinator_pb2.ListTablesRequest()
        )
        return [table_doc(t) for t in reply.tables]

    async def drop_table(self, name: str) -> None:
        """Drop a replay table and every memory of it (admin).

        Raises:
            NeuroshardError: NOT_FOUND naming the table; INVALID_ARGUMENT for "default";
                PERMISSION_DENIED for a role other than admin.
        """
        await self._call(self._stub.DropTable, coordinator_pb2.DropTableRequest(name=name))
        await self._routed(self._router.slot_map(refresh=True))

    async def forget_worker(self, name: str, confirm: bool = False) -> dict[str, Any]:
        """Forget a DEAD worker that will never return (admin).

        The slots of which it held the last trusted copy are re-created empty on live
        workers; its other slots keep their copy. Without ``confirm`` nothing changes.

        Returns:
            ``worker``, ``forgotten`` (False for a dry run), ``lost_slots`` (list),
            ``lost_memories`` (their memories per slot as its last heartbeat reported them;
            None when unknown: no heartbeat since the coordinator started) and
            ``slots_kept``.

        Raises:
            NeuroshardError: NOT_FOUND (unknown worker), FAILED_PRECONDITION (it is ALIVE or
                DRAINING), PERMISSION_DENIED (a role other than admin).
        """
        reply = await self._call(
            self._stub.ForgetWorker, coordinator_pb2.ForgetWorkerRequest(name=name, confirm=confirm)
        )
        return forget_doc(reply, name)


def table_doc(t: common_pb2.TableSpec) -> dict[str, Any]:
    """A ``TableSpec`` as the client returns it.

    Keys: name, capacity (None: unlimited), eviction, max_payload_bytes, forget_below (None:
    never).
    """
    return {
        "name": t.name,
        "capacity": int(t.capacity) or None,
        "eviction": t.eviction,
        "max_payload_bytes": int(t.max_payload_bytes),
        "forget_below": None if t.forget_below < 0 else round(float(t.forget_below), 6),
    }


def _wire(table: str) -> str:
    """A table as requests carry it: "" for the default one."""
    return "" if table_name(table) == DEFAULT_TABLE else table


def _quality_dict(q: common_pb2.QualityStats) -> dict[str, Any]:
    """A ``QualityStats`` as ``Client.quality`` returns it."""
    return {
        "count": q.count,
        "sum": q.sum,
        "mean": q.mean,
        "min": q.min,
        "max": q.max,
        "histogram": list(q.histogram),
    }


async def _next(agen: AsyncIterator[T]) -> T:
    """``anext`` as a coroutine (``asyncio.Runner.run`` takes coroutines only)."""
    return await agen.__anext__()


def _measured(value: float) -> float | None:
    """A link figure of ``WorkerInfo`` rounded for people; None for 0 (not measured yet)."""
    return round(value, 3) if value > 0 else None
