"""Client-side routing of memory operations to the slots' primaries.

Keyed operations (upsert, get, delete, reinforce) are validated whole (a refused batch sends
nothing), split stably by primary worker with the cached slot map (and cut to the requests a
worker and gRPC take: ``max_batch_items``, ``max_message_bytes``), sent concurrently, and
the parts a worker refuses because of a stale map (FAILED_PRECONDITION), a failover
(UNAVAILABLE) or an ordering conflict (ABORTED) are retried after refreshing the map. Only
the failed parts wait: the others are acknowledged as their workers answer (``progress``),
and a worker that could not be reached is reported to the coordinator, which probes it and
fails its slots over at once if it is down (instead of after the heartbeat timeout).
Bulk operations (decay, quality, top-k) go to the coordinator, which fans them out.

Shape letters: N batch items, n items of one part (one worker's share of a batch).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn, TypeAlias, TypeVar

import grpc
import numpy as np
import numpy.typing as npt
from grpc import aio

from shared.client.reports import FailureReports, Reporter
from shared.memory.slots import SlotMapError, slot_of, validate_slot_map
from shared.memory.tables import table_name, table_specs
from shared.memory.validation import MAX_REQUEST_ID_BYTES, validate_request_id
from shared.proto import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from shared.rpc.codec import CodecError, f32_from_bytes, f32_to_bytes, ids_from_bytes, ids_to_bytes
from shared.rpc.limits import request_items, split_parts
from shared.rpc.peers import WorkerClients
from shared.security.transport import ChannelSecurity

_RETRY = (
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)

Reply = TypeVar("Reply")
Positions: TypeAlias = npt.NDArray[np.int64]  # [n] positions in the batch
# One keyed RPC: (worker's stub, map epoch, positions of the batch it carries) -> its reply
Call: TypeAlias = Callable[[worker_pb2_grpc.WorkerStub, int, Positions], Awaitable[Reply]]
# One keyed write: (worker's stub, map epoch, request id, positions it carries) -> its reply
Send: TypeAlias = Callable[
    [worker_pb2_grpc.WorkerStub, int, bytes, Positions], Awaitable[worker_pb2.WriteResponse]
]
# Where the router gets the current slot map from
SlotMapSource: TypeAlias = Callable[[], Awaitable[common_pb2.SlotMap]]
# Called with the number of batch items of each part as its worker acknowledges it
Progress: TypeAlias = Callable[[int], None]

# Statuses of a worker that may be down: reported to the coordinator, which probes it
_SUSPECT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class RoutingError(RuntimeError):
    """A batch could not be delivered; ``code`` is the status the client reports.

    The last retryable status when the retry budget ran out; a worker's non-retryable
    status (e.g. INVALID_ARGUMENT); UNAVAILABLE for an unusable slot map; INTERNAL for a
    malformed worker reply.
    """

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        """Keep ``code`` beside the message."""
        super().__init__(message)
        self.code = code


class MemoryRouter:
    """Routes keyed operations to the slots' primaries with a cached slot map.

    The map is fetched on first use and refreshed whenever a part of a batch fails with a
    retryable status (a stale epoch, a failover, a fence). Every part of a batch, and every
    retry of it, carries the batch's request id, so a worker applies a write at most once.
    A part that failed is sent again at once when the refreshed map has a new epoch (the
    failover happened), after a jittered backoff otherwise.
    """

    def __init__(
        self,
        coordinator: coordinator_pb2_grpc.CoordinatorStub | SlotMapSource,
        timeout_s: float,
        max_message_bytes: int,
        retry_budget_s: float = 30.0,
        security: ChannelSecurity | None = None,
        report: Reporter | None = None,
    ) -> None:
        """Route with maps from the coordinator.

        Args:
            coordinator: a coordinator stub (maps from ``GetSlotMap``) or, inside the
                coordinator itself, an async function returning the current map.
            timeout_s: deadline of each RPC, seconds.
            max_message_bytes: message limit of the worker channels, bytes.
            retry_budget_s: how long a batch is retried before ``RoutingError``, seconds.
            security: TLS and token of the caller; None is plaintext. The token goes only to
                the coordinator: worker channels present the data-plane token of the last
                slot map (``SlotMap.data_token``), renewed at half its lifetime; without a
                token (a daemon, known by its certificate) they present none.
            report: tells the coordinator a worker could not be reached; default with a
                coordinator stub: its ``ReportFailure`` (with no reporter: a suspicion the
                coordinator checks with a probe); None with a map source: no reports.
        """
        if isinstance(coordinator, coordinator_pb2_grpc.CoordinatorStub):
            stub = coordinator

            async def fetch() -> common_pb2.SlotMap:
                return await stub.GetSlotMap(coordinator_pb2.GetSlotMapRequest(), timeout=timeout_s)

            async def suspect(worker: str, reason: str) -> object:
                return await stub.ReportFailure(
                    coordinator_pb2.ReportFailureRequest(worker=worker, reason=reason),
                    timeout=timeout_s,
                )

            coordinator, report = fetch, report or suspect
        self._fetch_map: SlotMapSource = coordinator
        self._reports = FailureReports(report)
        self._timeout_s = timeout_s
        self.worker_security = security
        if security is not None and security.token is not None:
            self.worker_security = ChannelSecurity(
                security.tls, self.data_token, security.server_name
            )
        self._workers = WorkerClients(max_message_bytes, self.worker_security)
        self._max_message_bytes = max_message_bytes
        self._map: common_pb2.SlotMap | None = None
        self._renew_at = math.inf  # when the map's data-plane token is half used (Unix s)
        self._retry_budget_s = retry_budget_s

    def data_token(self) -> str:
        """The data-plane token of the cached slot map ("" before the first map)."""
        return self._map.data_token if self._map is not None else ""

    def token_stale(self) -> bool:
        """Whether the data-plane token is past half its lifetime (the next route renews it)."""
        return time.time() >= self._renew_at

    async def close(self) -> None:
        """Close the channels to the workers; reports still in flight are dropped."""
        self._reports.cancel()
        await self._workers.close()

    def worker_stub(self, name: str, address: str) -> worker_pb2_grpc.WorkerStub:
        """The stub of worker ``name`` at ``address`` on the router's channels (its token)."""
        return self._workers.stub(name, address)

    @property
    def cached_map(self) -> common_pb2.SlotMap | None:
        """The slot map routed with now, without fetching one (None before the first)."""
        return self._map

    async def slot_map(self, refresh: bool = False) -> common_pb2.SlotMap:
        """Return the cached slot map, fetching it first when there is none or ``refresh``.

        A map whose data-plane token is past half its lifetime is fetched again too.

        Raises:
            RoutingError: the coordinator sent a map that cannot be routed with (UNAVAILABLE).
        """
        if self._map is None or refresh or self.token_stale():
            fetched_at = time.time()
            self._renew_at = math.inf  # one renewal, not one per concurrent route
            m = await self._fetch_map()
            try:
                validate_slot_map(m)
            except SlotMapError as exc:
                raise RoutingError(
                    f"the coordinator's slot map is unusable: {exc}", grpc.StatusCode.UNAVAILABLE
                ) from None
            self._map = m
            self._renew_at = (
                (fetched_at + m.data_token_expires_at) / 2 if m.data_token else math.inf
            )
        return self._map

    async def table_spec(self, table: str) -> common_pb2.TableSpec:
        """Return the spec of a table from the slot map, fetching a newer map once if needed.

        Raises:
            RoutingError: NOT_FOUND naming the table (not in the coordinator's map either);
                as ``slot_map``.
        """
        name = table_name(table)
        for refresh in (False, True):
            specs = table_specs(await self.slot_map(refresh))
            if name in specs:
                return specs[name]
        raise RoutingError(f"table {name!r} does not exist", grpc.StatusCode.NOT_FOUND)

    async def route(
        self,
        ids: npt.NDArray[np.uint64],
        call: Call[Reply],
        progress: Progress | None = None,
        item_bytes: int | None = None,
    ) -> list[tuple[Positions, Reply]]:
        """Deliver every position of ``ids`` to its slot's primary, retrying failed parts.

        Parts that fail with FAILED_PRECONDITION, UNAVAILABLE, ABORTED or DEADLINE_EXCEEDED
        are retried after a map refresh: at once when the refreshed map has a new epoch,
        else with jittered exponential backoff (20 ms doubling to 500 ms), until
        ``retry_budget_s`` has passed. The other parts are not sent again.

        Args:
            ids: [N] uint64 the batch's ids (their slots choose the workers).
            call: sends one part: ``call(stub, epoch, positions)``.
            progress: called with the size of each part as soon as its worker answered it,
                while other parts may still be waiting (e.g. for a failover).
            item_bytes: bytes of one item of the request, to keep requests within
                ``max_message_bytes`` too (``request_items``); None: parts are cut to the
                map's ``max_batch_items`` only.

        Returns:
            ``(positions [n] int64, reply)`` for each delivered part; the positions of all
            parts together are ``0..N-1``, each once.

        Raises:
            RoutingError: a part still failed when the retry budget ran out, or a worker
                answered with a non-retryable status (e.g. INVALID_ARGUMENT).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._retry_budget_s
        pending = np.arange(len(ids), dtype=np.int64)
        done: list[tuple[Positions, Reply]] = []
        backoff_s = 0.02
        m = await self.slot_map()
        while len(pending):
            failed, last = await self._send_once(m, ids, pending, call, done, progress, item_bytes)
            if not len(failed):
                return done
            if loop.time() > deadline:
                raise RoutingError(
                    f"{len(failed)} of {len(ids)} items not delivered: {last[1]}", last[0]
                )
            pending, sent_epoch = failed, m.epoch
            m = await self.slot_map(refresh=True)
            if m.epoch != sent_epoch:
                backoff_s = 0.02  # the map moved on (e.g. a failover): send again now
                continue
            await asyncio.sleep(backoff_s * random.uniform(0.5, 1.5))
            backoff_s = min(backoff_s * 2, 0.5)
            m = await self.slot_map(refresh=True)
        return done

    async def _send_once(
        self,
        m: common_pb2.SlotMap,
        ids: npt.NDArray[np.uint64],
        pending: Positions,
        call: Call[Reply],
        done: list[tuple[Positions, Reply]],
        progress: Progress | None = None,
        item_bytes: int | None = None,
    ) -> tuple[Positions, tuple[grpc.StatusCode, str]]:
        """Send each pending position once to its primary by map ``m``.

        A part larger than one request may carry (``_request_items``) is cut on slot
        boundaries (``split_parts``).

        Delivered parts are appended to ``done`` (and told to ``progress`` as they arrive);
        workers that look down are reported (``FailureReports``).

        Returns:
            The positions to retry, and the last retryable status and details seen.

        Raises:
            RoutingError: a worker answered with a status that is not retryable.
        """
        if m.slots == 0 or m.epoch == 0:
            return pending, (grpc.StatusCode.UNAVAILABLE, "the cluster has no slot map yet")
        owner = np.asarray(m.primary, np.int64)[slot_of(ids[pending], m.slots)]
        # One scan per owner (-1: unassigned) keeps batch order and, with a handful of
        # workers, costs far less than a stable argsort of the batch (0.5 vs 3 ms at 100k).
        owners = np.flatnonzero(np.bincount(owner + 1)) - 1
        parts = [pending[np.flatnonzero(owner == w)] for w in owners.tolist()]
        calls: list[Awaitable[Reply]] = []
        names: list[str] = []
        limit = self._request_items(m, item_bytes)
        if limit:  # workers refuse larger requests (INVALID_ARGUMENT), gRPC larger messages
            owners, parts = split_parts(owners, parts, limit, lambda p: slot_of(ids[p], m.slots))
        for w, part in zip(owners.tolist(), parts, strict=True):
            if w < 0:
                calls.append(_unassigned())
                names.append("")
            else:
                stub = self._workers.stub(m.workers[w], m.addresses[w])
                calls.append(_told(call(stub, m.epoch, part), len(part), progress))
                names.append(m.workers[w])
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed: list[Positions] = []
        last = (grpc.StatusCode.OK, "")
        for part, name, r in zip(parts, names, results, strict=True):
            if isinstance(r, aio.AioRpcError) and r.code() in _RETRY:
                failed.append(part)
                last = (r.code(), r.details() or r.code().name)
                if name and r.code() in _SUSPECT:
                    self._reports.suspect(name, last[1])
            elif isinstance(r, aio.AioRpcError):
                raise RoutingError(r.details() or r.code().name, r.code())
            elif isinstance(r, BaseException):
                raise r
            else:
                done.append((part, r))
        return (np.concatenate(failed) if failed else np.empty(0, np.int64)), last

    # -- keyed operations -------------------------------------------------------------------

    def _request_items(self, m: common_pb2.SlotMap, item_bytes: int | None) -> int:
        """Most items one request may carry by map ``m`` (0: no limit; ``request_items``)."""
        if item_bytes is None:
            return int(m.max_batch_items)
        return request_items(m.max_batch_items, self._max_message_bytes, item_bytes)

    async def _write(
        self,
        ids: npt.NDArray[np.uint64],
        send: Send,
        request_id: bytes | None,
        progress: Progress | None,
        item_bytes: int,
    ) -> int:
        """Route a keyed write of ``ids`` with ``send``; return the sum of ``applied``.

        One request id serves every part and every retry of the batch: workers dedup by it
        (per slot), so a part sent again after a lost reply is not applied twice. Parts are
        cut on slot boundaries to what one request may carry (``max_batch_items``, and
        ``max_message_bytes`` at ``item_bytes`` per item); a batch where one slot alone has
        more items than that (a hot id) cannot be cut so, and goes instead as consecutive
        chunks of that many items, in batch order, one after the other, chunk c with its own
        request id (``chunk_request_id``: the same on every send of the same batch, so a
        caller re-sending it is still deduplicated chunk by chunk).

        Args:
            ids: [N] uint64.
            send: sends one part; its positions index ``ids``.
            request_id: the batch's request id, when a first try already used one (the
                blocking client's direct call); None: a new random one.
            progress: as ``route``.
            item_bytes: bytes of one item's fixed-size fields in the request.

        Raises:
            RoutingError: as ``route``.
        """
        rid = validate_request_id(request_id) if request_id else uuid.uuid4().bytes
        m = await self.slot_map()
        step = self._request_items(m, item_bytes)
        chunks = [(0, len(ids))]
        if len(ids) > step and (not m.slots or np.bincount(slot_of(ids, m.slots)).max() > step):
            chunks = [(a, min(a + step, len(ids))) for a in range(0, len(ids), step)]
        applied = 0
        for c, (start, stop) in enumerate(chunks):
            chunk_rid = chunk_request_id(rid, c)

            async def call(
                stub: worker_pb2_grpc.WorkerStub,
                epoch: int,
                idx: Positions,
                start: int = start,
                chunk_rid: bytes = chunk_rid,
            ) -> worker_pb2.WriteResponse:
                return await send(stub, epoch, chunk_rid, idx + start)

            routed = await self.route(ids[start:stop], call, progress, item_bytes)
            applied += sum(int(r.applied) for _, r in routed)
        return applied

    async def upsert(
        self,
        ids: npt.NDArray[np.uint64],
        strengths: npt.NDArray[np.float32],
        payloads: list[bytes] | None,
        request_id: bytes | None = None,
        progress: Progress | None = None,
        table: str = "",
        stamps: npt.NDArray[np.uint64] | None = None,
    ) -> int:
        """Upsert a validated batch; return the distinct ids written.

        Args:
            ids: [N] uint64.
            strengths: [N] float32 in [0, 1].
            payloads: N payloads (b"" removes one), or None to leave payloads alone.
            request_id: the write's id (a caller re-sending it after a crash passes the
                same one: slots that applied it skip it); None: a new random one.
            progress: as ``route``.
            table: the table written, as on the wire ("": the default one).
            stamps: [N] uint64 insert stamps (the coordinator's, for a capped table); None:
                none.

        Raises:
            RoutingError: as ``route``.
        """

        async def send(
            stub: worker_pb2_grpc.WorkerStub, epoch: int, rid: bytes, idx: Positions
        ) -> worker_pb2.WriteResponse:
            part = [payloads[i] for i in idx.tolist()] if payloads is not None else None
            return await stub.Upsert(
                upsert_request(
                    epoch,
                    rid,
                    ids[idx],
                    strengths[idx],
                    part,
                    table,
                    None if stamps is None else stamps[idx],
                ),
                timeout=self._timeout_s,
            )

        return await self._write(ids, send, request_id, progress, item_bytes=12)

    async def update_strengths(
        self,
        ids: npt.NDArray[np.uint64],
        strengths: npt.NDArray[np.float32],
        request_id: bytes | None = None,
        progress: Progress | None = None,
        table: str = "",
    ) -> int:
        """Set the strengths of stored memories (a priority update); return the ids found.

        An Upsert with ``existing_only``: payloads are kept, absent ids skipped.

        Args:
            ids: [N] uint64; the last occurrence of an id wins.
            strengths: [N] float32 in [0, 1].
            request_id: as ``_write``.
            progress: as ``route``.
            table: as ``upsert``.

        Raises:
            RoutingError: as ``route``.
        """

        async def send(
            stub: worker_pb2_grpc.WorkerStub, epoch: int, rid: bytes, idx: Positions
        ) -> worker_pb2.WriteResponse:
            request = upsert_request(epoch, rid, ids[idx], strengths[idx], None, table)
            request.existing_only = True
            return await stub.Upsert(request, timeout=self._timeout_s)

        return await self._write(ids, send, request_id, progress, item_bytes=12)

    async def reinforce(
        self,
        ids: npt.NDArray[np.uint64],
        boosts: npt.NDArray[np.float32],
        request_id: bytes | None = None,
        progress: Progress | None = None,
        table: str = "",
    ) -> int:
        """Reinforce with a validated batch; return the ids found.

        Args:
            ids: [N] uint64; duplicates add their boosts.
            boosts: [N] float32, finite and >= 0.
            request_id: as ``_write``.
            progress: as ``route``.
            table: as ``upsert``.

        Raises:
            RoutingError: as ``route``.
        """

        async def send(
            stub: worker_pb2_grpc.WorkerStub, epoch: int, rid: bytes, idx: Positions
        ) -> worker_pb2.WriteResponse:
            return await stub.Reinforce(
                reinforce_request(epoch, rid, ids[idx], boosts[idx], table),
                timeout=self._timeout_s,
            )

        return await self._write(ids, send, request_id, progress, item_bytes=12)

    async def delete(
        self,
        ids: npt.NDArray[np.uint64],
        request_id: bytes | None = None,
        progress: Progress | None = None,
        table: str = "",
    ) -> int:
        """Delete memories; return how many existed.

        Args:
            ids: [N] uint64.
            request_id: as ``_write``.
            progress: as ``route``.
            table: as ``upsert``.

        Raises:
            RoutingError: as ``route``.
        """

        async def send(
            stub: worker_pb2_grpc.WorkerStub, epoch: int, rid: bytes, idx: Positions
        ) -> worker_pb2.WriteResponse:
            return await stub.Delete(
                worker_pb2.DeleteRequest(
                    epoch=epoch, request_id=rid, ids=ids_to_bytes(ids[idx]), table=table
                ),
                timeout=self._timeout_s,
            )

        return await self._write(ids, send, request_id, progress, item_bytes=8)

    async def get(
        self, ids: npt.NDArray[np.uint64], with_payloads: bool, table: str = ""
    ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.float32], list[bytes | None]]:
        """Read memories from their primaries.

        Args:
            ids: [N] uint64.
            with_payloads: also fetch the payloads.
            table: the table read, as on the wire ("": the default one).

        Returns:
            found [N] bool, strengths [N] float32 (0 where missing), and N payloads (None
            where missing, empty, or not asked for).

        Raises:
            RoutingError: as ``route``, or INTERNAL for a malformed worker reply.
        """
        # Workers answer each distinct id once: send each once, and map back to ids' order.
        distinct, back = distinct_ids(ids)

        async def call(
            stub: worker_pb2_grpc.WorkerStub, epoch: int, idx: Positions
        ) -> worker_pb2.GetResponse:
            return await stub.Get(
                worker_pb2.GetRequest(
                    epoch=epoch,
                    ids=ids_to_bytes(distinct[idx]),
                    with_payloads=with_payloads,
                    table=table,
                ),
                timeout=self._timeout_s,
            )

        result = get_result(len(distinct), await self.route(distinct, call), with_payloads)
        return expand_result(result, back)


def chunk_request_id(request_id: bytes, chunk: int) -> bytes:
    """The request id of chunk ``chunk`` of a write sent in chunks (``MemoryRouter._write``).

    Chunk 0 keeps the batch's id; chunk c > 0 appends ``.c`` (``job/3/reinforce`` ->
    ``job/3/reinforce.1``), or, when that would exceed ``MAX_REQUEST_ID_BYTES``, is the
    BLAKE2b digest (16 bytes) of the appended form. A pure function of its arguments, so a
    batch sent again gets the same ids.

    Args:
        request_id: the batch's request id, at most ``MAX_REQUEST_ID_BYTES``.
        chunk: the chunk's index, from 0.
    """
    if chunk == 0:
        return request_id
    chunk_id = request_id + f".{chunk}".encode()
    if len(chunk_id) <= MAX_REQUEST_ID_BYTES:
        return chunk_id
    return hashlib.blake2b(chunk_id, digest_size=16).digest()


def upsert_request(
    epoch: int,
    rid: bytes,
    ids: npt.NDArray[np.uint64],
    strengths: npt.NDArray[np.float32],
    payloads: Sequence[bytes] | None,
    table: str = "",
    stamps: npt.NDArray[np.uint64] | None = None,
) -> worker_pb2.UpsertRequest:
    """One worker's Upsert: ids [n] uint64, strengths [n] float32, payloads (n or None).

    ``table`` as on the wire ("": the default one); ``stamps`` [n] uint64 or None.
    """
    return worker_pb2.UpsertRequest(
        epoch=epoch,
        request_id=rid,
        ids=ids_to_bytes(ids),
        strengths=f32_to_bytes(strengths),
        payloads=list(payloads) if payloads is not None else [],
        table=table,
        stamps=b"" if stamps is None else ids_to_bytes(stamps),
    )


def reinforce_request(
    epoch: int,
    rid: bytes,
    ids: npt.NDArray[np.uint64],
    boosts: npt.NDArray[np.float32],
    table: str = "",
) -> worker_pb2.ReinforceRequest:
    """One worker's Reinforce: ids [n] uint64, boosts [n] float32 (finite, >= 0), a table."""
    return worker_pb2.ReinforceRequest(
        epoch=epoch,
        request_id=rid,
        ids=ids_to_bytes(ids),
        boosts=f32_to_bytes(boosts),
        table=table,
    )


