"""A primary that excluded a copy target after a failed forward feeds it again once the
coordinator asks for a new copy of those slots to it, even with no new map in between (the
partition test lost acknowledged writes without it: the new copy became the slots' primary
without the writes made while it was being copied)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from shared.memory.slots import slot_of
from shared.proto import common_pb2, worker_pb2
from worker.memory.memory_node import MemoryNode
from worker.store.store import SlotSnapshot, SlotStore

SLOTS = 8


class Peers:
    """Forwards to 'new' fail while ``refuse`` is set; reports always reach the coordinator."""

    def __init__(self) -> None:
        self.refuse = True
        self.forwards: list[tuple[str, list[int]]] = []

    async def forward(self, target: str, _address: str, req: worker_pb2.ReplicateRequest) -> None:
        self.forwards.append((target, list(req.seqs)))
        if target == "new" and self.refuse:
            raise ConnectionError("slot 3 is primary on new")

    async def report(self, _target: str, _slots: list[int], _reason: str) -> None:
        return None


@pytest.fixture
def node() -> Iterator[tuple[MemoryNode, Peers]]:
    peers = Peers()
    n = MemoryNode("me", SlotStore(slots=SLOTS), peers.forward, peers.report)
    yield n, peers
    n.close()


async def _send(_target: str, _address: str, snaps: list[SlotSnapshot]) -> tuple[int, int]:
    return sum(len(s.ids) for s in snaps), 0


async def _write(node: MemoryNode, ids: np.ndarray) -> None:
    strengths = np.full(len(ids), 0.5, np.float32)
    request = worker_pb2.UpsertRequest(
        epoch=1, ids=ids.astype("<u8").tobytes(), strengths=strengths.tobytes()
    )
    await node.upsert(request, ids, strengths, None)


async def test_a_new_copy_to_an_excluded_target_is_fed_again(node) -> None:
    # Arrange: 'me' primary of every slot, 'r' its replica; a copy of slot 3 to 'new' whose
    # forward fails and is reported, so 'new' is excluded for slot 3.
    n, peers = node
    await n.apply_slot_map(
        common_pb2.SlotMap(
            epoch=1,
            slots=SLOTS,
            workers=["me", "r"],
            addresses=["me:1", "r:1"],
            primary=[0] * SLOTS,
            replica=[1] * SLOTS,
        )
    )
    candidates = np.arange(1, 1000, dtype=np.uint64)
    ids = candidates[slot_of(candidates, SLOTS) == 3][:2]
    await n.copy_to("new", "new:1", [3], _send)
    await _write(n, ids[:1])  # forward to 'new' fails: reported and excluded

    # Act: the coordinator has the slot copied to 'new' again (no new map in between), then
    # a write comes.
    peers.refuse = False
    await n.copy_to("new", "new:1", [3], _send)
    await _write(n, ids[1:])

    # Assert: the second write reached 'new' as well as 'r'.
    assert sorted(peers.forwards) == [("new", [1]), ("new", [2]), ("r", [1]), ("r", [2])]
