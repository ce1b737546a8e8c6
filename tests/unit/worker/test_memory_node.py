"""MemoryNode's replica side without gRPC: forwards that cross a map change."""

from __future__ import annotations

import numpy as np
import pytest

from shared.memory.slots import slot_of
from shared.proto import common_pb2, worker_pb2
from worker.memory_node import MemoryNode
from worker.replication import StaleForward
from worker.store import SlotStore

SLOTS = 8


async def _never(*_args: object) -> None:
    raise AssertionError("a replica never forwards or reports")


def _map(epoch: int, replica_slots: list[int]) -> common_pb2.SlotMap:
    """'p' is primary of every slot; 'me' is the replica of ``replica_slots``, 'other' of
    the rest."""
    return common_pb2.SlotMap(
        epoch=epoch,
        slots=SLOTS,
        workers=["p", "me", "other"],
        addresses=["p:1", "me:1", "other:1"],
        primary=[0] * SLOTS,
        replica=[1 if s in replica_slots else 2 for s in range(SLOTS)],
    )


def _ids_in(slot: int, n: int) -> list[int]:
    candidates = np.arange(1, 10_000, dtype=np.uint64)
    return candidates[slot_of(candidates, SLOTS) == slot][:n].tolist()


def _upsert(epoch: int, ids: list[int], slots: list[int], seqs: list[int]):
    return worker_pb2.ReplicateRequest(
        primary="p",
        epoch=epoch,
        slots=slots,
        seqs=seqs,
        upsert=worker_pb2.UpsertRequest(
            epoch=epoch,
            ids=np.asarray(ids, "<u8").tobytes(),
            strengths=np.full(len(ids), 0.5, "<f4").tobytes(),
            request_id=b"r1",
        ),
    )


async def test_stale_forward_applies_to_the_slots_still_held() -> None:
    # Arrange: a replica of slots 1 and 2 whose next map keeps slot 1 only.
    node = MemoryNode("me", SlotStore(slots=SLOTS), _never, _never)
    await node.apply_slot_map(_map(1, [1, 2]))
    await node.apply_slot_map(_map(2, [1]))
    kept, gone = _ids_in(1, 3), _ids_in(2, 2)

    # Act: the primary, still at epoch 1, forwards one write touching both slots.
    await node.apply_replicated(_upsert(1, kept + gone, [1, 2], [1, 1]))

    # Assert: slot 1 took its part and its seq; slot 2 took nothing.
    assert sorted(node.items()[0].tolist()) == sorted(kept)
    assert node.slot_seqs([1, 2]) == [1, 0]
    # ...so the primary's next forward of slot 1 is in sequence.
    await node.apply_replicated(_upsert(2, kept[:1], [1], [2]))
    assert node.slot_seqs([1]) == [2]
    node.close()


async def test_stale_forward_of_no_held_slot_is_refused_and_changes_nothing() -> None:
    node = MemoryNode("me", SlotStore(slots=SLOTS), _never, _never)
    await node.apply_slot_map(_map(1, [1, 2]))
    await node.apply_slot_map(_map(2, [1]))

    with pytest.raises(StaleForward, match="no longer holds slot 2"):
        await node.apply_replicated(_upsert(1, _ids_in(2, 2), [2], [1]))

    assert len(node) == 0
    assert node.slot_seqs(list(range(SLOTS))) == [0] * SLOTS
    node.close()
