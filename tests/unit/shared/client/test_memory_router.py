"""Tests for shared/client/memory.py: MemoryRouter's routing with a fake slot map, no cluster.

The router's worker channels are replaced by fake stubs that record every request, so the
tests see which worker each id was sent to, with which epoch, in how many requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from grpc import aio

from shared.client import memory
from shared.client.memory import MemoryRouter, RoutingError
from shared.memory.slots import slot_of
from shared.proto import common_pb2, worker_pb2
from shared.rpc.codec import ids_from_bytes

SLOTS = 16
WORKERS = ["w0", "w1", "w2"]


class FakeStub:
    """A worker that records its Upsert requests and refuses maps older than ``epoch``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.epoch = 0  # the worker's map epoch; 0 accepts any
        self.down = False  # answer every call UNAVAILABLE, as a killed worker's channel does
        self.upserts: list[worker_pb2.UpsertRequest] = []

    async def Upsert(  # noqa: N802 - the proto's RPC name
        self,
        req: worker_pb2.UpsertRequest,
        timeout: float,  # noqa: ASYNC109 - the keyword of a grpc stub call
    ) -> worker_pb2.WriteResponse:
        if self.down:
            raise aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, aio.Metadata(), aio.Metadata(), details="refused"
            )
        if req.epoch < self.epoch:
            raise aio.AioRpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                aio.Metadata(),
                aio.Metadata(),
                details=f"stale epoch {req.epoch} < {self.epoch}",
            )
        self.upserts.append(req)
        return worker_pb2.WriteResponse(applied=len(ids_from_bytes(req.ids)))


class FakeWorkers:
    """Stands in for ``WorkerClients``: one FakeStub per worker name, no channels."""

    stubs: dict[str, FakeStub] = {}

    def __init__(self, max_message_bytes: int, security: object = None) -> None:
        pass

    def stub(self, name: str, address: str) -> FakeStub:
        assert address == f"{name}:1", "the stub is looked up by the worker's own address"
        return FakeWorkers.stubs[name]

    async def close(self) -> None:
        pass


@pytest.fixture
def stubs(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, FakeStub]]:
    """Fake workers w0..w2, installed in place of the router's worker channels."""
    FakeWorkers.stubs = {name: FakeStub(name) for name in WORKERS}
    monkeypatch.setattr(memory, "WorkerClients", FakeWorkers)
    yield FakeWorkers.stubs


def make_map(epoch: int = 1, max_batch_items: int = 0) -> common_pb2.SlotMap:
    """A map of 16 slots: slot s has primary s % 3 and replica (s + 1) % 3."""
    return common_pb2.SlotMap(
        epoch=epoch,
        slots=SLOTS,
        workers=WORKERS,
        addresses=[f"{w}:1" for w in WORKERS],
        primary=[s % 3 for s in range(SLOTS)],
        replica=[(s + 1) % 3 for s in range(SLOTS)],
        max_batch_items=max_batch_items,
    )


def router_with(*maps: common_pb2.SlotMap, retry_budget_s: float = 5.0) -> MemoryRouter:
    """A router whose coordinator hands out ``maps`` in turn (the last one repeats)."""
    queue = list(maps)

    async def fetch() -> common_pb2.SlotMap:
        return queue.pop(0) if len(queue) > 1 else queue[0]

    return MemoryRouter(
        fetch, timeout_s=1.0, max_message_bytes=1 << 20, retry_budget_s=retry_budget_s
    )


def sent(stub: FakeStub) -> list[np.ndarray]:
    """The ids of each request ``stub`` received, in order."""
    return [ids_from_bytes(r.ids) for r in stub.upserts]


def upsert_args(n: int) -> tuple[np.ndarray, np.ndarray, None]:
    ids = np.arange(1000, 1000 + n, dtype=np.uint64)
    return ids, np.full(n, 0.5, np.float32), None


async def test_each_id_goes_to_the_primary_of_its_slot(stubs: dict[str, FakeStub]) -> None:
    # Arrange
    router = router_with(make_map())
    ids, strengths, payloads = upsert_args(200)

    # Act
    applied = await router.upsert(ids, strengths, payloads)

    # Assert: every id reached exactly the worker primary for its slot, in batch order
    assert applied == 200
    expected_owner = slot_of(ids, SLOTS) % 3
    for w, name in enumerate(WORKERS):
        got = np.concatenate(sent(stubs[name]))
        np.testing.assert_array_equal(got, ids[expected_owner == w])
    assert all(len(s.upserts) == 1 for s in stubs.values())  # one request per worker
    assert {r.epoch for s in stubs.values() for r in s.upserts} == {1}


async def test_route_returns_every_position_once(stubs: dict[str, FakeStub]) -> None:
    router = router_with(make_map())
    ids = np.arange(50, dtype=np.uint64)

    async def call(stub: FakeStub, epoch: int, idx: np.ndarray) -> str:
        return stub.name

    parts = await router.route(ids, call)

    positions = np.sort(np.concatenate([p for p, _ in parts]))
    np.testing.assert_array_equal(positions, np.arange(50))
    for p, name in parts:
        assert set((slot_of(ids[p], SLOTS) % 3).tolist()) == {WORKERS.index(name)}