def get_result(
    n: int, parts: list[tuple[Positions, worker_pb2.GetResponse]], with_payloads: bool
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.float32], list[bytes | None]]:
    """Put the workers' Get replies of a batch of n ids back in batch order.

    Args:
        n: the batch's size.
        parts: ``(positions [n'] int64, reply)`` per worker; all positions are ``0..n-1``.
        with_payloads: the payloads were asked for.

    Returns:
        found [n] bool, strengths [n] float32 (0 where missing), and n payloads (None where
        missing, empty, or not asked for).

    Raises:
        RoutingError: a malformed reply (INTERNAL).
    """
    found = np.zeros(n, bool)
    strengths = np.zeros(n, np.float32)
    payloads: list[bytes | None] = [None] * n
    for idx, r in parts:
        f, s = _get_reply(r, len(idx), with_payloads)
        found[idx] = f
        strengths[idx] = s
        if with_payloads:
            for i, p, ok in zip(idx.tolist(), r.payloads, f.tolist(), strict=True):
                payloads[i] = p if ok and p else None
    return found, strengths, payloads


def distinct_ids(
    ids: npt.NDArray[np.uint64],
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.intp] | None]:
    """The ids to send a Get for, each once, and how to map the answers back.

    Args:
        ids: [N] uint64.

    Returns:
        ``(ids, None)`` when no id repeats (the common case: a sort, ~1 ms at 100k ids,
        instead of ``np.unique``'s ~6 ms and the mapping back); else the M distinct ids
        (sorted) and [N] the index of each original id among them.
    """
    if len(ids) < 2:
        return ids, None
    sorted_N = np.sort(ids)
    if not bool((sorted_N[1:] == sorted_N[:-1]).any()):
        return ids, None
    distinct, back = np.unique(ids, return_inverse=True)
    return distinct, back.reshape(-1)


