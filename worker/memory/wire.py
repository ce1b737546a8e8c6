"""The worker's wire messages built from domain data and back.

The part of a keyed write or a forward that touches some slots, and slot copies as streams
of ``SlotData`` chunks: cut by bytes (memories, payloads and request ids counted), bounded by
the receiver before they are kept, and verified against the count and digest the source
computed before they are installed.

Bulk fields are raw little-endian bytes (``shared/rpc/codec.py``): ids uint64, values float32.

Shape letters: N items of a keyed request, T slots of a forward, n memories of a slot.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.memory.slots import slot_of
from shared.memory.tables import DEFAULT_TABLE, table_name
from shared.memory.validation import MemoryInputError, validate_request_id
from shared.proto import worker_pb2
from shared.rpc.chunking import byte_ranges, memory_sizes
from shared.rpc.codec import f32_from_bytes, f32_to_bytes, ids_from_bytes, ids_to_bytes
from shared.rpc.limits import BudgetExceeded
from worker.store.journal_format import stamps_bytes, stamps_dict
from worker.store.store import SlotSnapshot

__all__ = [
    "CopyMismatch",
    "narrow",
    "receive_slots",
    "slot_digest",
    "slot_messages",
    "sub_request",
]


def sub_request(op: str, request: Any, keep: np.ndarray) -> Any:
    """Return the items of a keyed request where ``keep`` is set, in order.

    Args:
        op: "upsert", "reinforce" or "delete".
        request: the op's request message (a decoded one: bulk fields whole values).
        keep: [N] bool over the request's items.

    Raises:
        CodecError: the request's bulk fields are not whole values (INVALID_ARGUMENT).
    """
    rid = request.request_id
    ids = ids_to_bytes(ids_from_bytes(request.ids)[keep])
    if op == "upsert":
        payloads = (
            [p for p, k in zip(request.payloads, keep.tolist(), strict=True) if k]
            if len(request.payloads)
            else []
        )
        return worker_pb2.UpsertRequest(
            epoch=request.epoch,
            ids=ids,
            payloads=payloads,
            request_id=rid,
            strengths=f32_to_bytes(f32_from_bytes(request.strengths, "strengths")[keep]),
            table=request.table,
            stamps=ids_to_bytes(ids_from_bytes(request.stamps)[keep]) if request.stamps else b"",
            existing_only=request.existing_only,
        )
    if op == "reinforce":
        return worker_pb2.ReinforceRequest(
            epoch=request.epoch,
            ids=ids,
            request_id=rid,
            boosts=f32_to_bytes(f32_from_bytes(request.boosts, "boosts")[keep]),
            table=request.table,
        )
    return worker_pb2.DeleteRequest(
        epoch=request.epoch, ids=ids, request_id=rid, table=request.table
    )


def narrow(
    req: worker_pb2.ReplicateRequest, keep_slots: np.ndarray, num_slots: int
) -> worker_pb2.ReplicateRequest:
    """Return the part of a forward that touches the slots where ``keep_slots`` is set.

    That is those slots and their seqs, and (for keyed ops) the items in them.

    Args:
        req: a forward with one seq per slot and an op.
        keep_slots: [T] bool over the forward's slots.
        num_slots: S, the cluster's slot count.

    Raises:
        CodecError: the op's ids are not whole uint64 values (INVALID_ARGUMENT).
    """
    op = req.WhichOneof("op")
    assert op is not None  # checked by the caller
    slots = np.asarray(req.slots, np.int64)
    sub = getattr(req, op)
    if op != "decay":
        keep = np.isin(slot_of(ids_from_bytes(sub.ids), num_slots), slots[keep_slots])
        sub = sub_request(op, sub, keep)
    return worker_pb2.ReplicateRequest(
        primary=req.primary,
        epoch=req.epoch,
        slots=slots[keep_slots].tolist(),
        seqs=np.asarray(req.seqs, np.uint64)[keep_slots].tolist(),
        **{op: sub},
    )


def slot_digest(snap: SlotSnapshot) -> bytes:
    """Return the SHA-256 of a slot's whole content, the copy's checksum (``SlotData.digest``).

    Over, in this order: the slot (uint32), seq (uint64) and memory count n (uint64); ids
    [n] uint64 and strengths [n] float32 as sent (key order); each payload in ids order as
    (id uint64, length uint64, bytes); the request-id count (uint64) and each request id as
    (length uint64, bytes). Integers little-endian. A part of a table other than the default
    one starts with the table's name (length uint64, UTF-8).

    Args:
        snap: the slot, ids in key order (as ``SlotStore.export_slot`` gives them).
    """
    h = hashlib.sha256(b"neuroshard-slot-v1")
    if snap.table != DEFAULT_TABLE:
        name = snap.table.encode()
        h.update(struct.pack("<Q", len(name)) + name)
    h.update(struct.pack("<IQQ", snap.slot, snap.seq, len(snap.ids)))
    h.update(ids_to_bytes(snap.ids))
    h.update(f32_to_bytes(snap.strengths))
    if snap.payloads:
        for i in snap.ids.tolist():
            p = snap.payloads.get(i)
            if p is not None:
                h.update(struct.pack("<QQ", i, len(p)))
                h.update(p)
    if snap.stamps:  # a capped table's insert stamps, aligned with ids
        h.update(b"stamps" + stamps_bytes(snap.ids, snap.stamps))
    h.update(struct.pack("<Q", len(snap.requests)))
    for rid in snap.requests:
        h.update(struct.pack("<Q", len(rid)))
        h.update(rid)
    return h.digest()


def slot_messages(
    snap: SlotSnapshot, chunk_bytes: int, digest: bool = True
) -> list[worker_pb2.SlotData]:
    """Return one slot as ``SlotData`` messages of about ``chunk_bytes`` each.

    The memories are cut by bytes (12 a memory plus its payload; a memory larger than that
    goes alone, so payload-heavy slots stay under the message limit), and so are the slot's
    request ids (each counted with its length), which ride from the first message on: a
    message carries at most about ``chunk_bytes`` of each. An empty slot is one message, so
    that its seq travels. The first message carries the count and digest of the whole slot.

    Args:
        snap: the slot (ids [n] uint64 in key order, strengths [n] float32, payloads, its
            request ids).
        chunk_bytes: target message size, bytes.
        digest: compute the slot's SHA-256 digest (``slot_digest``) for the receiver to
            verify; a copy to a peer needs it, a dump (an export, whose reader checks no
            digest) does not, and hashing a whole store costs a pass over every byte.
    """
    ranges = byte_ranges(memory_sizes(snap.ids, snap.payloads), chunk_bytes)
    rid_sizes = np.fromiter((len(r) + 2 for r in snap.requests), np.int64, len(snap.requests))
    rid_ranges = byte_ranges(rid_sizes, chunk_bytes)
    out = []
    for k in range(max(len(ranges), len(rid_ranges), 1)):
        start, stop = ranges[k] if k < len(ranges) else (len(snap.ids), len(snap.ids))
        ra, rb = rid_ranges[k] if k < len(rid_ranges) else (0, 0)
        ids = snap.ids[start:stop]
        pids = [i for i in ids.tolist() if i in snap.payloads] if snap.payloads else []
        out.append(
            worker_pb2.SlotData(
                slot=snap.slot,
                seq=snap.seq,
                ids=ids_to_bytes(ids),
                strengths=f32_to_bytes(snap.strengths[start:stop]),
                payload_ids=pids,
                payloads=[snap.payloads[i] for i in pids],
                first=k == 0,
                request_ids=snap.requests[ra:rb],
                count=len(snap.ids) if k == 0 else 0,
                digest=slot_digest(snap) if k == 0 and digest else b"",
                table="" if snap.table == DEFAULT_TABLE else snap.table,
                stamps=stamps_bytes(ids, snap.stamps),
            )
        )
    return out


class CopyMismatch(MemoryInputError):
    """A received slot copy differs from what its source sent (count or digest).

    INVALID_ARGUMENT; nothing of the stream is installed.
    """


@dataclass
class _Parts:
    """The chunks of one slot received so far."""

    first: worker_pb2.SlotData
    ids: list[np.ndarray] = field(default_factory=list)
    strengths: list[np.ndarray] = field(default_factory=list)
    payloads: dict[int, bytes] = field(default_factory=dict)
    requests: list[bytes] = field(default_factory=list)
    stamps: dict[int, int] = field(default_factory=dict)


async def receive_slots(
    messages: AsyncIterator[worker_pb2.SlotData], max_bytes: int
) -> list[SlotSnapshot]:
    """Reassemble a stream of ``SlotData`` chunks into one snapshot per slot part, verify each.

    A part is one table's content of one slot (``SlotData.table``). Parts come in first-seen
    order; a chunk marked ``first`` restarts its part. Every chunk
    is counted against ``max_bytes`` before it is kept, and each slot must match the count
    and digest its first chunk declares (``slot_digest``) before any is returned.

    Args:
        messages: the stream.
        max_bytes: most bytes of messages one stream may bring (``max_receive_slots_bytes``).

    Raises:
        BudgetExceeded: the stream brought more than ``max_bytes`` (RESOURCE_EXHAUSTED).
        CodecError: ids or strengths are not whole values (INVALID_ARGUMENT).
        MemoryInputError: a chunk's payloads do not match its payload ids, a request id over
            64 bytes, or a chunk before its slot's first (INVALID_ARGUMENT).
        CopyMismatch: a slot's count or digest differ from its source's (INVALID_ARGUMENT).
    """
    parts: dict[tuple[str, int], _Parts] = {}
    received = 0
    async for msg in messages:
        received += msg.ByteSize()
        if received > max_bytes:
            raise BudgetExceeded(
                f"slot copy stream exceeds max_receive_slots_bytes {max_bytes} (at slot {msg.slot})"
            )
        ids, strengths = ids_from_bytes(msg.ids), f32_from_bytes(msg.strengths)
        if len(msg.payload_ids) != len(msg.payloads):
            raise MemoryInputError(
                f"slot {msg.slot}: {len(msg.payloads)} payloads for "
                f"{len(msg.payload_ids)} payload_ids"
            )
        for rid in msg.request_ids:
            validate_request_id(rid, f"slot {msg.slot} request_ids")
        key = (table_name(msg.table), msg.slot)
        part = parts.get(key)
        if msg.first:
            part = parts[key] = _Parts(msg)
        elif part is None:
            raise MemoryInputError(f"slot {msg.slot}: a chunk came before the slot's first")
        part.ids.append(ids)
        part.strengths.append(strengths)
        part.payloads.update(zip(msg.payload_ids, msg.payloads, strict=True))
        try:
            part.stamps.update(stamps_dict(ids, msg.stamps))
        except ValueError as exc:
            raise MemoryInputError(f"slot {msg.slot}: {exc}") from None
        part.requests.extend(msg.request_ids)
    return [_verified(p) for p in parts.values()]


def _verified(part: _Parts) -> SlotSnapshot:
    """The snapshot of one slot's chunks, once its count and digest match its first chunk's.

    Raises:
        CopyMismatch: they do not (INVALID_ARGUMENT).
    """
    head = part.first
    snap = SlotSnapshot(
        head.slot,
        head.seq,
        np.concatenate(part.ids),
        np.concatenate(part.strengths),
        part.payloads,
        part.requests,
        table_name(head.table),
        part.stamps,
    )
    if len(snap.ids) != head.count or len(snap.strengths) != head.count:
        raise CopyMismatch(
            f"slot {head.slot}: copy holds {len(snap.ids)} memories, its source sent {head.count}"
        )
    if slot_digest(snap) != head.digest:
        raise CopyMismatch(f"slot {head.slot}: copy digest differs from its source's")
    return snap
