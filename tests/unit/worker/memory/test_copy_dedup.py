"""A slot copy carries the request ids and decay op ids its slot applied
(``worker/store/dedup.py``), so a client's or the coordinator's retry that reaches the new copy,
promoted or moved there,
is not applied twice (issue 12, item 6)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest

from shared.memory.slots import slot_of
from shared.proto import common_pb2, worker_pb2
from worker.memory.memory_node import MemoryNode
from worker.memory.wire import receive_slots, slot_messages
from worker.store.dedup import RecentRequests
from worker.store.journal import Journal, lock_data_dir
from worker.store.journal import recover as recover_journal
from worker.store.store import SlotSnapshot, SlotStore

SLOTS = 8


# -- the table ---------------------------------------------------------------------------------


def test_of_slot_lists_the_ids_each_slot_applied_least_recently_recorded_first() -> None:
    recent = RecentRequests()

    recent.record(b"a", np.array([1, 2]))
    recent.record(b"b", np.array([2]))
    recent.record(b"a", np.array([3]))

    # "a" was recorded again after "b": the table's LRU order, which a copy's receiver
    # reproduces by recording them in turn, so both forget them in the same order.
    assert (recent.of_slot(1), recent.of_slot(2), recent.of_slot(3)) == (
        [b"a"],
        [b"b", b"a"],
        [b"a"],
    )
    assert recent.of_slot(4) == []
    assert recent.of_slots([2, 4, 1]) == {2: [b"b", b"a"], 4: [], 1: [b"a"]}


def test_replace_slot_forgets_that_slots_old_ids_and_keeps_the_others() -> None:
    # Arrange: "a" applied on slots 1 and 2, "b" on slot 2 only.
    recent = RecentRequests()
    recent.record(b"a", np.array([1, 2]))
    recent.record(b"b", np.array([2]))

    # Act: a copy of slot 2 arrives that applied "c" (and neither "a" nor "b").
    recent.replace_slot(2, [b"c"])

    # Assert: slot 2 now skips "c" only; slot 1 still skips "a"; "b" is gone entirely.
    slots = np.array([1, 2])
    assert recent.fresh(b"a", slots).tolist() == [False, True]
    assert recent.fresh(b"b", slots).tolist() == [True, True]
    assert recent.fresh(b"c", slots).tolist() == [True, False]
    assert recent.entries() == [(b"a", [1]), (b"c", [2])]


def test_eviction_keeps_the_per_slot_index_in_step() -> None:
    recent = RecentRequests(capacity=2)

    for rid in (b"a", b"b", b"c"):
        recent.record(rid, np.array([5]))

    assert recent.of_slot(5) == [b"b", b"c"]
    assert [rid for rid, _ in recent.entries()] == [b"b", b"c"]


# -- the wire and the journal ------------------------------------------------------------------


async def _stream(msgs: list[worker_pb2.SlotData]) -> AsyncIterator[worker_pb2.SlotData]:
    for m in msgs:
        yield m


async def test_request_ids_travel_with_a_slot_split_in_chunks() -> None:
    ids = _ids_in(3, 40)
    snap = SlotSnapshot(3, 7, ids, np.full(len(ids), 0.5, np.float32), {}, [b"r1", b"d1"])

    msgs = slot_messages(snap, chunk_bytes=12 * 10)  # 4 chunks
    (got,) = await receive_slots(_stream(msgs), 1 << 30)

    assert len(msgs) == 4
    assert [list(m.request_ids) for m in msgs] == [[b"r1", b"d1"], [], [], []]
    assert (got.slot, got.seq, got.requests) == (3, 7, [b"r1", b"d1"])
    np.testing.assert_array_equal(got.ids, ids)


async def test_a_restarted_worker_knows_the_ids_of_the_slots_it_imported(
    tmp_path: Path,
) -> None:
    # Arrange: a primary logs a reinforce "old" on slots 3 and 4, then a copy of slot 3
    # arrives (the slot is moving here) that applied "new" and not "old".
    journal = Journal(tmp_path, lock_data_dir(tmp_path), SLOTS, 0, "never", 1.0, 1 << 30)
    node = MemoryNode("old", SlotStore(slots=SLOTS), _never, _never, journal)
    await node.apply_slot_map(_map(1, "old"))
    ids = np.concatenate([_ids_in(3, 1), _ids_in(4, 1)])
    await _reinforce(node, 1, ids, b"old")
    snap = SlotSnapshot(3, 9, _ids_in(3, 2), np.full(2, 0.25, np.float32), {}, [b"new"])

    # Act: import it (logged), then reload the data dir as a restarted worker would.
    await node.import_snapshots([snap])
    node.close()
    recovered = recover_journal(tmp_path, lambda s: SlotStore(slots=s))

    # Assert: the import record replaced slot 3's ids; slot 4 still has "old".
    assert recovered is not None
    assert recovered.requests == [(b"old", [4]), (b"new", [3])]


# -- through MemoryNode: a copy, then a retry on the copy ----------------------------------------


@pytest.fixture
def nodes() -> Iterator[list[MemoryNode]]:
    made: list[MemoryNode] = []
    yield made
    for node in made:
        node.close()


async def _never(*_args: object) -> None:
    return None


def _ids_in(slot: int, n: int) -> np.ndarray:
    candidates = np.arange(1, 10_000, dtype=np.uint64)
    return candidates[slot_of(candidates, SLOTS) == slot][:n]


def _map(epoch: int, primary: str) -> common_pb2.SlotMap:
    """``primary`` is primary of every slot, the other of 'old'/'new' its replica."""
    workers = ["old", "new"]
    p = workers.index(primary)
    return common_pb2.SlotMap(
        epoch=epoch,
        slots=SLOTS,
        workers=workers,
        addresses=["old:1", "new:1"],
        primary=[p] * SLOTS,
        replica=[1 - p] * SLOTS,
    )


async def _reinforce(node: MemoryNode, epoch: int, ids: np.ndarray, rid: bytes) -> int:
    boosts = np.full(len(ids), 0.125, np.float32)
    request = worker_pb2.ReinforceRequest(
        epoch=epoch, ids=ids.astype("<u8").tobytes(), boosts=boosts.tobytes(), request_id=rid
    )
    return await node.reinforce(request, ids, boosts)


async def test_a_retry_reaching_a_copy_made_after_the_write_is_not_applied_twice(
    nodes,
) -> None:
    # Arrange: 'old' is primary; it applies a reinforce and a decay, then copies every slot
    # to 'new' (the snapshot already holds both).
    old = MemoryNode("old", SlotStore(slots=SLOTS), _never, _never)
    new = MemoryNode("new", SlotStore(slots=SLOTS), _never, _never)
    nodes += [old, new]
    await old.apply_slot_map(_map(1, "old"))
    ids = _ids_in(3, 2)
    request = worker_pb2.UpsertRequest(
        epoch=1, ids=ids.astype("<u8").tobytes(), strengths=np.full(2, 0.5, "<f4").tobytes()
    )
    await old.upsert(request, ids, np.full(2, 0.5, np.float32), None)
    await _reinforce(old, 1, ids, b"reinforce-1")
    await old.decay(1, 0.25, b"decay-1")
    sent: list[SlotSnapshot] = []

    async def send(_t: str, _a: str, snaps: list[SlotSnapshot]) -> tuple[int, int]:
        sent.extend(snaps)
        return 0, 0

    await old.copy_to("new", "new:1", list(range(SLOTS)), send)
    await new.import_snapshots(sent)

    # Act: the map moves every primary to 'new'; the client retries the reinforce and the
    # coordinator re-sends the decay there.
    await new.apply_slot_map(_map(2, "new"))
    found = await _reinforce(new, 2, ids, b"reinforce-1")
    decayed = await new.decay(2, 0.25, b"decay-1")

    # Assert: neither applied again: 0.5 + 0.125 - 0.25 on both ids.
    assert found == 0
    assert decayed == 2
    assert new.items()[1].tolist() == [0.375, 0.375]
