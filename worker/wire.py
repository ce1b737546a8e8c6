"""The worker's wire messages built from domain data and back.

The part of a keyed write or a forward that touches some slots, and slot copies as streams
of ``SlotData`` chunks.

Bulk fields are raw little-endian bytes (``shared/rpc/codec.py``): ids uint64, values float32.

Shape letters: N items of a keyed request, T slots of a forward, n memories of a slot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from shared.memory.slots import slot_of
from shared.memory.validation import MemoryInputError
from shared.proto import worker_pb2
from shared.rpc.chunking import byte_ranges, memory_sizes
from shared.rpc.codec import f32_from_bytes, f32_to_bytes, ids_from_bytes, ids_to_bytes
from worker.store import SlotSnapshot

__all__ = ["narrow", "receive_slots", "slot_messages", "sub_request"]


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
        )
    if op == "reinforce":
        return worker_pb2.ReinforceRequest(
            epoch=request.epoch,
            ids=ids,
            request_id=rid,
            boosts=f32_to_bytes(f32_from_bytes(request.boosts, "boosts")[keep]),
        )
    return worker_pb2.DeleteRequest(epoch=request.epoch, ids=ids, request_id=rid)


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


def slot_messages(snap: SlotSnapshot, chunk_bytes: int) -> list[worker_pb2.SlotData]:
    """Return one slot as ``SlotData`` messages of about ``chunk_bytes`` each.

    Args:
        snap: the slot (ids [n] uint64, strengths [n] float32, payloads).
        chunk_bytes: target message size, bytes, payloads counted (12 bytes a memory plus
            its payload; a memory larger than that goes alone, so payload-heavy slots stay
            under the message limit); an empty slot is one message, so that its seq travels.
    """
    out = []
    ranges = byte_ranges(memory_sizes(snap.ids, snap.payloads), chunk_bytes) or [(0, 0)]
    for start, stop in ranges:
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
                first=start == 0,
            )
        )
    return out


async def receive_slots(messages: AsyncIterator[worker_pb2.SlotData]) -> list[SlotSnapshot]:
    """Reassemble a stream of ``SlotData`` chunks into one snapshot per slot.

    Slots come in first-seen order; a chunk marked ``first`` restarts its slot.

    Raises:
        CodecError: ids or strengths are not whole values (INVALID_ARGUMENT).
        MemoryInputError: a chunk's payloads do not match its payload ids (INVALID_ARGUMENT).
    """
    snaps: dict[int, SlotSnapshot] = {}
    async for msg in messages:
        snap = snaps.get(msg.slot)
        ids, strengths = ids_from_bytes(msg.ids), f32_from_bytes(msg.strengths)
        if len(msg.payload_ids) != len(msg.payloads):
            raise MemoryInputError(
                f"slot {msg.slot}: {len(msg.payloads)} payloads for "
                f"{len(msg.payload_ids)} payload_ids"
            )
        payloads = dict(zip(msg.payload_ids, msg.payloads, strict=True))
        if snap is None or msg.first:
            snaps[msg.slot] = SlotSnapshot(msg.slot, msg.seq, ids, strengths, payloads)
        else:
            snap.ids = np.concatenate([snap.ids, ids])
            snap.strengths = np.concatenate([snap.strengths, strengths])
            snap.payloads.update(payloads)
    return list(snaps.values())
