"""The Python client: ``Client`` (async) and ``SyncClient`` (a blocking wrapper for scripts).

```python
async with Client("localhost:50051") as c:
    job = await c.submit({"kind": "train", "workers": 3})
    async for job, progress in c.watch(job.job_id):
        print(job.state, progress.get("step"))
```
Errors surface as ``NeuroshardError`` with the gRPC status code and a one-line message.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc import aio

from shared import rpc
from shared.client.datasets import (
    UploadRefused,
    entries_from_pb,
    info_from_pb,
    put_file,
    upload_timeout_s,
)
from shared.client.memory import MemoryRouter, RoutingError
from shared.memory.validation import (
    MemoryInputError,
    as_ids,
    validate_reinforce,
    validate_upsert,
)
from shared.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from shared.rpc.codec import f32_from_bytes, ids_from_bytes
from shared.security.transport import ChannelSecurity, explain_unavailable

DEFAULT_ADDRESS = "localhost:50051"


def default_address() -> str:
    """``$NEUROSHARD_COORDINATOR`` or ``localhost:50051``."""
    return os.environ.get("NEUROSHARD_COORDINATOR") or DEFAULT_ADDRESS


class NeuroshardError(Exception):
    """An RPC failed; ``code`` is the gRPC status code, ``str()`` a one-line message."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN) -> None:
        super().__init__(message)
        self.code = code


def _error(
    exc: aio.AioRpcError, address: str, security: ChannelSecurity | None = None
) -> NeuroshardError:
    code = exc.code()
    if code is grpc.StatusCode.UNAVAILABLE:
        details = explain_unavailable(exc.details() or "", security)
        msg = f"cannot reach the coordinator at {address}: {details}"
    elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
        msg = f"the coordinator at {address} did not answer in time"
    else:
        msg = exc.details() or code.name
    return NeuroshardError(msg, code)


@dataclass
class JobInfo:
    """A job as the client sees it; ``state`` is QUEUED/RUNNING/SUCCEEDED/FAILED/CANCELLED."""

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
        return self.state in ("SUCCEEDED", "FAILED", "CANCELLED")

    @classmethod
    def from_pb(cls, pb: coordinator_pb2.Job) -> JobInfo:
        """Build from a Job message (spec and result decoded from JSON)."""
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
        """The document ``submit --json`` prints."""
        return {
            "job_id": self.job_id,
            "state": self.state,
            "kind": self.kind,
            "result": self.result,
            "error": self.error or None,
        }


