"""Concurrent writes through a primary with a durable journal (group commit, the fsync
started by the store thread and run while the forwards travel) reach its replica in each
slot's sequence order: both copies end identical (issue 12, item 2)."""

from __future__ import annotations

import asyncio
import random

import numpy as np

from shared.memory.slots import slot_of
from shared.proto import worker_pb2
from tests.unit.worker.memory.node_pair import pair_map
from worker.memory.memory_node import MemoryNode
from worker.store.journal import Journal, lock_data_dir
from worker.store.store import SlotStore

SLOTS, WRITES = 8, 30


class SlowWire:
    """Delivers forwards after a random delay (a network whose calls overtake each other)."""

    def __init__(self, seed: int) -> None:
        self.nodes: dict[str, MemoryNode] = {}
        self.rng = random.Random(seed)

    async def forward(self, target: str, address: str, req: worker_pb2.ReplicateRequest) -> None:
        await asyncio.sleep(self.rng.random() * 0.003)
        await self.nodes[target].apply_replicated(req)

    async def report(self, target: str, slots: list[int], reason: str) -> None:
        raise AssertionError(f"unexpected report {target} {slots} {reason}")


def _node(wire: SlowWire, name: str, tmp_path) -> MemoryNode:
    d = tmp_path / name
    journal = Journal(d, lock_data_dir(d), SLOTS, 0, "always", 1.0, 1 << 30)
    wire.nodes[name] = MemoryNode(name, SlotStore(slots=SLOTS), wire.forward, wire.report, journal)
    return wire.nodes[name]


async def test_concurrent_writes_keep_each_slots_order_on_the_replica(tmp_path) -> None:
    # Arrange: 'p' primary of every slot, 'r' its replica, both journaling with fsync always.
    wire = SlowWire(seed=1)
    p, r = _node(wire, "p", tmp_path), _node(wire, "r", tmp_path)
    m = pair_map(SLOTS)
    for node in (p, r):
        await node.apply_slot_map(m)
    rng = np.random.default_rng(2)
    ids = np.arange(1, 501, dtype=np.uint64)
    s = rng.random(len(ids), dtype=np.float32)
    await p.upsert(
        worker_pb2.UpsertRequest(epoch=1, ids=ids.tobytes(), strengths=s.tobytes()), ids, s, None
    )
    batches = [rng.choice(ids, 200) for _ in range(WRITES)]

    # Act: WRITES reinforces and a decay at once, each on many of the same slots.
    async def reinforce(i: int, batch: np.ndarray) -> int:
        boosts = np.full(len(batch), 0.01 * (i % 7 + 1), np.float32)
        req = worker_pb2.ReinforceRequest(
            epoch=1, ids=batch.tobytes(), boosts=boosts.tobytes(), request_id=b"w%d" % i
        )
        return await p.reinforce(req, batch, boosts)

    await asyncio.gather(*(reinforce(i, b) for i, b in enumerate(batches)), p.decay(1, 0.05, b"d"))

    # Assert: both copies identical bit for bit, each slot at the same seq, one per write.
    (p_ids, p_s), (r_ids, r_s) = p.items(), r.items()
    assert np.array_equal(p_ids, r_ids) and p_s.tobytes() == r_s.tobytes()
    every = list(range(SLOTS))
    per_slot = [set(slot_of(b, SLOTS).tolist()) for b in batches]
    expected = [2 + sum(slot in touched for touched in per_slot) for slot in every]
    assert p.slot_seqs(every) == r.slot_seqs(every) == expected
    for node in (p, r):
        node.close()
