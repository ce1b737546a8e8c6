"""A decay carries an operation id and each slot applies it once: on the primary, on the
replica it was forwarded to, after the replica is promoted, and after a journal reload."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from shared.memory.slots import slot_of
from shared.proto import common_pb2, worker_pb2
from tests.unit.worker.memory.node_pair import Wire, pair_map
from worker.memory.memory_node import MemoryNode
from worker.store.journal_format import KIND_OP, replay
from worker.store.store import SlotStore

SLOTS = 8


@pytest.fixture
def wire() -> Iterator[Wire]:
    w = Wire()
    yield w
    for node in w.nodes.values():
        node.close()


def _node(wire: Wire, name: str) -> MemoryNode:
    wire.nodes[name] = MemoryNode(name, SlotStore(slots=SLOTS), wire.forward, wire.report)
    return wire.nodes[name]


def _map(epoch: int, primary: int) -> common_pb2.SlotMap:
    """Worker ``primary`` (0: 'p', 1: 'r') holds every slot's primary, the other its replica."""
    return pair_map(SLOTS, epoch, primary)


async def _load(node: MemoryNode, ids: np.ndarray) -> None:
    strengths = np.full(len(ids), 0.5, np.float32)
    request = worker_pb2.UpsertRequest(
        epoch=1, ids=ids.astype("<u8").tobytes(), strengths=strengths.astype("<f4").tobytes()
    )
    await node.upsert(request, ids, strengths, None)


def _strengths(node: MemoryNode) -> dict[int, float]:
    ids, strengths = node.items()
    return dict(zip(ids.tolist(), strengths.tolist(), strict=True))


async def test_a_decay_delivered_twice_is_applied_once_on_primary_and_replica(wire) -> None:
    # Arrange: 'p' primary of every slot, 'r' its replica, 40 memories at 0.5.
    p, r = _node(wire, "p"), _node(wire, "r")
    for node in (p, r):
        await node.apply_slot_map(_map(1, primary=0))
    ids = np.arange(1, 41, dtype=np.uint64)
    await _load(p, ids)
    once = np.float32(np.clip(np.float32(0.5) - np.float32(0.125), 0, 1))

    # Act: the same decay twice (a coordinator or client retry), then promote 'r' and
    # deliver it a third time to the new primary.
    first = await p.decay(1, 0.125, b"op-1")
    forwards_after_first = len(wire.forwards)
    second = await p.decay(1, 0.125, b"op-1")
    for node in (p, r):
        await node.apply_slot_map(_map(2, primary=1))
    third = await r.decay(2, 0.125, b"op-1")

    # Assert: every memory decayed once on both copies; the repeats forwarded nothing and
    # counted the same memories; the seqs moved only for the first delivery.
    assert first == second == third == 40
    assert len(wire.forwards) == forwards_after_first
    assert set(_strengths(p).values()) == set(_strengths(r).values()) == {float(once)}
    assert p.slot_seqs(list(range(SLOTS))) == r.slot_seqs(list(range(SLOTS)))


async def test_a_retry_applies_only_on_slots_that_missed_the_decay(wire) -> None:
    # Arrange: 'p' applied op-1 before slot 3 moved to it (a promotion of a copy that had
    # not received the decay): slot 3 must take it on the retry, the others must not.
    p, r = _node(wire, "p"), _node(wire, "r")
    for node in (p, r):
        await node.apply_slot_map(_map(1, primary=0))
    ids = np.arange(1, 41, dtype=np.uint64)
    await _load(p, ids)
    mine = [s for s in range(SLOTS) if s != 3]
    await p.apply_slot_map(_only(2, mine))
    await r.apply_slot_map(_only(2, mine))
    await p.decay(2, 0.25, b"op-1")
    await p.apply_slot_map(_map(3, primary=0))
    await r.apply_slot_map(_map(3, primary=0))

    # Act: the coordinator's retry once the map moved.
    n = await p.decay(3, 0.25, b"op-1")

    # Assert: every memory decayed exactly once, slot 3's included, on both copies.
    assert n == 40
    assert set(_strengths(p).values()) == set(_strengths(r).values()) == {0.25}


def _only(epoch: int, primary_slots: list[int]) -> common_pb2.SlotMap:
    """'p' primary of ``primary_slots``, 'r' of the rest; each is the other's replica."""
    return common_pb2.SlotMap(
        epoch=epoch,
        slots=SLOTS,
        workers=["p", "r"],
        addresses=["p:1", "r:1"],
        primary=[0 if s in primary_slots else 1 for s in range(SLOTS)],
        replica=[1 if s in primary_slots else 0 for s in range(SLOTS)],
    )


def test_slots_in_the_fixture_are_spread() -> None:
    # The cases above need memories in slot 3 and in others.
    slots = slot_of(np.arange(1, 41, dtype=np.uint64), SLOTS)
    assert 3 in slots.tolist() and len(set(slots.tolist())) > 1


def test_a_logged_decay_reports_its_op_id_on_replay() -> None:
    # A restarted copy learns which slots applied the decay from its log (snapshots keep the
    # same table, ``RecentRequests.entries``), so it also skips a re-sent decay.
    store = SlotStore(slots=SLOTS)
    store.upsert(np.arange(1, 41, dtype=np.uint64), np.full(40, 0.5, np.float32))
    record = worker_pb2.ReplicateRequest(
        primary="p",
        epoch=1,
        slots=[2, 5],
        seqs=[1, 1],
        decay=worker_pb2.WorkerDecayRequest(epoch=1, rate=0.25, op_id=b"op-1"),
    )
    seen: list[tuple[bytes, list[int]]] = []

    replay(store, KIND_OP, record.SerializeToString(), lambda rid, s: seen.append((rid, s)))

    assert seen == [(b"op-1", [2, 5])]
