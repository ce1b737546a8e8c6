"""The memory store over real servers: routing, replication, fan-out, bad input."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from shared.client import NeuroshardError
from tests.integration.memory_helpers import (
    SMALL_COPIES,
    SMALL_MESSAGES,
    assert_cluster_equals,
    assert_copies_were_split,
    settled_copy_counts,
)
from tests.memory_reference import ReferenceStore

pytestmark = pytest.mark.integration


async def test_operations_match_reference_with_three_workers(make_cluster) -> None:
    cluster = await make_cluster(workers=3, slots=64)
    ref = ReferenceStore(slots=64)
    rng = np.random.default_rng(1)
    ids = rng.choice(1 << 40, size=5000, replace=False).astype(np.uint64)
    strengths = rng.random(5000, dtype=np.float32)
    async with cluster.client() as client:
        await client.wait_ready()
        assert await client.upsert(ids, strengths) == 5000
        ref.upsert(ids, strengths)
        hot = rng.choice(ids, size=3000)
        boosts = rng.random(3000, dtype=np.float32) * 0.2
        await client.reinforce(hot, boosts)
        ref.reinforce(hot, boosts)
        assert await client.decay(0.05) == 5000
        ref.decay(0.05)
        q = await client.quality()
        top_ids, top_s = await client.topk(10)
        found, got, _ = await client.get(ids[:100])
    rq = ref.quality()
    assert q["count"] == rq.count and q["histogram"] == list(rq.histogram)
    assert q["min"] == pytest.approx(rq.min) and q["max"] == pytest.approx(rq.max)
    ref_ids, ref_top = ref.topk(10)
    np.testing.assert_array_equal(top_ids, ref_ids)
    np.testing.assert_array_equal(top_s, ref_top)
    assert found.all()
    np.testing.assert_array_equal(got, ref.get(ids[:100])[1])
    await assert_cluster_equals(cluster, ref)


async def test_bad_input_is_refused_and_changes_nothing(make_cluster) -> None:
    cluster = await make_cluster(workers=2, slots=16)
    ref = ReferenceStore(slots=16)
    ids = np.arange(100, dtype=np.uint64)
    async with cluster.client() as client:
        await client.wait_ready()
        await client.upsert(ids, np.full(100, 0.5, np.float32))
        ref.upsert(ids, np.full(100, 0.5, np.float32))
        bad = [
            (client.reinforce(ids, np.r_[np.ones(99), np.nan].astype(np.float32)), "boosts[99]"),
            (client.reinforce(ids, -np.ones(100, np.float32)), "boosts[0]: -1.0 is negative"),
            (client.upsert(ids, np.full(100, 1.5, np.float32)), "strengths[0]"),
            (client.upsert(ids, np.ones(99, np.float32)), "differ in length"),
            (client.upsert(ids[:1], [0.5], [b"x" * 5000]), "payloads[0]: 5000 bytes"),
            (client.decay(1.5), "rate"),
            (client.topk(0), "k: 0"),
            (client.topk(10**6), "k: 1000000 exceeds the limit 10000"),
        ]
        for call, message in bad:
            with pytest.raises(NeuroshardError) as info:
                await call
            assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert message in str(info.value)
    await assert_cluster_equals(cluster, ref)


async def test_worker_joining_moves_slots_without_loss(make_cluster) -> None:
    cluster = await make_cluster(
        workers=2, slots=32, worker_overrides=SMALL_MESSAGES, **SMALL_COPIES
    )
    ref = ReferenceStore(slots=32)
    rng = np.random.default_rng(7)
    ids = np.arange(4000, dtype=np.uint64) * 7919  # ~125 memories a slot: 2 messages each
    s = rng.random(4000, dtype=np.float32)
    async with cluster.client() as client:
        await client.wait_ready()
        await client.upsert(ids, s)
        ref.upsert(ids, s)
        copies_before = await settled_copy_counts(cluster)
        await cluster.add_worker()
        await cluster.wait_alive(3)
        rb = cluster.coordinator.cluster.rebalancer
        from tests.conftest import wait_until

        await wait_until(
            lambda: rb.settled.is_set() and len({n for n in rb.current.primary}) == 3,
            what="rebalance to 3",
        )
        boosts = np.full(4000, 0.1, np.float32)
        await client.reinforce(ids, boosts)
        ref.reinforce(ids, boosts)
        status = await client.status()
    assert status["under_replicated_slots"] == 0
    assert status["replication_factor"] == 2
    assert sum(w["slots_primary"] for w in status["workers"]) == 32
    await assert_copies_were_split(cluster, copies_before)
    await assert_cluster_equals(cluster, ref)
