"""A decay is applied exactly once per memory: retried with its operation id, or re-sent by
the coordinator after a worker died between or during decays (issue 12, item 6)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import wait_until
from tests.integration.memory_helpers import SMALL_COPIES, SMALL_MESSAGES, assert_cluster_equals
from tests.integration.test_failover import FAST_HEARTBEATS, kill_abruptly
from tests.memory_reference import ReferenceStore

pytestmark = pytest.mark.integration

RATE = 0.001


async def _loaded(make_cluster, n_ids: int = 20_000):
    cluster = await make_cluster(
        workers=3, slots=64, worker_overrides=SMALL_MESSAGES, **FAST_HEARTBEATS, **SMALL_COPIES
    )
    ref = ReferenceStore(slots=64)
    ids = np.arange(n_ids, dtype=np.uint64) * 104729
    s = np.random.default_rng(0).random(n_ids, dtype=np.float32) * 0.5 + np.float32(0.25)
    client = cluster.client()
    await client.wait_ready()
    await client.upsert(ids, s)
    ref.upsert(ids, s)
    return cluster, ref, client


async def test_a_decay_repeated_with_its_op_id_is_applied_once(make_cluster) -> None:
    # Arrange
    cluster, ref, client = await _loaded(make_cluster)

    # Act: one decay sent three times with one op id (a client retrying a call whose answer
    # was lost), then another decay.
    counts = [await client.decay(RATE, op_id=b"decay-1") for _ in range(3)]
    await client.decay(RATE)
    ref.decay(RATE)
    ref.decay(RATE)

    # Assert: two decays applied, each retry counted every memory.
    assert counts == [20_000] * 3
    await assert_cluster_equals(cluster, ref)
    await client.close()


async def test_a_worker_killed_between_decays_leaves_every_memory_decayed_once(
    make_cluster,
) -> None:
    # Arrange: 3 decays on a healthy cluster.
    cluster, ref, client = await _loaded(make_cluster)
    for _ in range(3):
        assert await client.decay(RATE) == 20_000
        ref.decay(RATE)

    # Act: kill -9 a worker, then decay at once (its primaries fail until their replicas
    # are promoted), and keep decaying while the lost copies are re-created.
    await kill_abruptly(cluster.workers[1])
    dead = cluster.workers.pop(1)
    for _ in range(6):
        assert await client.decay(RATE) == 20_000
        ref.decay(RATE)
    coord = cluster.coordinator.cluster
    await wait_until(
        lambda: (
            coord.rebalancer.settled.is_set()
            and coord.slot_summary()["under_replicated_slots"] == 0
        ),
        what="replication factor back to 2",
    )

    # Assert: exactly the reference's 9 decays on every memory, on every live copy.
    assert dead.name not in coord.rebalancer.current.primary
    await assert_cluster_equals(cluster, ref)
    await client.close()