def expand_result(
    result: tuple[npt.NDArray[np.bool_], npt.NDArray[np.float32], list[bytes | None]],
    back: npt.NDArray[np.intp] | None,
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.float32], list[bytes | None]]:
    """Map a Get result over M distinct ids back to the N ids they came from.

    Args:
        result: found [M] bool, strengths [M] float32, M payloads.
        back: [N] index into the distinct ids of each original id (``distinct_ids``), or
            None when the ids were distinct already (the result is returned as it is).

    Returns:
        found [N] bool, strengths [N] float32 and N payloads, in the original order.
    """
    if back is None:
        return result
    found, strengths, payloads = result
    return found[back], strengths[back], [payloads[i] for i in back.tolist()]


def _get_reply(
    r: worker_pb2.GetResponse, n: int, with_payloads: bool
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.float32]]:
    """``(found [n] bool, strengths [n] float32)`` of a worker's GetResponse for n ids.

    Raises:
        RoutingError: the reply does not hold n of each (INTERNAL: a worker bug).
    """
    try:
        s = f32_from_bytes(r.strengths, "strengths")
    except CodecError as exc:
        raise RoutingError(f"a worker's Get reply: {exc}", grpc.StatusCode.INTERNAL) from None
    payloads = len(r.payloads) if with_payloads else n
    if len(r.found) != n or len(s) != n or payloads != n:
        raise RoutingError(
            f"a worker answered Get for {n} ids with {len(r.found)} found flags, {len(s)} "
            f"strengths and {len(r.payloads)} payloads",
            grpc.StatusCode.INTERNAL,
        )
    return np.frombuffer(r.found, np.uint8).astype(bool), s


async def _told(call: Awaitable[Reply], n: int, progress: Progress | None) -> Reply:
    """Await one part's call; on success tell ``progress`` its ``n`` items arrived."""
    reply = await call
    if progress is not None:
        progress(n)
    return reply


async def _unassigned() -> NoReturn:
    """Fail like a call to a worker that is down: the slot has no primary in this map."""
    raise aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        aio.Metadata(),
        aio.Metadata(),
        details="slot has no primary yet",
    )


__all__ = ["MemoryRouter", "Progress", "RoutingError", "get_result", "ids_from_bytes"]