class Client:
    """Async client of a coordinator (and, for memory operations, of its workers)."""

    def __init__(
        self,
        address: str | None = None,
        timeout_s: float = 30.0,
        max_message_bytes: int = 64 * 1024 * 1024,
        security: ChannelSecurity | None = None,
    ) -> None:
        """``security``: TLS files and token (``shared.security.client_security``); None is
        plaintext without a token."""
        self.address = address or default_address()
        self.timeout_s = timeout_s
        self._max_message_bytes = max_message_bytes
        self._security = security
        self._channel = rpc.channel(self.address, max_message_bytes, security)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._router = MemoryRouter(self._stub, timeout_s, max_message_bytes, security=security)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._router.close()
        await self._channel.close()

    async def _call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return await getattr(self._stub, method)(request, timeout=timeout_s or self.timeout_s)
        except aio.AioRpcError as exc:
            raise _error(exc, self.address, self._security) from None

    async def submit(self, spec: dict[str, Any]) -> JobInfo:
        """Submit a job spec (a dict as in configs/jobs/*.yaml).

        Raises:
            NeuroshardError: INVALID_ARGUMENT (the message names the field), UNAVAILABLE.
        """
        pb = await self._call(
            "SubmitJob", coordinator_pb2.SubmitJobRequest(spec_json=json.dumps(spec))
        )
        return JobInfo.from_pb(pb)

    async def get_job(self, job_id: str) -> JobInfo:
        """Raises: NeuroshardError NOT_FOUND for an unknown id."""
        return JobInfo.from_pb(
            await self._call("GetJob", coordinator_pb2.JobRequest(job_id=job_id))
        )

    async def jobs(self) -> list[JobInfo]:
        reply = await self._call("ListJobs", coordinator_pb2.ListJobsRequest())
        return [JobInfo.from_pb(j) for j in reply.jobs]

    async def cancel(self, job_id: str) -> JobInfo:
        """Raises: NeuroshardError NOT_FOUND for an unknown id."""
        return JobInfo.from_pb(
            await self._call("CancelJob", coordinator_pb2.JobRequest(job_id=job_id))
        )

    async def watch(self, job_id: str) -> AsyncIterator[tuple[JobInfo, dict[str, Any]]]:
        """Yield (job, progress) until the job reaches a terminal state (no overall timeout).

        Raises:
            NeuroshardError: NOT_FOUND, UNAVAILABLE.
        """
        call = self._stub.WatchJob(coordinator_pb2.JobRequest(job_id=job_id))
        try:
            async for event in call:
                yield JobInfo.from_pb(event.job), json.loads(event.progress_json or "{}")
        except aio.AioRpcError as exc:
            raise _error(exc, self.address, self._security) from None

    async def wait(self, job_id: str) -> JobInfo:
        """Block until the job finishes; return its final state."""
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
    ) -> dict[str, Any]:
        """Upload a local ``.npz`` to the coordinator's first data root as ``NAME.npz``; a
        job then names it ``data: {path: NAME.npz}`` (or ``load: NAME.npz``).

        Args:
            path: the file: arrays ``x`` float32 [N, ...] and ``y`` int64 [N] (a training
                set) or ``ids`` and ``strengths`` (a memory set).
            name: ``[A-Za-z0-9][A-Za-z0-9._-]*``, at most 128 characters; default the
                file's stem; a trailing ``.npz`` is dropped.
            replace: overwrite a data set of that name.
            progress: called with each chunk's size in bytes as it is sent.

        Returns:
            ``name``, ``path`` (in the data root), ``bytes``, ``sha256`` (hex), ``kind``
            (``train`` or ``memory``) and ``arrays`` (name, dtype, shape of each).

        Raises:
            NeuroshardError: INVALID_ARGUMENT (no such local file, a bad name, not a valid
                data set), RESOURCE_EXHAUSTED (over the coordinator's max_dataset_bytes),
                ALREADY_EXISTS (the name is taken and ``replace`` is false), UNAVAILABLE.
        """
        p = Path(path)
        if not await asyncio.to_thread(p.is_file):
            raise NeuroshardError(f"{p}: no such file", grpc.StatusCode.INVALID_ARGUMENT)
        size = (await asyncio.to_thread(p.stat)).st_size
        header = coordinator_pb2.DatasetHeader(
            name=p.stem if name is None else name, total_bytes=size, replace=replace
        )
        try:
            info = await put_file(
                self._stub, p, header, progress, upload_timeout_s(self.timeout_s, size)
            )
        except aio.AioRpcError as exc:
            raise _error(exc, self.address, self._security) from None
        except UploadRefused as exc:
            raise NeuroshardError(str(exc), exc.code) from None
        return info_from_pb(info)

    async def list_datasets(self) -> list[dict[str, Any]]:
        """The .npz and .npy files in the coordinator's data roots: ``path`` (relative to
        its root), ``bytes``, ``modified_at`` (unix seconds), ``root`` (index)."""
        return entries_from_pb(
            await self._call("ListDatasets", coordinator_pb2.ListDatasetsRequest())
        )

    async def status(self) -> dict[str, Any]:
        """Cluster status: ``workers`` (name, address, state, device, ...) and job counts."""
        s = await self._call("GetClusterStatus", coordinator_pb2.GetClusterStatusRequest())
        return {
            "workers": [
                {
                    "name": w.name,
                    "address": w.address,
                    "state": common_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_"),
                    "device": w.device,
                    "heartbeat_age_s": round(w.heartbeat_age_s, 3),
                    "memories": w.memories,
                    "slots_primary": w.slots_primary,
                    "slots_replica": w.slots_replica,
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

    async def _routed(self, work: Any) -> Any:
        try:
            return await work
        except RoutingError as exc:
            raise NeuroshardError(str(exc), exc.code) from None
        except aio.AioRpcError as exc:
            raise _error(exc, self.address, self._security) from None

    async def _payload_limit(self) -> int:
        return int((await self._routed(self._router.slot_map())).max_payload_bytes)

    async def upsert(self, ids: Any, strengths: Any, payloads: list[bytes] | None = None) -> int:
        """Insert or overwrite memories; acknowledged once both copies applied them.

        Args:
            ids: [N] uint64 (any integer array of non-negative values).
            strengths: [N] float32 in [0, 1].
            payloads: None, or [N] bytes (b"" removes a payload), each at most the
                cluster's ``max_payload_bytes``.

        Returns:
            Distinct ids written.

        Raises:
            NeuroshardError: INVALID_ARGUMENT naming the field and index (nothing is sent);
                UNAVAILABLE when the batch could not be delivered.
        """

        try:
            ids, strengths, checked = validate_upsert(
                ids, strengths, payloads, await self._payload_limit()
            )
        except MemoryInputError as exc:
            raise NeuroshardError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
        if checked is not None and None in checked:
            # The wire has no "leave this payload alone" per item: b"" removes a payload.
            i = checked.index(None)
            raise NeuroshardError(
                f"payloads[{i}]: None; pass b'' to remove a payload, or payloads=None to "
                "leave every payload alone",
                grpc.StatusCode.INVALID_ARGUMENT,
            )
        plain = None if checked is None else [bytes(p or b"") for p in checked]
        return int(await self._routed(self._router.upsert(ids, strengths, plain)))

    async def reinforce(self, ids: Any, boosts: Any) -> int:
        """Add boosts (finite, >= 0; duplicate ids add up), clip to [0, 1].

        Returns:
            Ids found (unknown ids are skipped).

        Raises:
            NeuroshardError: INVALID_ARGUMENT naming the field and index (nothing is sent).
        """

        try:
            ids, boosts = validate_reinforce(ids, boosts)
        except MemoryInputError as exc:
            raise NeuroshardError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
        return int(await self._routed(self._router.reinforce(ids, boosts)))

    async def delete(self, ids: Any) -> int:
        """Delete memories; return how many existed."""

        try:
            ids = as_ids(ids)
        except MemoryInputError as exc:
            raise NeuroshardError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
        return int(await self._routed(self._router.delete(ids)))

    async def get(
        self, ids: Any, with_payloads: bool = False
    ) -> tuple[np.ndarray, np.ndarray, list[bytes | None]]:
        """Read memories from their primaries.

        Returns:
            found [N] bool, strengths [N] float32 (0 where missing), payloads [N] (None where
            missing or absent; only when ``with_payloads``).
        """

        try:
            ids = as_ids(ids)
        except MemoryInputError as exc:
            raise NeuroshardError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
        return await self._routed(self._router.get(ids, with_payloads))  # type: ignore[no-any-return]

    async def decay(self, rate: float) -> int:
        """Decay every memory: ``s = clip(s - rate, 0, 1)``; return memories decayed.

        Raises:
            NeuroshardError: INVALID_ARGUMENT for a rate outside [0, 1]; UNAVAILABLE.
        """
        reply = await self._call("Decay", coordinator_pb2.DecayRequest(rate=rate))
        return int(reply.memories)

    async def quality(self) -> dict[str, Any]:
        """count, sum, mean, min, max and histogram (10 bins over [0, 1]) of all strengths."""
        q = await self._call("Quality", coordinator_pb2.QualityRequest())
        return {
            "count": q.count,
            "sum": q.sum,
            "mean": q.mean,
            "min": q.min,
            "max": q.max,
            "histogram": list(q.histogram),
        }

    async def topk(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The exact global top-k: ids [k'] uint64 and strengths [k'] float32.

        Raises:
            NeuroshardError: INVALID_ARGUMENT when k <= 0 or above the coordinator's topk_max.
        """
        if k < 1:
            raise NeuroshardError(f"k: {k} must be >= 1", grpc.StatusCode.INVALID_ARGUMENT)
        r = await self._call("TopK", coordinator_pb2.TopKRequest(k=k))
        return ids_from_bytes(r.ids), f32_from_bytes(r.strengths)

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until the cluster has published a slot map with no under-replicated slot."""
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


class SyncClient:
    """Blocking wrapper of ``Client`` for scripts: same methods, no ``await``."""

    def __init__(
        self,
        address: str | None = None,
        timeout_s: float = 30.0,
        security: ChannelSecurity | None = None,
    ) -> None:
        self._runner = asyncio.Runner()
        self._client = self._runner.run(self._make(address, timeout_s, security))

    @staticmethod
    async def _make(
        address: str | None, timeout_s: float, security: ChannelSecurity | None
    ) -> Client:
        return Client(address, timeout_s, security=security)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._runner.run(self._client.close())
        self._runner.close()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr) or name == "watch":
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._runner.run(attr(*args, **kwargs))

        return call

    def watch(self, job_id: str) -> Iterator[tuple[JobInfo, dict[str, Any]]]:
        agen = self._client.watch(job_id).__aiter__()
        while True:
            try:
                yield self._runner.run(_next(agen))
            except StopAsyncIteration:
                return


async def _next(agen: Any) -> Any:
    """``anext`` as a coroutine (``asyncio.Runner.run`` takes coroutines only)."""
    return await agen.__anext__()
