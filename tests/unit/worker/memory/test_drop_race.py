"""A replica that loses a slot drops it even when the slot's first forward is still queued
on the store thread (issue 12, item 8: under load the join-under-traffic invariant found a
worker holding data of a slot it was no copy of: the map change read the slot as empty, so
it did not drop it, then the queued forward filled it)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from shared.memory.slots import slot_of
from shared.proto import common_pb2, worker_pb2
from worker.memory.memory_node import MemoryNode
from worker.store.store import SlotStore

SLOTS = 8


async def _never(*_args: object) -> None:
    raise AssertionError("a replica never forwards or reports")


def _map(epoch: int, replica: str) -> common_pb2.SlotMap:
    """'p' primary of every slot, ``replica`` the replica of every slot."""
    workers = ["p", "me", "other"]
    return common_pb2.SlotMap(
        epoch=epoch,
        slots=SLOTS,
        workers=workers,
        addresses=["p:1", "me:1", "other:1"],
        primary=[0] * SLOTS,
        replica=[workers.index(replica)] * SLOTS,
    )


async def test_a_lost_slot_is_dropped_even_if_its_first_forward_was_still_queued() -> None:
    # Arrange: 'me' replicates every slot; its store thread is busy, so a forward (the first
    # write of slot 3) waits in its queue.
    node = MemoryNode("me", SlotStore(slots=SLOTS), _never, _never)
    try:
        await node.apply_slot_map(_map(1, "me"))
        candidates = np.arange(1, 1000, dtype=np.uint64)
        ids = candidates[slot_of(candidates, SLOTS) == 3][:2]
        forward = worker_pb2.ReplicateRequest(
            primary="p",
            epoch=1,
            slots=[3],
            seqs=[1],
            upsert=worker_pb2.UpsertRequest(
                epoch=1, ids=ids.astype("<u8").tobytes(), strengths=np.full(2, 0.5, "<f4").tobytes()
            ),
        )
        busy = threading.Event()
        blocker = asyncio.ensure_future(node._data.run(busy.wait))
        applied = asyncio.ensure_future(node.apply_replicated(forward))
        await asyncio.sleep(0)  # the forward is checked and queued behind the blocker

        # Act: the map moves every replica to 'other' while the forward waits; then the
        # store thread runs both.
        adopted = asyncio.ensure_future(node.apply_slot_map(_map(2, "other")))
        await asyncio.sleep(0)
        busy.set()
        await asyncio.gather(blocker, applied, adopted)

        # Assert: 'me' holds nothing of slot 3.
        assert len(node) == 0
        assert node.slot_seqs([3]) == [0]
    finally:
        node.close()