async def test_batches_over_max_batch_items_are_split_on_slot_boundaries(
    stubs: dict[str, FakeStub],
) -> None:
    # Arrange: 300 ids over 16 slots (~19 per slot, ~100 per worker), at most 40 per request
    limit = 40
    router = router_with(make_map(max_batch_items=limit))
    ids, strengths, payloads = upsert_args(300)

    # Act
    applied = await router.upsert(ids, strengths, payloads)

    # Assert
    assert applied == 300
    requests = [r for s in stubs.values() for r in sent(s)]
    assert len(requests) > len(WORKERS)  # the batch was split
    assert all(len(r) <= limit for r in requests)
    slot_sets = [set(slot_of(r, SLOTS).tolist()) for r in requests]
    for i, a in enumerate(slot_sets):  # each slot's items travel in one request
        for b in slot_sets[i + 1 :]:
            assert not a & b
    np.testing.assert_array_equal(np.sort(np.concatenate(requests)), ids)
    rids = {r.request_id for s in stubs.values() for r in s.upserts}
    assert len(rids) == 1  # all pieces share the batch's request id (workers dedup by it)


async def test_a_hot_slot_over_max_batch_items_goes_in_chunks_with_derived_request_ids(
    stubs: dict[str, FakeStub],
) -> None:
    # Arrange: 100 items, 70 of them one hot id (one slot), at most 40 per request. A slot's
    # items cannot be cut under one request id (workers dedup per id and slot), so the
    # router sends chunks of 40 in batch order, each with its own id (the memory job's
    # chunking, moved here: review finding "chunk in the router's write path once").
    limit = 40
    router = router_with(make_map(max_batch_items=limit))
    ids = np.concatenate([np.full(70, 7, np.uint64), np.arange(100, 130, dtype=np.uint64)])
    order = np.random.default_rng(0).permutation(len(ids))
    ids = ids[order]
    strengths = np.full(len(ids), 0.5, np.float32)

    # Act
    applied = await router.upsert(ids, strengths, None, request_id=b"job/3/reinforce")

    # Assert
    requests = [r for s in stubs.values() for r in s.upserts]
    assert applied == len(ids)
    assert all(len(ids_from_bytes(r.ids)) <= limit for r in requests)
    by_rid: dict[bytes, list[np.ndarray]] = {}
    for r in requests:
        by_rid.setdefault(r.request_id, []).append(ids_from_bytes(r.ids))
    assert list(by_rid) == [b"job/3/reinforce", b"job/3/reinforce.1", b"job/3/reinforce.2"]
    for c, rid in enumerate(by_rid):  # chunk c: batch positions [40c, 40c + 40), in turn
        np.testing.assert_array_equal(
            np.sort(np.concatenate(by_rid[rid])), np.sort(ids[40 * c : 40 * c + 40])
        )


def test_chunk_request_ids_are_derived_and_stay_within_the_limit() -> None:
    long = b"x" * 64

    assert memory.chunk_request_id(b"a/1/reinforce", 0) == b"a/1/reinforce"
    assert memory.chunk_request_id(b"a/1/reinforce", 12) == b"a/1/reinforce.12"
    assert memory.chunk_request_id(long, 0) == long
    derived = memory.chunk_request_id(long, 1)
    assert len(derived) == 16 and derived == memory.chunk_request_id(long, 1)
    assert derived != memory.chunk_request_id(long, 2)


async def test_a_fenced_slot_raises_unavailable(stubs: dict[str, FakeStub]) -> None:
    # Arrange: slot 3 has no primary (fenced during a hand-over)
    m = make_map()
    m.primary[3] = -1
    router = router_with(m, retry_budget_s=0.0)
    ids = np.arange(0, 400, dtype=np.uint64)
    fenced = int((slot_of(ids, SLOTS) == 3).sum())
    assert fenced > 0

    # Act
    with pytest.raises(RoutingError) as err:
        await router.upsert(ids, np.full(len(ids), 0.5, np.float32), None)

    # Assert
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert str(err.value) == (
        f"{fenced} of {len(ids)} items not delivered: slot has no primary yet"
    )


async def test_a_map_without_epoch_is_unavailable(stubs: dict[str, FakeStub]) -> None:
    router = router_with(common_pb2.SlotMap(epoch=0, slots=SLOTS), retry_budget_s=0.0)

    with pytest.raises(RoutingError) as err:
        await router.upsert(*upsert_args(5))

    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "the cluster has no slot map yet" in str(err.value)
    assert not any(s.upserts for s in stubs.values())


async def test_an_unusable_map_is_unavailable(stubs: dict[str, FakeStub]) -> None:
    m = make_map()
    m.primary[0] = 7  # no worker 7

    with pytest.raises(RoutingError) as err:
        await router_with(m).upsert(*upsert_args(5))

    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert str(err.value).startswith("the coordinator's slot map is unusable: primary[0]: 7")


