"""Writes made inside the fence map (published after a join's copies and before its target
map) reach the copies the join made: regression tests of two replication bugs the invariant
test found, made deterministic by holding one side of the fence on an event."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from shared.memory.slots import assign_slots, slot_of
from shared.proto import worker_pb2, worker_pb2_grpc
from shared.rpc import channel
from shared.rpc.codec import f32_to_bytes, ids_to_bytes
from tests.conftest import InProcessCluster
from tests.integration.invariant_helpers import (
    OP_TIMEOUT_S,
    POOL,
    apply_both,
    assert_invariant,
    assert_queries_match,
    join_then_settle,
    start_cluster,
)
from tests.memory_reference import ReferenceStore

pytestmark = pytest.mark.integration


def slots_fed_by_keepers(old: list[str], joiner: str, slots: int) -> dict[int, str]:
    """slot -> primary, for the slots whose primary keeps every primary role when ``joiner``
    joins (so it adopts each map together with the joiner, not in the first group) and whose
    new replica is the joiner (so it feeds the joiner's copy through the fence)."""
    before, after = sorted(old), sorted([*old, joiner])
    p0, _ = assign_slots(before, slots)
    p1, r1 = assign_slots(after, slots)
    moved = {
        before[a] for a, b in zip(p0.tolist(), p1.tolist(), strict=True) if before[a] != after[b]
    }
    return {
        s: after[p1[s]]
        for s in range(slots)
        if after[p1[s]] not in moved and after[r1[s]] == joiner
    }


class FenceHold:
    """Holds one side of the fence map (published after the copies, before the target) until
    the test has written inside it.

    ``adoption``: the keepers adopt the fence only once released, after the joiner did, so
    their forwards come from the older epoch. ``window``: the coordinator publishes the
    target only once released, so the keepers write at the fence's epoch.
    """

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, where: str, joiner: str, keepers: set[str]
    ) -> None:
        from coordinator.placement.rebalance import Rebalancer
        from worker.memory.memory_node import MemoryNode

        self.reached, self.release = asyncio.Event(), asyncio.Event()
        if where == "adoption":
            apply = MemoryNode.apply_slot_map

            async def held_apply(node: MemoryNode, m) -> int:
                fence = m.epoch > node.epoch and min(m.primary) < 0
                if fence and node.name in keepers:
                    await self.release.wait()
                epoch = await apply(node, m)
                if fence and node.name == joiner:
                    self.reached.set()
                return epoch

            monkeypatch.setattr(MemoryNode, "apply_slot_map", held_apply)
        else:
            publish = Rebalancer._publish

            async def held_publish(rb: Rebalancer, new) -> None:
                await publish(rb, new)
                if "" in new.primary:
                    self.reached.set()
                    await self.release.wait()

            monkeypatch.setattr(Rebalancer, "_publish", held_publish)


async def reinforce_at_own_epoch(
    cluster: InProcessCluster, name: str, ids: np.ndarray, boosts: np.ndarray
) -> None:
    """Reinforce on worker ``name`` directly, at the epoch it is at (routing would refresh
    to the coordinator's newer map, which the held worker refuses)."""
    worker = next(w for w in cluster.workers if w.name == name)
    epoch = worker.nodes.get().epoch
    async with channel(worker.address) as ch:
        request = worker_pb2.ReinforceRequest(
            epoch=epoch, ids=ids_to_bytes(ids), boosts=f32_to_bytes(boosts)
        )
        await worker_pb2_grpc.WorkerStub(ch).Reinforce(request, timeout=OP_TIMEOUT_S)


@pytest.mark.parametrize("where", ["adoption", "window"])
async def test_writes_inside_the_fence_reach_the_new_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Regression: a joining worker that had its copy but no role yet refused forwards from
    an older epoch (``adoption``), and primaries forgot their copy targets on adopting the
    fence (``window``); either way the new copy missed the writes made inside the fence."""
    fed = slots_fed_by_keepers([f"worker-{i}" for i in range(4)], "worker-4", 16)
    assert fed, "4 workers and 16 slots no longer give a slot fed by a keeper"
    ids_slot = slot_of(POOL, 16)
    cluster = await start_cluster(tmp_path, 4, 16)
    hold = FenceHold(monkeypatch, where, "worker-4", set(fed.values()))
    ref = ReferenceStore(slots=16)
    settle: asyncio.Task[None] | None = None
    try:
        async with cluster.client() as client:
            await apply_both(client, ref, 0, ("bulk_upsert", 400, 1, True))
            settle = asyncio.create_task(join_then_settle(cluster))
            async with asyncio.timeout(20):
                await hold.reached.wait()
            for s, keeper in fed.items():
                ids = POOL[ids_slot == s]
                boosts = np.full(len(ids), 0.01, np.float32)
                if where == "adoption":
                    await reinforce_at_own_epoch(cluster, keeper, ids, boosts)
                    ref.reinforce(ids, boosts)
                else:
                    await apply_both(client, ref, s, ("reinforce_ids", ids, boosts))
            hold.release.set()
            await settle
            await assert_invariant(cluster, ref)
            await assert_queries_match(cluster, client, ref, 10)
    finally:
        hold.release.set()
        if settle is not None and not settle.done():
            settle.cancel()
        await cluster.stop()
