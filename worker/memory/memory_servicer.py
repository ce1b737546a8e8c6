"""Memory-store RPCs of the ``neuroshard.v1.Worker`` service.

Each RPC decodes its request, calls ``MemoryNode``'s public methods, and maps domain errors
to status codes (one table, ``_ERRORS``, applied by ``shared.rpc.status_table``).

Shape letters: N items of a request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
from grpc import aio

from shared.memory.sampling import validate_sample
from shared.memory.slots import SlotMapError, validate_slot_map
from shared.memory.stats import quality_to_pb
from shared.memory.tables import TableNotFound
from shared.memory.validation import (
    MemoryInputError,
    validate_k,
    validate_op_id,
    validate_rate,
    validate_request_id,
)
from shared.proto import common_pb2, worker_pb2
from shared.rpc.codec import (
    CodecError,
    f32_from_bytes,
    f32_to_bytes,
    ids_from_bytes,
    ids_to_bytes,
    rows_from_bytes,
)
from shared.rpc.limits import DEFAULT_MAX_RECEIVE_SLOTS_BYTES, BudgetExceeded
from shared.rpc.status_table import StatusTable
from shared.security.auth import current_principal
from worker.memory.memory_node import CappedTable, SlotSender
from worker.memory.node_holder import NodeHolder, NotReady
from worker.memory.replication import OutOfSync, ReplicationError, StaleForward
from worker.memory.roles import NotPrimary, StaleEpoch
from worker.memory.wire import receive_slots, slot_messages
from worker.registration import RegistrationRefused
from worker.store.journal import StorageFailed

__all__ = ["MemoryServicer"]

_ERRORS = StatusTable(
    [
        (MemoryInputError, grpc.StatusCode.INVALID_ARGUMENT),
        (CodecError, grpc.StatusCode.INVALID_ARGUMENT),
        (StaleEpoch, grpc.StatusCode.FAILED_PRECONDITION),
        (NotPrimary, grpc.StatusCode.FAILED_PRECONDITION),
        (OutOfSync, grpc.StatusCode.ABORTED),
        (StaleForward, grpc.StatusCode.FAILED_PRECONDITION),
        (ReplicationError, grpc.StatusCode.UNAVAILABLE),
        (StorageFailed, grpc.StatusCode.UNAVAILABLE),  # the journal failed: no write acknowledged
        (SlotMapError, grpc.StatusCode.INVALID_ARGUMENT),
        (RegistrationRefused, grpc.StatusCode.FAILED_PRECONDITION),  # a map of another slot count
        (NotReady, grpc.StatusCode.UNAVAILABLE),
        (BudgetExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (TableNotFound, grpc.StatusCode.NOT_FOUND),
        (CappedTable, grpc.StatusCode.FAILED_PRECONDITION),
    ]
)


def _same_length(ids: np.ndarray, **others: np.ndarray | list[bytes] | None) -> None:
    """Raises: MemoryInputError when a per-id field has another length than ``ids``."""
    for name, values in others.items():
        if values is not None and len(values) != len(ids):
            raise MemoryInputError(f"ids and {name} differ in length ({len(ids)} != {len(values)})")


class MemoryServicer:
    """The memory RPCs, served through ``WorkerServicer``."""

    def __init__(
        self,
        nodes: NodeHolder,
        send_slots: SlotSender,
        chunk_bytes: int,
        max_message_bytes: int | None = None,
        max_receive_slots_bytes: int = DEFAULT_MAX_RECEIVE_SLOTS_BYTES,
    ) -> None:
        """Build the memory RPCs over this worker's node and its way of sending copies.

        Args:
            nodes: this worker's memory node (made when the first slot map arrives).
            send_slots: streams slot copies to a peer (``CopySlots``).
            chunk_bytes: target size of one ``SlotData`` message of ``DumpSlots``, bytes.
            max_message_bytes: the largest Get reply, bytes; None: no limit.
            max_receive_slots_bytes: the most bytes one ``ReceiveSlots`` stream may bring.
        """
        self._nodes = nodes
        self._send_slots = send_slots
        self._chunk_bytes = chunk_bytes
        self._max_message_bytes = max_message_bytes
        self._max_receive_slots_bytes = max_receive_slots_bytes

    async def Upsert(
        self, request: worker_pb2.UpsertRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.WriteResponse:
        """Insert or overwrite memories of this worker's primary slots, replicated first.

        The reply comes once every copy applied the write and its record is durable.

        Raises:
            INVALID_ARGUMENT: malformed bytes, lengths that differ, bad values or a
                request_id over 64 bytes (nothing applied). FAILED_PRECONDITION: stale
                epoch, or a slot not primary here.
            UNAVAILABLE: not registered yet, or a copy failed and the coordinator could not
                be told.
        """
        async with _ERRORS.mapped(context):
            validate_request_id(request.request_id)
            ids = ids_from_bytes(request.ids, "ids")
            strengths = f32_from_bytes(request.strengths, "strengths")
            payloads = list(request.payloads) if len(request.payloads) else None
            _same_length(ids, strengths=strengths, payloads=payloads)
            n = await self._nodes.get().upsert(request, ids, strengths, payloads)
            return worker_pb2.WriteResponse(applied=n)

    async def Reinforce(
        self, request: worker_pb2.ReinforceRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.WriteResponse:
        """Add boosts (duplicates sum) and clip to [0, 1]; ``applied`` counts ids found.

        Raises:
            Status codes as ``Upsert``.
        """
        async with _ERRORS.mapped(context):
            validate_request_id(request.request_id)
            ids = ids_from_bytes(request.ids, "ids")
            boosts = f32_from_bytes(request.boosts, "boosts")
            _same_length(ids, boosts=boosts)
            n = await self._nodes.get().reinforce(request, ids, boosts)
            return worker_pb2.WriteResponse(applied=n)

    async def Delete(
        self, request: worker_pb2.DeleteRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.WriteResponse:
        """Delete memories; ``applied`` counts ids found.

        Raises:
            Status codes as ``Upsert``.
        """
        async with _ERRORS.mapped(context):
            validate_request_id(request.request_id)
            ids = ids_from_bytes(request.ids, "ids")
            n = await self._nodes.get().delete(request, ids)
            return worker_pb2.WriteResponse(applied=n)

    async def Get(
        self, request: worker_pb2.GetRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.GetResponse:
        """Read memories from their primary, once per distinct id.

        The reply holds found [M] uint8, strengths [M] float32 and (with_payloads) M
        payloads for the M distinct ids of the request, in the order of their first
        occurrence: for a request without repeated ids, one per id in the request's order.

        Raises:
            INVALID_ARGUMENT: malformed ids. FAILED_PRECONDITION: stale epoch, or a slot not
                primary here. RESOURCE_EXHAUSTED: the reply would exceed max_message_bytes
                (nothing built). UNAVAILABLE: not registered yet.
        """
        async with _ERRORS.mapped(context):
            ids = ids_from_bytes(request.ids, "ids")
            return await self._nodes.get().get(
                request.epoch, ids, request.with_payloads, self._max_message_bytes, request.table
            )

    async def SampleSums(
        self, request: worker_pb2.WorkerSampleSumsRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.WorkerSampleSumsResponse:
        """Phase 1 of a sample: the weight sum of each primary slot, and the version.

        Raises:
            NOT_FOUND: an unknown table. INVALID_ARGUMENT: alpha negative or not finite.
            FAILED_PRECONDITION: stale epoch. UNAVAILABLE: not registered yet.
        """
        async with _ERRORS.mapped(context):
            alpha = validate_sample(1, request.alpha, 1)
            return await self._nodes.get().sample_sums(
                request.epoch, alpha, request.uniform, request.table
            )

    async def SamplePick(
        self, request: worker_pb2.WorkerSamplePickRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.WorkerSamplePickResponse:
        """Phase 2 of a sample: the memories at the draws' offsets, as of the version.

        ``stale`` (and nothing else) when the version is gone or a drawn memory was deleted
        since: the coordinator (or the client) samples again. A client's call (a data-plane
        token) picks at most the map's ``max_sample_batch`` draws, as its ``Sample`` would.

        Raises:
            NOT_FOUND: an unknown table. INVALID_ARGUMENT: malformed slots or offsets, an
                offset past its slot's sum, or a client's draws over ``max_sample_batch``.
                FAILED_PRECONDITION: stale epoch, or a slot not primary here.
                RESOURCE_EXHAUSTED: the reply would exceed max_message_bytes.
        """
        async with _ERRORS.mapped(context):
            slots = rows_from_bytes(request.slots, "slots")
            offsets = ids_from_bytes(request.offsets, "offsets")
            _same_length(slots, offsets=offsets)
            node = self._nodes.get()
            caller = current_principal()
            if caller is not None and not caller.is_daemon and len(slots) > node.client_sample_max:
                raise MemoryInputError(
                    f"n: {len(slots)} draws exceed max_sample_batch {node.client_sample_max}"
                )
            return await node.sample_pick(
                request.epoch,
                request.version,
                slots,
                offsets,
                request.with_payloads,
                self._max_message_bytes,
                request.table,
            )

    async def Decay(
        self, request: worker_pb2.WorkerDecayRequest, context: aio.ServicerContext[Any, Any]
    ) -> common_pb2.DecayResponse:
        """Decay this worker's primary slots (called by the coordinator's fan-out).

        Raises:
            INVALID_ARGUMENT: a rate outside [0, 1]. Otherwise status codes as ``Upsert``.
        """
        async with _ERRORS.mapped(context):
            rate = float(validate_rate(request.rate))
            op_id = validate_op_id(request.op_id)
            n = await self._nodes.get().decay(request.epoch, rate, op_id, request.table)
            return common_pb2.DecayResponse(memories=n)

    async def Quality(
        self, request: worker_pb2.WorkerQualityRequest, context: aio.ServicerContext[Any, Any]
    ) -> common_pb2.QualityStats:
        """Strength statistics of this worker's primary slots.

        Raises:
            FAILED_PRECONDITION: stale epoch. UNAVAILABLE: not registered yet.
        """
        async with _ERRORS.mapped(context):
            q = await self._nodes.get().quality(request.epoch, request.table)
            return quality_to_pb(q)

    async def TopK(
        self, request: worker_pb2.WorkerTopKRequest, context: aio.ServicerContext[Any, Any]
    ) -> common_pb2.TopKResponse:
        """The k strongest memories of this worker's primary slots (ties: smaller id).

        With an ``order`` ("oldest", "weakest"): a capped table's first k memories to evict
        and its count in the primary slots (the coordinator's insert path, never a client's).

        A client's call (a data-plane token; ``SyncClient.topk`` fans out to the primaries)
        gets what the coordinator's ``TopK`` gives it: k at most the map's ``topk_max``, no
        ``order``.

        Raises:
            INVALID_ARGUMENT: k out of range. FAILED_PRECONDITION: stale epoch.
            PERMISSION_DENIED: an ``order`` from a client's token. UNAVAILABLE: not
            registered yet.
        """
        async with _ERRORS.mapped(context):
            node = self._nodes.get()
            caller = current_principal()
            if caller is not None and not caller.is_daemon:
                if request.order:
                    await context.abort(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"TopK: {caller.describe()} may not ask for eviction candidates",
                    )
                validate_k(request.k, node.client_topk_max)
            if request.order:  # a capped table's eviction candidates
                ids, strengths, stamps, count = await node.candidates(
                    request.epoch, request.k, request.order, request.table
                )
                return common_pb2.TopKResponse(
                    ids=ids_to_bytes(ids),
                    strengths=f32_to_bytes(strengths),
                    stamps=ids_to_bytes(stamps),
                    count=count,
                )
            ids, strengths = await node.topk(request.epoch, request.k, request.table)
            return common_pb2.TopKResponse(ids=ids_to_bytes(ids), strengths=f32_to_bytes(strengths))

    async def Sweep(
        self, request: worker_pb2.WorkerSweepRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.WorkerSweepResponse:
        """Decay this worker's primary slots once, then their statistics and local top-k.

        Equal to ``Decay`` followed by ``Quality`` and ``TopK``, in one pass over the
        strengths (called by the coordinator's fan-out).

        Raises:
            INVALID_ARGUMENT: a rate outside [0, 1], an op_id over 64 bytes or k above the
                limit. Otherwise status codes as ``Upsert``.
        """
        async with _ERRORS.mapped(context):
            rate = float(validate_rate(request.rate))
            op_id = validate_op_id(request.op_id)
            n, (q, top) = await self._nodes.get().sweep(
                request.epoch, rate, op_id, request.k, request.want_quality, request.table
            )
            reply = worker_pb2.WorkerSweepResponse(memories=n)
            if q is not None:
                reply.quality.CopyFrom(quality_to_pb(q))
            if top is not None:
                reply.topk.ids, reply.topk.strengths = ids_to_bytes(top[0]), f32_to_bytes(top[1])
            return reply

    async def Replicate(
        self, request: worker_pb2.ReplicateRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.ReplicateResponse:
        """Apply a primary's forwarded mutation in sequence order.

        Raises:
            ABORTED: out of sync (a gap, or a slot primary here). FAILED_PRECONDITION: from an
                older epoch, for no slot held here. INVALID_ARGUMENT: malformed forward.
                UNAVAILABLE: not registered yet.
        """
        async with _ERRORS.mapped(context):
            await self._nodes.get().apply_replicated(request)
            return worker_pb2.ReplicateResponse()

    async def ApplySlotMap(
        self, request: common_pb2.SlotMap, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.ApplySlotMapResponse:
        """Adopt a slot map from the coordinator (older epochs are ignored).

        Raises:
            INVALID_ARGUMENT: a malformed map. FAILED_PRECONDITION: another slot count than
                this worker's data.
        """
        async with _ERRORS.mapped(context):
            validate_slot_map(request)
            epoch = await self._nodes.ensure(request).apply_slot_map(request)
            return worker_pb2.ApplySlotMapResponse(epoch=epoch)

    async def CopySlots(
        self, request: worker_pb2.CopySlotsRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.CopySlotsResponse:
        """Copy slots to another worker (copy, then the coordinator switches the map).

        Under this worker's write order, snapshot each batch of slots, stream it to the
        target and forward later writes of those slots there as well.

        Raises:
            UNAVAILABLE: the target could not be reached, or not registered yet.
        """
        async with _ERRORS.mapped(context):
            memories, nbytes = await self._nodes.get().copy_to(
                request.target, request.target_address, list(request.slots), self._send_slots
            )
            return worker_pb2.CopySlotsResponse(memories=memories, bytes=nbytes)

    async def ReceiveSlots(
        self,
        request_iterator: AsyncIterator[worker_pb2.SlotData],
        context: aio.ServicerContext[Any, Any],
    ) -> worker_pb2.ReceiveSlotsResponse:
        """Install streamed slot copies (each replaces what this worker held for its slot).

        Every chunk is counted against ``max_receive_slots_bytes`` before it is kept, and
        every slot must match its source's count and digest before any is installed.

        Raises:
            INVALID_ARGUMENT: malformed chunks, or a slot whose count or digest differ from
                its source's (nothing installed). RESOURCE_EXHAUSTED: the stream exceeds
                max_receive_slots_bytes (nothing installed). UNAVAILABLE: not registered yet.
        """
        async with _ERRORS.mapped(context):
            snaps = await receive_slots(request_iterator, self._max_receive_slots_bytes)
            return worker_pb2.ReceiveSlotsResponse(
                memories=await self._nodes.get().import_snapshots(snaps)
            )

    async def DumpSlots(
        self, request: worker_pb2.DumpSlotsRequest, context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[worker_pb2.SlotData]:
        """Stream every held slot's data, or the requested slots'.

        Tests and diagnostics compare copies with it. Nothing before the worker has a store.

        Raises:
            INVALID_ARGUMENT: a slot out of range.
        """
        node = self._nodes.current
        if node is None:
            return
        async with _ERRORS.mapped(context):
            snaps = await node.export_slots(list(request.slots), request.table)
        for snap in snaps:
            for msg in slot_messages(snap, self._chunk_bytes, digest=False):
                yield msg

    async def SlotSeqs(
        self, request: worker_pb2.SlotSeqsRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.SlotSeqsResponse:
        """Sequence numbers of slots as held here.

        0 where this worker has no data (also before it has a store).

        Raises:
            INVALID_ARGUMENT: a slot out of range.
        """
        async with _ERRORS.mapped(context):
            node = self._nodes.current
            if node is None:
                return worker_pb2.SlotSeqsResponse(seqs=[0] * len(request.slots))
            return worker_pb2.SlotSeqsResponse(seqs=node.slot_seqs(list(request.slots)))