async def test_a_stale_epoch_refreshes_the_map_and_resends(stubs: dict[str, FakeStub]) -> None:
    # Arrange: the router's first map is epoch 1; w1 already runs epoch 2, where w1 has
    # handed every slot to w2.
    new = make_map(epoch=2)
    new.primary[:] = [2 if p == 1 else p for p in new.primary]
    stubs["w1"].epoch = 2
    router = router_with(make_map(epoch=1), new)
    ids, strengths, payloads = upsert_args(200)

    # Act
    applied = await router.upsert(ids, strengths, payloads)

    # Assert: w1's part was refused, then resent with epoch 2 to the new primary w2
    assert applied == 200
    assert not stubs["w1"].upserts
    assert [r.epoch for r in stubs["w2"].upserts] == [1, 2]
    owner = slot_of(ids, SLOTS) % 3
    np.testing.assert_array_equal(sent(stubs["w2"])[1], ids[owner == 1])
    assert (await router.slot_map()).epoch == 2  # the refreshed map is cached


async def test_the_map_is_fetched_once_and_cached(stubs: dict[str, FakeStub]) -> None:
    fetches = 0

    async def fetch() -> common_pb2.SlotMap:
        nonlocal fetches
        fetches += 1
        return make_map()

    router = MemoryRouter(fetch, timeout_s=1.0, max_message_bytes=1 << 20)
    await router.upsert(*upsert_args(10))
    await router.upsert(*upsert_args(10))

    assert fetches == 1


def promoted_map(dead: str, epoch: int) -> common_pb2.SlotMap:
    """``make_map`` after a failover: the dead worker's primary slots go to their replicas."""
    m = make_map(epoch=epoch)
    d = WORKERS.index(dead)
    m.primary[:] = [r if p == d else p for p, r in zip(m.primary, m.replica, strict=True)]
    return m


async def test_only_the_dead_primarys_part_waits_for_the_failover(
    stubs: dict[str, FakeStub],
) -> None:
    # Arrange: w1 is down; the coordinator promotes its replicas once w1 is reported
    stubs["w1"].down = True
    current = make_map(epoch=1)
    events: list[tuple[str, object]] = []

    async def fetch() -> common_pb2.SlotMap:
        return current

    async def report(worker: str, reason: str) -> None:
        nonlocal current
        events.append(("reported", worker))
        current = promoted_map(worker, epoch=2)
        events.append(("promoted", 2))

    router = MemoryRouter(fetch, timeout_s=1.0, max_message_bytes=1 << 20, report=report)
    ids, strengths, payloads = upsert_args(300)
    owner = slot_of(ids, SLOTS) % 3

    # Act
    applied = await router.upsert(
        ids, strengths, payloads, progress=lambda n: events.append(("acked", n))
    )

    # Assert: w0's and w2's parts were acknowledged before the report and the promotion;
    # w1's part after, sent once more to its promoted replica w2 with the same request id
    assert applied == 300
    first = events.index(("reported", "w1"))
    acked_before = sorted(n for kind, n in events[:first] if kind == "acked")
    assert acked_before == sorted([int((owner == 0).sum()), int((owner == 2).sum())])
    assert events[first + 1 :] == [("promoted", 2), ("acked", int((owner == 1).sum()))]
    assert [r.epoch for r in stubs["w2"].upserts] == [1, 2]
    assert len({r.request_id for s in stubs.values() for r in s.upserts}) == 1


async def test_a_changed_map_resends_at_once_and_an_unchanged_one_backs_off(
    stubs: dict[str, FakeStub], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange: w1 is down for two rounds under the same map, then the map moves on
    stubs["w1"].down = True
    maps = [make_map(epoch=1)] * 4 + [promoted_map("w1", epoch=2)]
    sleeps: list[float] = []

    async def no_sleep(s: float) -> None:
        sleeps.append(s)

    monkeypatch.setattr(memory.asyncio, "sleep", no_sleep)
    router = router_with(*maps)

    # Act
    await router.upsert(*upsert_args(100))

    # Assert: the router slept twice while the map stayed at epoch 1, not after epoch 2
    assert len(sleeps) == 2
    assert [r.epoch for r in stubs["w2"].upserts] == [1, 2]


async def test_a_worker_is_reported_at_most_every_quarter_second(
    stubs: dict[str, FakeStub], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange: w1 stays down; three rounds of retries under the same map
    stubs["w1"].down = True
    reports: list[str] = []

    async def fetch() -> common_pb2.SlotMap:
        return make_map()

    async def report(worker: str, reason: str) -> None:
        reports.append(worker)

    real_sleep = asyncio.sleep

    async def no_sleep(s: float) -> None:
        await real_sleep(0)

    monkeypatch.setattr(memory.asyncio, "sleep", no_sleep)
    router = MemoryRouter(
        fetch, timeout_s=1.0, max_message_bytes=1 << 20, retry_budget_s=0.05, report=report
    )

    # Act
    with pytest.raises(RoutingError):
        await router.upsert(*upsert_args(100))
    await real_sleep(0)  # let the background report run

    # Assert: one report however many retries (the coordinator probes once)
    assert reports == ["w1"]
