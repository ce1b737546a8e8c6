"""MemoryNode without gRPC: a primary's writes with fake forward/report callables, and a
replica applying forwards (in order, repeated, with gaps, across a map change)."""

from __future__ import annotations

import asyncio
import errno
import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from shared.memory.slots import slot_of
from shared.proto import common_pb2, worker_pb2
from worker.memory.memory_node import MemoryNode
from worker.memory.replication import OutOfSync, ReplicationError, StaleForward
from worker.memory.roles import NotPrimary, StaleEpoch
from worker.store import journal as journal_mod
from worker.store.journal import Journal, StorageFailed, lock_data_dir
from worker.store.store import SlotSnapshot, SlotStore

SLOTS = 8


async def _never(*_args: object) -> None:
    raise AssertionError("a replica never forwards or reports")


class FakePeers:
    """Records forwards and reports; fails a forward to a target in ``fail``, and every
    report when ``report_fails``."""

    def __init__(
        self, fail: dict[str, BaseException] | None = None, report_fails: bool = False
    ) -> None:
        self.fail = fail or {}
        self.report_fails = report_fails
        self.forwards: list[tuple[str, str, worker_pb2.ReplicateRequest]] = []
        self.reports: list[tuple[str, list[int], str]] = []

    async def forward(self, target: str, address: str, req: worker_pb2.ReplicateRequest) -> None:
        self.forwards.append((target, address, req))
        if target in self.fail:
            raise self.fail[target]

    async def report(self, target: str, slots: list[int], reason: str) -> None:
        self.reports.append((target, slots, reason))
        if self.report_fails:
            raise ConnectionError("coordinator down")


