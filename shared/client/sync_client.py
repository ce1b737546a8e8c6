"""``SyncClient``: the blocking wrapper of ``Client`` for scripts."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np
import numpy.typing as npt

from shared.client.async_client import (
    Client,
    JobInfo,
    NeuroshardError,
    _checked_upsert,
    _next,
    _quality_dict,
    _refused_input,
    _wire,
)
from shared.client.datasets import CHUNK_BYTES as UPLOAD_CHUNK_BYTES
from shared.client.direct import CoordinatorPath, DirectFailed, DirectPath
from shared.client.memory import (
    RoutingError,
    distinct_ids,
    expand_result,
    get_result,
    reinforce_request,
    upsert_request,
)
from shared.client.store_io import ExportProgress
from shared.client.table_reads import direct_quality, direct_topk
from shared.memory.export_file import IMPORT_BATCH
from shared.memory.stats import quality_to_pb
from shared.memory.tables import DEFAULT_TABLE, table_name
from shared.memory.validation import as_ids, validate_reinforce
from shared.proto import common_pb2, coordinator_pb2, worker_pb2
from shared.rpc.codec import f32_from_bytes, ids_from_bytes, ids_to_bytes
from shared.security.transport import ChannelSecurity

T = TypeVar("T")


class SyncClient:
    """Blocking wrapper of ``Client`` for scripts: the same methods, without ``await``.

    It runs its own event loop (``asyncio.Runner``), so it cannot be used from inside a
    running loop; use ``Client`` there. Each method is documented on ``Client``.

    A keyed request whose ids all have one primary in the cached slot map (any single id)
    is sent on a blocking channel from the calling thread (``shared.client.direct``), which
    saves the event loop's turn around the round trip; on a stale map or a failover it is
    sent again the async way, with the same request id.
    """

    def __init__(
        self,
        address: str | None = None,
        timeout_s: float = 30.0,
        security: ChannelSecurity | None = None,
    ) -> None:
        """Start the event loop and a ``Client(address, timeout_s, security=security)``."""
        self._runner = asyncio.Runner()
        self._client = self._runner.run(self._make(address, timeout_s, security))
        # Workers get the data-plane token of the router's map, never the caller's own token.
        self._direct = DirectPath(
            self._client._max_message_bytes, self._client._router.worker_security
        )
        self._reads = CoordinatorPath(
            self._client.address, self._client._max_message_bytes, security
        )

    @staticmethod
    async def _make(
        address: str | None, timeout_s: float, security: ChannelSecurity | None
    ) -> Client:
        """Make the client inside the loop (grpc.aio channels bind to the running loop)."""
        return Client(address, timeout_s, security=security)

    def _run(self, work: Coroutine[Any, Any, T]) -> T:
        return self._runner.run(work)

    def __enter__(self) -> SyncClient:
        """Return the client itself; leaving the block closes it."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the client."""
        self.close()

    def close(self) -> None:
        """Close the channels and the event loop."""
        self._direct.close()
        self._reads.close()
        self._runner.run(self._client.close())
        self._runner.close()

    def _direct_call(self, ids: npt.NDArray[np.uint64], send: Callable[..., T]) -> T | None:
        """Send a request for ``ids`` on the direct path when one primary holds them all.

        Args:
            ids: [N] uint64, validated.
            send: ``send(stub, epoch, metadata)`` makes the blocking call.

        Returns:
            The reply; None when the async router must take the request (no cached map,
            several primaries, or a status it retries).

        Raises:
            NeuroshardError: the worker refused the request (a status not retried).
        """
        m = self._client._router.cached_map
        w = self._direct.owner(m, ids)
        if m is None or w is None or self._client._router.token_stale():
            return None
        try:
            return self._direct.call(m, w, send)
        except DirectFailed as exc:
            raise NeuroshardError(str(exc), exc.code) from None

    def __getattr__(self, name: str) -> Any:
        """Reach the rest of ``Client``: attributes as they are, coroutines run to the end."""
        attr = getattr(self._client, name)
        if not callable(attr) or name == "watch":
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._runner.run(attr(*args, **kwargs))

        return call

    def submit(self, spec: dict[str, Any]) -> JobInfo:
        """Submit a job spec (see ``Client.submit``)."""
        return self._run(self._client.submit(spec))

    def get_job(self, job_id: str) -> JobInfo:
        """Return a job's current state (see ``Client.get_job``)."""
        return self._run(self._client.get_job(job_id))

    def jobs(self) -> list[JobInfo]:
        """List the jobs the caller may see (see ``Client.jobs``)."""
        return self._run(self._client.jobs())

    def cancel(self, job_id: str) -> JobInfo:
        """Cancel a job (see ``Client.cancel``)."""
        return self._run(self._client.cancel(job_id))

    def run_epochs(self, job_id: str, epochs: int = 1) -> int:
        """Grant a paced job more epochs (see ``Client.run_epochs``)."""
        return self._run(self._client.run_epochs(job_id, epochs))

    def finish(self, job_id: str) -> JobInfo:
        """End a paced job at its next epoch boundary (see ``Client.finish``)."""
        return self._run(self._client.finish(job_id))

    def watch(self, job_id: str) -> Iterator[tuple[JobInfo, dict[str, Any]]]:
        """Follow a job until it ends (see ``Client.watch``).

        Yields:
            ``(job, progress)`` at every event.
        """
        agen = self._client.watch(job_id).__aiter__()
        while True:
            try:
                yield self._runner.run(_next(agen))
            except StopAsyncIteration:
                return

    def wait(self, job_id: str) -> JobInfo:
        """Wait until a job ends; return its final state (see ``Client.wait``)."""
        return self._run(self._client.wait(job_id))

    def put_dataset(
        self,
        path: str | os.PathLike[str],
        name: str | None = None,
        replace: bool = False,
        progress: Callable[[int], None] | None = None,
        chunk_bytes: int = UPLOAD_CHUNK_BYTES,
    ) -> dict[str, Any]:
        """Upload a local ``.npz`` to the coordinator (see ``Client.put_dataset``)."""
        return self._run(self._client.put_dataset(path, name, replace, progress, chunk_bytes))

    def list_datasets(self) -> list[dict[str, Any]]:
        """List the files in the coordinator's data roots (see ``Client.list_datasets``)."""
        return self._run(self._client.list_datasets())

    def get_model(
        self,
        job_id: str,
        path: str | os.PathLike[str],
        best: bool = False,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Write a train job's saved model to ``path`` (see ``Client.get_model``)."""
        return self._run(self._client.get_model(job_id, path, best, timeout_s))

    def list_models(self) -> list[dict[str, Any]]:
        """List the jobs with a saved model (see ``Client.list_models``)."""
        return self._run(self._client.list_models())

    def status(self) -> dict[str, Any]:
        """Return the cluster's status (see ``Client.status``)."""
        return self._run(self._client.status())

    def upsert(
        self,
        ids: npt.ArrayLike,
        strengths: npt.ArrayLike,
        payloads: Sequence[bytes] | None = None,
        table: str = DEFAULT_TABLE,
    ) -> int:
        """Insert or overwrite memories; return distinct ids written (see ``Client.upsert``)."""
        m = self._client._router.cached_map
        # The first call fetches the map (and its payload limit); other tables than the
        # default one go the routed way, which checks the table against the map.
        if m is None or table_name(table) != DEFAULT_TABLE:
            return self._run(self._client.upsert(ids, strengths, payloads, table=table))
        ids_N, strengths_N, plain = _checked_upsert(ids, strengths, payloads, m.max_payload_bytes)
        rid = uuid.uuid4().bytes
        reply = self._direct_call(
            ids_N,
            lambda stub, epoch, md: stub.Upsert(
                upsert_request(epoch, rid, ids_N, strengths_N, plain),
                timeout=self._client.timeout_s,
                metadata=md,
            ),
        )
        if reply is not None:
            return int(reply.applied)
        router = self._client._router
        return int(self._run(self._client._routed(router.upsert(ids_N, strengths_N, plain, rid))))

    def reinforce(
        self, ids: npt.ArrayLike, boosts: npt.ArrayLike, table: str = DEFAULT_TABLE
    ) -> int:
        """Add boosts to stored strengths; return ids found (see ``Client.reinforce``)."""
        if table_name(table) != DEFAULT_TABLE:
            return self._run(self._client.reinforce(ids, boosts, table=table))
        with _refused_input():
            ids_N, boosts_N = validate_reinforce(ids, boosts)
        rid = uuid.uuid4().bytes
        reply = self._direct_call(
            ids_N,
            lambda stub, epoch, md: stub.Reinforce(
                reinforce_request(epoch, rid, ids_N, boosts_N),
                timeout=self._client.timeout_s,
                metadata=md,
            ),
        )
        if reply is not None:
            return int(reply.applied)
        router = self._client._router
        return int(self._run(self._client._routed(router.reinforce(ids_N, boosts_N, rid))))

    def delete(self, ids: npt.ArrayLike, table: str = DEFAULT_TABLE) -> int:
        """Delete memories; return how many existed (see ``Client.delete``)."""
        if table_name(table) != DEFAULT_TABLE:
            return self._run(self._client.delete(ids, table=table))
        with _refused_input():
            ids_N = as_ids(ids)
        rid = uuid.uuid4().bytes
        reply = self._direct_call(
            ids_N,
            lambda stub, epoch, md: stub.Delete(
                worker_pb2.DeleteRequest(epoch=epoch, request_id=rid, ids=ids_to_bytes(ids_N)),
                timeout=self._client.timeout_s,
                metadata=md,
            ),
        )
        if reply is not None:
            return int(reply.applied)
        return int(self._run(self._client._routed(self._client._router.delete(ids_N, rid))))

    def get(
        self, ids: npt.ArrayLike, with_payloads: bool = False, table: str = DEFAULT_TABLE
    ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.float32], list[bytes | None]]:
        """Read memories: found, strengths, payloads (see ``Client.get``)."""
        if table_name(table) != DEFAULT_TABLE:
            return self._run(self._client.get(ids, with_payloads, table))
        with _refused_input():
            ids_N = as_ids(ids)
        # Workers answer each distinct id once: send each once, and map back to ids' order.
        distinct_M, back_N = distinct_ids(ids_N)
        reply = self._direct_call(
            distinct_M,
            lambda stub, epoch, md: stub.Get(
                worker_pb2.GetRequest(
                    epoch=epoch, ids=ids_to_bytes(distinct_M), with_payloads=with_payloads
                ),
                timeout=self._client.timeout_s,
                metadata=md,
            ),
        )
        if reply is None:
            return self._run(self._client.get(ids_N, with_payloads))
        try:
            result = get_result(
                len(distinct_M), [(np.arange(len(distinct_M)), reply)], with_payloads
            )
        except RoutingError as exc:
            raise NeuroshardError(str(exc), exc.code) from None
        return expand_result(result, back_N)

    def decay(self, rate: float, op_id: bytes | None = None, table: str = DEFAULT_TABLE) -> int:
        """Decay every memory by ``rate`` once; return memories decayed (see ``Client.decay``)."""
        return self._run(self._client.decay(rate, op_id, table))

    def quality(self, table: str = DEFAULT_TABLE) -> dict[str, Any]:
        """Summarize every strength of a table (see ``Client.quality``).

        Fanned out to the primaries of the cached slot map and merged here
        (``shared.client.table_reads``). When the map does not serve, one blocking call to
        the coordinator (``CoordinatorPath``); the async client's channel, with gRPC's
        retries, when the coordinator was unreachable.
        """
        router = self._client._router
        timeout_s = self._client.timeout_s
        direct = self._run(self._client._routed(direct_quality(router, _wire(table), timeout_s)))
        if direct is not None:
            return _quality_dict(quality_to_pb(direct))
        request = coordinator_pb2.QualityRequest(table=_wire(table))
        reply = self._read("Quality", request, common_pb2.QualityStats)
        if reply is None:
            return self._run(self._client.quality(table))
        return _quality_dict(reply)

    def topk(
        self, k: int, table: str = DEFAULT_TABLE
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]:
        """Return the exact global top-k ids and strengths (see ``Client.topk``).

        From the primaries, else one blocking call to the coordinator, as ``quality``.
        """
        if k < 1:
            return self._run(self._client.topk(k, table))  # its INVALID_ARGUMENT
        router = self._client._router
        timeout_s = self._client.timeout_s
        direct = self._run(self._client._routed(direct_topk(router, k, _wire(table), timeout_s)))
        if direct is not None:
            return direct
        request = coordinator_pb2.TopKRequest(k=k, table=_wire(table))
        reply = self._read("TopK", request, common_pb2.TopKResponse)
        if reply is None:
            return self._run(self._client.topk(k, table))
        return ids_from_bytes(reply.ids), f32_from_bytes(reply.strengths)

    def _read(self, method: str, request: Any, reply: type[T]) -> T | None:
        """A coordinator read on the blocking channel; None: take the async channel.

        Raises:
            NeuroshardError: the coordinator refused it (a status other than UNAVAILABLE).
        """
        try:
            return self._reads.call(method, request, reply, self._client.timeout_s)
        except DirectFailed as exc:
            if exc.code is grpc.StatusCode.DEADLINE_EXCEEDED:
                address = self._client.address
                raise NeuroshardError(
                    f"the coordinator at {address} did not answer in time", exc.code
                ) from None
            raise NeuroshardError(str(exc), exc.code) from None

    def sweep(
        self,
        rate: float,
        k: int = 0,
        want_quality: bool = True,
        op_id: bytes | None = None,
        table: str = DEFAULT_TABLE,
    ) -> tuple[int, dict[str, Any] | None, npt.NDArray[np.uint64], npt.NDArray[np.float32]]:
        """Decay once, then quality and top-k in one call (see ``Client.sweep``)."""
        return self._run(self._client.sweep(rate, k, want_quality, op_id, table))

    def create_table(
        self,
        name: str,
        capacity: int = 0,
        eviction: str = "fifo",
        max_payload_bytes: int = 0,
        forget_below: float | None = None,
    ) -> dict[str, Any]:
        """Create a replay table (see ``Client.create_table``)."""
        return self._run(
            self._client.create_table(name, capacity, eviction, max_payload_bytes, forget_below)
        )

    def list_tables(self) -> list[dict[str, Any]]:
        """List the replay tables (see ``Client.list_tables``)."""
        return self._run(self._client.list_tables())

    def drop_table(self, name: str) -> None:
        """Drop a replay table (see ``Client.drop_table``)."""
        self._run(self._client.drop_table(name))

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until no slot is under-replicated (see ``Client.wait_ready``)."""
        self._run(self._client.wait_ready(timeout_s))

    def export_memories(
        self,
        path: str | os.PathLike[str],
        progress: ExportProgress | None = None,
        timeout_s: float | None = None,
        table: str = DEFAULT_TABLE,
    ) -> dict[str, Any]:
        """Write a table to an ``.npz`` (see ``Client.export_memories``)."""
        return self._run(self._client.export_memories(path, progress, timeout_s, table))

    def import_memories(
        self,
        path: str | os.PathLike[str],
        batch: int = IMPORT_BATCH,
        progress: Callable[[int], None] | None = None,
        checked: Callable[[int], None] | None = None,
        table: str = DEFAULT_TABLE,
    ) -> dict[str, Any]:
        """Upsert an export file into a table (see ``Client.import_memories``)."""
        return self._run(self._client.import_memories(path, batch, progress, checked, table))

    def forget_worker(self, name: str, confirm: bool = False) -> dict[str, Any]:
        """Forget a DEAD worker (see ``Client.forget_worker``)."""
        return self._run(self._client.forget_worker(name, confirm))
