"""Losing or draining a worker while a client writes: nothing acknowledged is lost."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.conftest import wait_until
from tests.integration.memory_helpers import (
    SMALL_COPIES,
    SMALL_MESSAGES,
    assert_cluster_equals,
    assert_copies_were_split,
    settled_copy_counts,
)
from tests.memory_reference import ReferenceStore

pytestmark = pytest.mark.integration

FAST_HEARTBEATS = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6)


async def kill_abruptly(worker) -> None:
    """Stop serving and heartbeating at once, as kill -9 would (no drain, no goodbye)."""
    if worker._tasks is not None:
        worker._tasks.cancel()
    await worker.rpc.server.stop(0)


class Writer:
    """Upserts and reinforces continuously; records only acknowledged operations."""

    def __init__(self, client, ref: ReferenceStore, ids: np.ndarray) -> None:
        self.client, self.ref, self.ids = client, ref, ids
        self.acked = 0
        self.failures: list[str] = []
        self._stop = asyncio.Event()
        self._rng = np.random.default_rng(3)

    async def run(self) -> None:
        while not self._stop.is_set():
            batch = self._rng.choice(self.ids, size=500)
            boosts = self._rng.random(500, dtype=np.float32) * 0.01
            try:
                await self.client.reinforce(batch, boosts)
            except Exception as exc:  # counted: the test asserts on it
                self.failures.append(str(exc))
                continue
            self.ref.reinforce(batch, boosts)
            self.acked += 1

    async def stop(self) -> None:
        self._stop.set()


async def _loaded_cluster(make_cluster, n_ids: int = 20_000):
    cluster = await make_cluster(
        workers=3, slots=64, worker_overrides=SMALL_MESSAGES, **FAST_HEARTBEATS, **SMALL_COPIES
    )
    ref = ReferenceStore(slots=64)
    ids = np.arange(n_ids, dtype=np.uint64) * 104729
    s = np.random.default_rng(0).random(n_ids, dtype=np.float32) * 0.5
    client = cluster.client()
    await client.wait_ready()
    await client.upsert(ids, s)
    ref.upsert(ids, s)
    return cluster, ref, ids, client


async def test_killed_worker_loses_no_acknowledged_write(make_cluster) -> None:
    cluster, ref, ids, client = await _loaded_cluster(make_cluster)
    writer = Writer(client, ref, ids)
    task = asyncio.create_task(writer.run())
    await wait_until(lambda: writer.acked >= 5, what="writes before the kill")
    copies_before = await settled_copy_counts(cluster)

    await kill_abruptly(cluster.workers[1])
    coord = cluster.coordinator.cluster
    await wait_until(lambda: len(coord.membership.alive()) == 2, what="failure detected")
    await wait_until(
        lambda: (
            coord.rebalancer.settled.is_set()
            and coord.slot_summary()["under_replicated_slots"] == 0
        ),
        what="replication factor back to 2",
    )
    acked_at_recovery = writer.acked
    await wait_until(lambda: writer.acked >= acked_at_recovery + 5, what="writes after")
    await writer.stop()
    await task

    assert writer.failures == []
    await assert_copies_were_split(cluster, copies_before)
    cluster.workers.pop(1)  # already stopped; assert_cluster_equals reads live workers only
    await assert_cluster_equals(cluster, ref)
    status = await client.status()
    assert status["replication_factor"] == 2 and status["under_replicated_slots"] == 0
    await client.close()


async def test_drained_worker_hands_over_and_no_request_fails(make_cluster) -> None:
    cluster, ref, ids, client = await _loaded_cluster(make_cluster)
    writer = Writer(client, ref, ids)
    task = asyncio.create_task(writer.run())
    await wait_until(lambda: writer.acked >= 5, what="writes before the drain")
    copies_before = await settled_copy_counts(cluster)

    leaving = cluster.workers[2]
    assert await leaving.drain()
    await leaving.stop()
    cluster.workers.pop(2)
    acked = writer.acked
    await wait_until(lambda: writer.acked >= acked + 5, what="writes after the drain")
    await writer.stop()
    await task

    assert writer.failures == []
    await assert_copies_were_split(cluster, copies_before)
    coord = cluster.coordinator.cluster
    assert "worker-2" not in set(
        coord.rebalancer.current.primary + coord.rebalancer.current.replica
    )
    await assert_cluster_equals(cluster, ref)
    await client.close()