class StaleAnswer(Exception):
    """What a peer's StaleForward looks like to the primary: FAILED_PRECONDITION."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.FAILED_PRECONDITION


@pytest.fixture
def nodes() -> Iterator[list[MemoryNode]]:
    """Nodes a test makes, closed at its end (each has a store thread)."""
    made: list[MemoryNode] = []
    yield made
    for node in made:
        node.close()


def _node(nodes: list[MemoryNode], name: str, peers: FakePeers | None = None) -> MemoryNode:
    forward, report = (peers.forward, peers.report) if peers else (_never, _never)
    node = MemoryNode(name, SlotStore(slots=SLOTS), forward, report)
    nodes.append(node)
    return node


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


def _primary_map(epoch: int, primary_slots: list[int] | None = None) -> common_pb2.SlotMap:
    """'me' is primary of ``primary_slots`` (default: all) and 'r' their replica; 'r' is
    primary of the rest, 'me' their replica."""
    mine = range(SLOTS) if primary_slots is None else primary_slots
    return common_pb2.SlotMap(
        epoch=epoch,
        slots=SLOTS,
        workers=["me", "r"],
        addresses=["me:1", "r:1"],
        primary=[0 if s in mine else 1 for s in range(SLOTS)],
        replica=[1 if s in mine else 0 for s in range(SLOTS)],
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


async def _write(node: MemoryNode, epoch: int, ids: list[int], rid: bytes = b"") -> int:
    """Upsert ``ids`` at strength 0.5 as a client would (request and decoded arrays)."""
    arr = np.asarray(ids, np.uint64)
    strengths = np.full(len(ids), 0.5, np.float32)
    request = worker_pb2.UpsertRequest(
        epoch=epoch,
        ids=arr.astype("<u8").tobytes(),
        strengths=strengths.astype("<f4").tobytes(),
        request_id=rid,
    )
    return await node.upsert(request, arr, strengths, None)


async def _reinforce(node: MemoryNode, epoch: int, ids: list[int], rid: bytes) -> int:
    arr, boosts = np.asarray(ids, np.uint64), np.full(len(ids), 0.25, np.float32)
    request = worker_pb2.ReinforceRequest(
        epoch=epoch,
        ids=arr.astype("<u8").tobytes(),
        boosts=boosts.astype("<f4").tobytes(),
        request_id=rid,
    )
    return await node.reinforce(request, arr, boosts)


def _strengths(node: MemoryNode) -> dict[int, float]:
    ids, strengths = node.items()
    return dict(zip(ids.tolist(), strengths.tolist(), strict=True))


# -- primary side ------------------------------------------------------------------------------


async def test_a_primary_write_is_forwarded_to_its_replica_with_the_next_seq(nodes) -> None:
    # Arrange: 'me' is primary of every slot, 'r' the replica.
    peers = FakePeers()
    node = _node(nodes, "me", peers)
    await node.apply_slot_map(_primary_map(1))
    first, second = _ids_in(3, 2), _ids_in(3, 1)

    # Act: two writes to slot 3.
    assert await _write(node, 1, first) == 2
    await _write(node, 1, second)

    # Assert: each went to r at r's address, with slot 3's next seq and the write's items.
    assert [(t, a, list(r.slots), list(r.seqs)) for t, a, r in peers.forwards] == [
        ("r", "r:1", [3], [1]),
        ("r", "r:1", [3], [2]),
    ]
    sent = np.frombuffer(peers.forwards[0][2].upsert.ids, "<u8").tolist()
    assert sent == first and peers.forwards[0][2].primary == "me"
    assert peers.forwards[0][2].epoch == 1
    assert node.slot_seqs([3]) == [2]


async def test_each_target_gets_only_its_slots_part_of_a_write(nodes) -> None:
    # Arrange: 'me' is primary of slots 1 and 2; slot 2's copy is being made on 'new'.
    peers = FakePeers()
    node = _node(nodes, "me", peers)
    await node.apply_slot_map(_primary_map(1, [1, 2]))
    sent = await node.copy_to("new", "new:1", [2], _fake_send([]))
    assert sent == (0, 0)

    # Act: one write touching both slots.
    in_1, in_2 = _ids_in(1, 2), _ids_in(2, 3)
    await _write(node, 1, in_1 + in_2)

    # Assert: r (replica of both) gets both; new gets slot 2's items only.
    by_target = {t: r for t, _, r in peers.forwards}
    assert list(by_target["r"].slots) == [1, 2]
    assert list(by_target["new"].slots) == [2] and list(by_target["new"].seqs) == [1]
    assert np.frombuffer(by_target["new"].upsert.ids, "<u8").tolist() == in_2


async def test_a_failing_forward_is_reported_and_that_copy_excluded(nodes) -> None:
    # Arrange: r's forwards fail; 'me' is primary of slots 1 and 5 (r their replica).
    peers = FakePeers(fail={"r": ConnectionError("r is down")})
    node = _node(nodes, "me", peers)
    await node.apply_slot_map(_primary_map(1, [1, 5]))

    # Act: the write is acknowledged, then a second one is made.
    assert await _write(node, 1, _ids_in(1, 1)) == 1
    await _write(node, 1, _ids_in(5, 1))

    # Assert: reported once with every slot r copies from here; no forward after that.
    assert peers.reports == [("r", [1, 5], "ConnectionError: r is down")]
    assert len(peers.forwards) == 1
    assert len(node) == 2


async def test_a_new_map_forwards_to_an_excluded_copy_again(nodes) -> None:
    peers = FakePeers(fail={"r": ConnectionError("r is down")})
    node = _node(nodes, "me", peers)
    await node.apply_slot_map(_primary_map(1))
    await _write(node, 1, _ids_in(1, 1))
    del peers.fail["r"]

    await node.apply_slot_map(_primary_map(2))
    await _write(node, 2, _ids_in(1, 1))

    assert [(t, r.epoch, list(r.seqs)) for t, _, r in peers.forwards] == [
        ("r", 1, [1]),
        ("r", 2, [2]),
    ]


async def test_a_stale_answer_to_a_forward_is_not_a_failure(nodes) -> None:
    # The target moved on to a map where it no longer holds the slot: its holders have it.
    peers = FakePeers(fail={"r": StaleAnswer("no longer holds slot 1")})
    node = _node(nodes, "me", peers)
    await node.apply_slot_map(_primary_map(1))

    await _write(node, 1, _ids_in(1, 1))
    await _write(node, 1, _ids_in(1, 1))

    assert peers.reports == []
    assert len(peers.forwards) == 2  # not excluded


async def test_a_failed_report_fails_the_write_with_replication_error(nodes) -> None:
    peers = FakePeers(fail={"r": ConnectionError("r is down")}, report_fails=True)
    node = _node(nodes, "me", peers)
    await node.apply_slot_map(_primary_map(1))

    with pytest.raises(ReplicationError, match="replica r failed .* could not be told"):
        await _write(node, 1, _ids_in(1, 1))

    # The copy is not excluded: the next write tries r (and the coordinator) again.
    with pytest.raises(ReplicationError):
        await _write(node, 1, _ids_in(2, 1))
    assert [t for t, _, _ in peers.forwards] == ["r", "r"]


async def test_a_stale_epoch_is_refused_and_changes_nothing(nodes) -> None:
    peers = FakePeers()
    node = _node(nodes, "me", peers)
    await node.apply_slot_map(_primary_map(1))
    await node.apply_slot_map(_primary_map(2))

    with pytest.raises(StaleEpoch, match="epoch 1 does not match this worker's epoch 2"):
        await _write(node, 1, _ids_in(1, 1))
    with pytest.raises(StaleEpoch):
        await node.get(3, np.asarray(_ids_in(1, 1), np.uint64))

    assert len(node) == 0 and peers.forwards == []
    assert node.slot_seqs(list(range(SLOTS))) == [0] * SLOTS


async def test_a_write_to_a_slot_not_primary_here_is_refused(nodes) -> None:
    peers = FakePeers()
    node = _node(nodes, "me", peers)
    await node.apply_slot_map(_primary_map(1, [1]))

    with pytest.raises(NotPrimary, match="slot 2, which is not primary on worker me"):
        await _write(node, 1, _ids_in(1, 1) + _ids_in(2, 1))

    assert len(node) == 0 and peers.forwards == []


async def test_a_repeated_request_id_is_applied_once(nodes) -> None:
    # Arrange: a memory at 0.5.
    peers = FakePeers()
    node = _node(nodes, "me", peers)
    await node.apply_slot_map(_primary_map(1))
    ids = _ids_in(4, 1)
    await _write(node, 1, ids)

    # Act: the same reinforce twice (a client retry), then another request.
    await _reinforce(node, 1, ids, b"retry-me")
    assert await _reinforce(node, 1, ids, b"retry-me") == 0
    after_retry = _strengths(node)[ids[0]]
    await _reinforce(node, 1, ids, b"another")

    # Assert: the retry added nothing and was not forwarded; seqs count applied ops only.
    assert after_retry == 0.75
    assert _strengths(node)[ids[0]] == 1.0
    assert [list(r.seqs) for _, _, r in peers.forwards] == [[1], [2], [3]]


def _fake_send(sent: list[tuple[str, list[SlotSnapshot]]]):
    async def send(target: str, address: str, snaps: list[SlotSnapshot]) -> tuple[int, int]:
        sent.append((target, snaps))
        return sum(len(s.ids) for s in snaps), 0

    return send


async def test_copy_to_sends_snapshots_and_feeds_the_target_until_the_next_map(nodes) -> None:
    peers = FakePeers()
    node = _node(nodes, "me", peers)
    await node.apply_slot_map(_primary_map(1))
    await _write(node, 1, _ids_in(6, 2))
    sent: list[tuple[str, list[SlotSnapshot]]] = []

    memories, _ = await node.copy_to("new", "new:1", [6], _fake_send(sent))
    await _write(node, 1, _ids_in(6, 1))
    await node.apply_slot_map(_primary_map(2))
    await _write(node, 2, _ids_in(6, 1))

    assert memories == 2
    assert [(t, [(s.slot, s.seq, len(s.ids)) for s in snaps]) for t, snaps in sent] == [
        ("new", [(6, 1, 2)])
    ]
    # Targets of one write are called together, in no set order: compare sorted.
    assert sorted((list(r.seqs), t) for t, _, r in peers.forwards) == [
        ([1], "r"),
        ([2], "new"),
        ([2], "r"),
        ([3], "r"),
    ]


# -- replica side ------------------------------------------------------------------------------


async def test_a_replica_applies_forwards_in_order_and_ignores_repeats(nodes) -> None:
    node = _node(nodes, "me")
    await node.apply_slot_map(_map(1, [1]))
    a, b = _ids_in(1, 2)

    await node.apply_replicated(_upsert(1, [a], [1], [1]))
    await node.apply_replicated(_upsert(1, [b], [1], [2]))
    await node.apply_replicated(_upsert(1, [a, b], [1], [1]))  # a repeat of an older op

    assert node.slot_seqs([1]) == [2]
    assert sorted(_strengths(node)) == sorted([a, b])


async def test_a_forward_that_skips_a_seq_is_out_of_sync_and_changes_nothing(nodes) -> None:
    node = _node(nodes, "me")
    await node.apply_slot_map(_map(1, [1]))
    await node.apply_replicated(_upsert(1, _ids_in(1, 1), [1], [1]))

    with pytest.raises(OutOfSync, match="slot 1: forwarded seq 3 after 1"):
        await node.apply_replicated(_upsert(1, _ids_in(1, 3), [1], [3]))

    assert node.slot_seqs([1]) == [1] and len(node) == 1


async def test_a_forward_to_a_slot_primary_here_is_out_of_sync(nodes) -> None:
    node = _node(nodes, "me")
    await node.apply_slot_map(_primary_map(1, [1]))

    with pytest.raises(OutOfSync, match="slot 1 is primary on me"):
        await node.apply_replicated(_upsert(1, _ids_in(1, 1), [1], [1]))

    assert len(node) == 0


async def test_stale_forward_applies_to_the_slots_still_held(nodes) -> None:
    # Arrange: a replica of slots 1 and 2 whose next map keeps slot 1 only.
    node = _node(nodes, "me")
    await node.apply_slot_map(_map(1, [1, 2]))
    await node.apply_slot_map(_map(2, [1]))
    kept, gone = _ids_in(1, 3), _ids_in(2, 2)

    # Act: the primary, still at epoch 1, forwards one write touching both slots.
    await node.apply_replicated(_upsert(1, kept + gone, [1, 2], [1, 1]))

    # Assert: slot 1 took its part and its seq; slot 2 took nothing.
    assert sorted(_strengths(node)) == sorted(kept)
    assert node.slot_seqs([1, 2]) == [1, 0]
    # ...so the primary's next forward of slot 1 is in sequence.
    await node.apply_replicated(_upsert(2, kept[:1], [1], [2]))
    assert node.slot_seqs([1]) == [2]


async def test_stale_forward_of_no_held_slot_is_refused_and_changes_nothing(nodes) -> None:
    node = _node(nodes, "me")
    await node.apply_slot_map(_map(1, [1, 2]))
    await node.apply_slot_map(_map(2, [1]))

    with pytest.raises(StaleForward, match="no longer holds slot 2"):
        await node.apply_replicated(_upsert(1, _ids_in(2, 2), [2], [1]))

    assert len(node) == 0
    assert node.slot_seqs(list(range(SLOTS))) == [0] * SLOTS


# -- a retried write whose first forward was never confirmed --------------------------------


class ReplicaPeer(FakePeers):
    """FakePeers whose forwards to 'r' that do not fail reach a real replica node."""

    def __init__(self, replica: MemoryNode) -> None:
        super().__init__(fail={"r": ConnectionError("r is unreachable")}, report_fails=True)
        self.replica = replica

    async def forward(self, target: str, address: str, req: worker_pb2.ReplicateRequest) -> None:
        await super().forward(target, address, req)
        await self.replica.apply_replicated(req)


async def _primary_and_replica(nodes: list[MemoryNode]) -> tuple[MemoryNode, ReplicaPeer]:
    """'me' primary of every slot, 'r' a real replica of them; r reachable until told."""
    replica = _node(nodes, "r")
    peers = ReplicaPeer(replica)
    node = _node(nodes, "me", peers)
    for n in (node, replica):
        await n.apply_slot_map(_primary_map(1))
    return node, peers


async def test_a_retry_is_not_acknowledged_while_the_trusted_replica_lacks_the_write(
    nodes,
) -> None:
    # Arrange: a memory at 0.5 on both copies; then r and the coordinator become unreachable.
    node, peers = await _primary_and_replica(nodes)
    ids = _ids_in(4, 1)
    del peers.fail["r"]
    await _write(node, 1, ids)
    peers.fail["r"] = ConnectionError("r is unreachable")

    # Act 1: a reinforce the primary applies but cannot forward nor report; the client
    # retries it with the same request id while both are still down.
    with pytest.raises(ReplicationError):
        await _reinforce(node, 1, ids, b"rid-1")
    with pytest.raises(ReplicationError):
        await _reinforce(node, 1, ids, b"rid-1")

    # Assert 1: neither attempt was acknowledged; r, still trusted, lacks the write.
    assert _strengths(peers.replica) == {ids[0]: 0.5}
    assert _strengths(node) == {ids[0]: 0.75}

    # Act 2: r is reachable again; the client retries once more.
    del peers.fail["r"]
    assert await _reinforce(node, 1, ids, b"rid-1") == 0

    # Assert 2: acknowledged now, and both copies hold the reinforce exactly once.
    assert _strengths(peers.replica) == _strengths(node) == {ids[0]: 0.75}
    assert peers.replica.slot_seqs([4]) == node.slot_seqs([4]) == [2]
    # A further retry is acknowledged at once: nothing forwarded again.
    sent = len(peers.forwards)
    assert await _reinforce(node, 1, ids, b"rid-1") == 0
    assert len(peers.forwards) == sent


async def test_a_retry_is_acknowledged_once_the_coordinator_distrusts_the_replica(
    nodes,
) -> None:
    # Arrange: a write applied on the primary only; r and the coordinator unreachable.
    node, peers = await _primary_and_replica(nodes)
    ids = _ids_in(2, 1)
    with pytest.raises(ReplicationError):
        await _write(node, 1, ids, b"rid-2")

    # Act: the coordinator is back (r is not); the client retries.
    peers.report_fails = False
    assert await _write(node, 1, ids, b"rid-2") == 0

    # Assert: acknowledged only after the retry told the coordinator (a second report) to
    # distrust r's copies; the write is applied once on the primary.
    assert [(t, s) for t, s, _ in peers.reports] == [("r", list(range(SLOTS)))] * 2
    assert _strengths(node) == {ids[0]: 0.5} and node.slot_seqs([2]) == [1]
    assert _strengths(peers.replica) == {}


# -- a failed fsync of the journal ------------------------------------------------------------


async def test_a_failed_fsync_stops_every_later_acknowledgement(
    nodes, tmp_path, monkeypatch
) -> None:
    # Arrange: a primary whose journal fsyncs before each ack; one write is durable.
    peers = FakePeers()
    failures: list[str] = []
    reported = threading.Event()
    journal = Journal(
        tmp_path,
        lock_data_dir(tmp_path),
        SLOTS,
        0,
        "always",
        1.0,
        1 << 30,
        on_failure=lambda reason: (failures.append(reason), reported.set()),
    )
    node = MemoryNode("me", SlotStore(slots=SLOTS), peers.forward, peers.report, journal)
    nodes.append(node)
    await node.apply_slot_map(_primary_map(1))
    durable = _ids_in(1, 1)
    await _write(node, 1, durable, b"ok")
    fsyncs: list[int] = []

    def failing_fsync(fd: int) -> None:
        fsyncs.append(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(journal_mod.os, "fsync", failing_fsync)

    # Act: a write whose fsync fails, its retry, another write, a decay.
    with pytest.raises(StorageFailed, match="fsync: .*Input/output error"):
        await _write(node, 1, _ids_in(2, 1), b"lost")
    with pytest.raises(StorageFailed, match="acknowledges no more writes"):
        await _write(node, 1, _ids_in(2, 1), b"lost")
    with pytest.raises(StorageFailed):
        await _write(node, 1, _ids_in(3, 1), b"later")
    with pytest.raises(StorageFailed):
        await node.decay(1, 0.1)

    # Assert: one fsync tried, never again; reported once; nothing applied after the failed
    # write (the retry, the later write and the decay changed nothing). The report comes
    # from the fsync thread, which may still be on its way to it when the refusals arrive.
    await asyncio.to_thread(reported.wait, 10.0)
    assert len(fsyncs) == 1
    assert len(failures) == 1 and "Input/output error" in failures[0]
    assert node.slot_seqs([1, 2, 3]) == [1, 1, 0]
    assert sorted(_strengths(node)) == sorted(durable + _ids_in(2, 1))
    assert _strengths(node)[durable[0]] == 0.5
