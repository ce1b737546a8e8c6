"""coordinator/placement/rebalance.py's slot copies in chunks (issue 20 #4): with requests of a few
memories, every memory of every slot a pair copies reaches its target exactly once.

A fake worker stub answers ``CopySlots`` as a source would: it sends every memory of each
slot asked for to the request's target. Shape letters: none (lists of ids per slot).
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from coordinator.placement.rebalance import Rebalancer
from coordinator.placement.slot_map import SlotMap, WireLimits
from shared.metrics import Metrics
from shared.proto import worker_pb2

SLOTS = 16
# Slot s of the sources holds 10 + s % 4 memories (uneven, 11.5 on average over the slots
# of each source); ids distinct cluster-wide.
STORE = {s: [1000 * s + k for k in range(10 + s % 4)] for s in range(SLOTS)}
# a is primary of slots 0..7, b of 8..15; each is the other's replica. c joins empty.
MAP = SlotMap(5, ["a"] * 8 + ["b"] * 8, ["b"] * 8 + ["a"] * 8)


class FakeSources:
    """The workers' stubs: ``CopySlots`` sends each slot's memories to the target."""

    def __init__(self) -> None:
        self.received: dict[str, Counter[int]] = {}  # target -> id -> times received
        self.requests: list[tuple[str, str, list[int]]] = []  # (source, target, slots)

    def stub(self, name: str, address: str) -> SimpleNamespace:
        async def copy_slots(
            request: worker_pb2.CopySlotsRequest,
            timeout: float,  # noqa: ASYNC109 - the keyword of a grpc stub call
        ) -> worker_pb2.CopySlotsResponse:
            assert request.epoch == MAP.epoch and timeout >= 60.0
            slots = list(request.slots)
            self.requests.append((name, request.target, slots))
            got = self.received.setdefault(request.target, Counter())
            sent = [i for s in slots for i in STORE[s]]
            got.update(sent)
            return worker_pb2.CopySlotsResponse(memories=len(sent))

        return SimpleNamespace(CopySlots=copy_slots)


class FakeMembership:
    """a and b report the memories they hold as primary (as heartbeats do), c none."""

    def get(self, name: str) -> SimpleNamespace:
        primary = [s for s in range(SLOTS) if MAP.primary[s] == name]
        return SimpleNamespace(address=f"{name}:1", memories=sum(len(STORE[s]) for s in primary))


def rebalancer(sources: FakeSources, chunk_memories: int, metrics: Metrics) -> Rebalancer:
    rb = Rebalancer(
        SLOTS,
        FakeMembership(),  # type: ignore[arg-type]
        sources,  # type: ignore[arg-type]
        metrics,
        rpc_timeout_s=5.0,
        limits=WireLimits(4096, 1 << 20),
        copy_chunk_memories=chunk_memories,
        copy_pause_factor=0.0,
    )
    rb.current = MAP
    return rb


@pytest.mark.parametrize(
    ("chunk_memories", "slots_per_request"),
    [
        (1, 1),  # fewer memories than a slot holds: one slot per request
        (23, 2),  # a's and b's slots hold 11.5 memories on average
        (1 << 20, 8),  # the default's regime in a small store: the whole pair at once
    ],
)
async def test_each_memory_of_each_copied_slot_is_sent_exactly_once(
    chunk_memories: int, slots_per_request: int
) -> None:
    # Arrange: c receives a's slots 0..7 and b's slots 8..15.
    sources = FakeSources()
    metrics = Metrics()
    rb = rebalancer(sources, chunk_memories, metrics)
    copies = {("a", "c"): list(range(8)), ("b", "c"): list(range(8, 16))}

    # Act
    copied = await rb._copy(copies)

    # Assert: every memory of every slot once, the slots in order, in several requests.
    expected = Counter(i for s in range(SLOTS) for i in STORE[s])
    assert sources.received == {"c": expected}
    assert copied == sum(len(ids) for ids in STORE.values())
    for pair, slots in copies.items():
        sent = [sl for src, dst, sl in sources.requests if (src, dst) == pair]
        assert [s for sl in sent for s in sl] == slots
        assert [len(sl) for sl in sent] == [slots_per_request] * (8 // slots_per_request)
    copy_requests = metrics.registry.get_sample_value("neuroshard_slot_copy_requests_total")
    assert copy_requests == len(sources.requests)
