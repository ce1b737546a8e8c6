"""Prioritized sampling and bulk priority updates over real servers (coordinator and workers).

Every sample is compared with the independent single-process reference fed the same
operations and seed (``tests/memory_reference.py``): ids, strengths, payloads and
probabilities, exactly. The hypothesis invariant (``test_invariant.py``) samples between
random operations, joins and kills; this file pins the API, the bad input, ``min_size``
and samples in flight while a worker is killed.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import numpy as np
import pytest

from shared.client import NeuroshardError
from shared.client.sampling import sample_from_pb, sample_request
from shared.proto import common_pb2
from tests.conftest import wait_until
from tests.integration.invariant_helpers import start_cluster
from tests.integration.memory_helpers import assert_cluster_equals
from tests.memory_reference import ReferenceStore

pytestmark = pytest.mark.integration

SLOTS = 64
KILL_HEARTBEATS = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0)


def assert_sample_equals(batch, want) -> None:
    ids, strengths, payloads, probabilities = want
    np.testing.assert_array_equal(batch.ids, ids)
    assert batch.strengths.tobytes() == strengths.tobytes()
    assert batch.payloads == payloads
    np.testing.assert_array_equal(batch.probabilities, probabilities)


async def test_samples_and_priority_updates_equal_the_reference(make_cluster) -> None:
    cluster = await make_cluster(workers=3, slots=SLOTS)
    ref = ReferenceStore(slots=SLOTS)
    rng = np.random.default_rng(5)
    ids = rng.choice(1 << 50, 2000, replace=False).astype(np.uint64)
    strengths = rng.random(2000, dtype=np.float32)
    payloads = [rng.bytes(int(rng.integers(1, 40))) for _ in range(2000)]
    async with cluster.client() as client:
        await client.wait_ready()
        await client.upsert(ids, strengths, payloads)
        ref.upsert(ids, strengths, payloads)
        for alpha, seed in [(0.6, 1), (0.0, 2), (1.0, 3), (2.5, 4)]:
            batch = await client.sample(256, alpha=alpha, seed=seed)
            assert (batch.seed, batch.size) == (seed, 2000)
            assert_sample_equals(batch, ref.sample(256, alpha, seed))
        # A learner's write-back: new priorities for drawn ids, some since deleted.
        drawn = (await client.sample(256, alpha=0.6, seed=9)).ids
        await client.delete(drawn[:10])
        ref.delete(drawn[:10])
        new = rng.random(256, dtype=np.float32)
        want = ref.update_strengths(drawn, new)
        assert await client.update_strengths(drawn, new) == want
        assert want == len(set(drawn[10:].tolist()) - set(drawn[:10].tolist()))
        assert_sample_equals(await client.sample(300, alpha=0.6, seed=10), ref.sample(300, 0.6, 10))
        await client.decay(0.3)
        ref.decay(0.3)
        assert_sample_equals(await client.sample(100, alpha=0.6, seed=11), ref.sample(100, 0.6, 11))
        unseeded = await client.sample(10, alpha=0.6, with_payloads=False)
        assert unseeded.payloads == [None] * 10
        replay = await client.sample(10, alpha=0.6, seed=unseeded.seed)
        np.testing.assert_array_equal(replay.ids, unseeded.ids)
        await client.decay(1.0)  # every strength 0: uniform over every memory
        ref.decay(1.0)
        batch = await client.sample(50, alpha=0.6, seed=12)
        assert_sample_equals(batch, ref.sample(50, 0.6, 12))
        assert (batch.probabilities == 1 / len(ref.ids)).all()
    await assert_cluster_equals(cluster, ref)


async def test_draws_follow_p_i_through_the_daemons(make_cluster) -> None:
    """Chi-square of 2 * 10**5 draws over 200 memories on 2 workers (10**6 in the unit test)."""
    cluster = await make_cluster(workers=2, slots=32)
    ids = np.arange(200, dtype=np.uint64) * 7919
    strengths = np.linspace(0.05, 1, 200, dtype=np.float32)
    async with cluster.client() as client:
        await client.wait_ready()
        await client.upsert(ids, strengths)
        drawn = np.concatenate(
            [
                (await client.sample(20_000, alpha=0.8, seed=s, with_payloads=False)).ids
                for s in range(10)
            ]
        )
    w = np.rint(strengths.astype(np.float64) ** 0.8 * 2**32)
    expected = len(drawn) * w / w.sum()
    observed = np.array([np.count_nonzero(drawn == i) for i in ids])
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = len(ids) - 1
    c = 2.0 / (9.0 * df)
    bound = df * (1 - c + 4.75 * math.sqrt(c)) ** 3  # Wilson-Hilferty, p ~ 1e-6
    assert stat < bound, f"chi-square {stat:.1f} over {df} df"


async def test_bad_sample_and_update_requests_are_refused_and_change_nothing(make_cluster) -> None:
    cluster = await make_cluster(workers=2, slots=16, max_sample_batch=100)
    ref = ReferenceStore(slots=16)
    ids = np.arange(50, dtype=np.uint64)
    async with cluster.client() as client:
        await client.wait_ready()
        with pytest.raises(NeuroshardError) as empty:
            await client.sample(5)
        assert empty.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "table 'default' is empty" in str(empty.value)
        await client.upsert(ids, np.full(50, 0.5, np.float32), [b"p"] * 50)
        ref.upsert(ids, np.full(50, 0.5, np.float32), [b"p"] * 50)
        bad = [
            (
                client.sample(5, table="replay"),
                grpc.StatusCode.NOT_FOUND,
                "table 'replay' does not exist",
            ),
            (client.sample(0), grpc.StatusCode.INVALID_ARGUMENT, "n: 0 must be >= 1"),
            (client.sample(101), grpc.StatusCode.INVALID_ARGUMENT, "n: 101 is not in [1, 100]"),
            (client.sample(5, alpha=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "alpha: -0.5"),
            (client.sample(5, alpha=math.inf), grpc.StatusCode.INVALID_ARGUMENT, "alpha: inf"),
            (client.sample(5, alpha=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "alpha: nan"),
            (
                client.sample(5, replacement=False),
                grpc.StatusCode.INVALID_ARGUMENT,
                "replacement: sampling without replacement is not supported",
            ),
            (
                client.update_strengths(ids[:2], [0.5, 1.5]),
                grpc.StatusCode.INVALID_ARGUMENT,
                "strengths[1]: 1.5 is outside [0, 1]",
            ),
            (
                client.update_strengths(ids[:2], [0.5]),
                grpc.StatusCode.INVALID_ARGUMENT,
                "ids and strengths differ in length",
            ),
        ]
        for call, code, message in bad:
            with pytest.raises(NeuroshardError) as info:
                await call
            assert info.value.code is code, str(info.value)
            assert message in str(info.value)
    await assert_cluster_equals(cluster, ref)


async def test_min_size_waits_for_the_table_then_refuses_naming_the_size(make_cluster) -> None:
    cluster = await make_cluster(workers=2, slots=16)
    ids = np.arange(30, dtype=np.uint64)
    async with cluster.client() as client:
        await client.wait_ready()
        await client.upsert(ids[:10], np.full(10, 0.5, np.float32))
        with pytest.raises(NeuroshardError) as info:
            await client.sample(4, min_size=20, timeout_s=0.3)
        assert info.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "holds 10 memories, fewer than min_size 20, after 0.3 s" in str(info.value)

        waiting = asyncio.create_task(client.sample(4, min_size=20, timeout_s=30, seed=1))
        answered, _ = await asyncio.wait({waiting}, timeout=0.2)  # it polls, it must not answer
        assert not answered
        await client.upsert(ids[10:], np.full(20, 0.5, np.float32))
        batch = await asyncio.wait_for(waiting, 10)
        assert batch.size == 30 and len(batch.ids) == 4


async def test_samples_in_flight_across_a_kill_equal_the_reference(tmp_path) -> None:
    """Samples keep coming while a worker dies (as kill -9): each one that answers is exact.

    Nothing is written meanwhile, so every seeded sample, before, during and after the
    failover, must equal the reference's draws; the ones in flight at the kill are started
    over by the coordinator once the map moved past the dead worker.
    """
    cluster = await start_cluster(tmp_path, 3, SLOTS, **KILL_HEARTBEATS)
    try:
        ref = ReferenceStore(slots=SLOTS)
        ids = np.arange(1, 3001, dtype=np.uint64) * 1_000_003
        strengths = np.random.default_rng(8).random(3000, dtype=np.float32)
        payloads = [bytes([int(i) % 251]) * 16 for i in ids]
        ref.upsert(ids, strengths, payloads)
        async with cluster.client() as client:
            await client.upsert(ids, strengths, payloads)
            stop = asyncio.Event()
            answered: list[int] = []

            async def sample_until_stopped() -> None:
                seed = 0
                while not stop.is_set():
                    seed += 1
                    batch = await asyncio.wait_for(client.sample(64, alpha=0.6, seed=seed), 30)
                    assert_sample_equals(batch, ref.sample(64, 0.6, seed))
                    answered.append(seed)

            sampler = asyncio.create_task(sample_until_stopped())
            await wait_until(lambda: len(answered) >= 3, what="samples before the kill")
            await cluster.kill(1)
            epoch = cluster.coordinator.cluster.rebalancer.current.epoch
            await wait_until(
                lambda: (
                    cluster.coordinator.cluster.rebalancer.current.epoch > epoch
                    and len(answered) >= 10
                ),
                what="the failover, and samples after it",
                timeout_s=30,
            )
            stop.set()
            await sampler
    finally:
        await cluster.stop()


async def test_a_sample_through_the_primaries_equals_the_coordinators(
    make_cluster, monkeypatch
) -> None:
    """The client draws through the primaries itself (no coordinator hop); a seed gives the
    same draws, probabilities, size and W as the coordinator's Sample, and the reference's;
    a stale map or a min_size wait goes the coordinator's way."""
    # Arrange: 500 memories with payloads; the coordinator's sampler counted
    cluster = await make_cluster(workers=3, slots=SLOTS)
    ref = ReferenceStore(slots=SLOTS)
    rng = np.random.default_rng(7)
    ids = rng.choice(1 << 50, 500, replace=False).astype(np.uint64)
    strengths = rng.random(500, dtype=np.float32)
    payloads = [rng.bytes(int(rng.integers(1, 40))) for _ in range(500)]
    sampler = cluster.coordinator.cluster.sampler
    through_coordinator: list[int] = []
    plain = sampler.sample

    async def counted(*args, **kwargs):
        through_coordinator.append(1)
        return await plain(*args, **kwargs)

    monkeypatch.setattr(sampler, "sample", counted)
    async with cluster.client() as client:
        await client.wait_ready()
        await client.upsert(ids, strengths, payloads)
        ref.upsert(ids, strengths, payloads)

        # Act: direct samples; the coordinator's for the same seeds; a stale map; min_size
        direct = [await client.sample(128, alpha=0.6, seed=s) for s in range(4)]
        direct_calls = len(through_coordinator)
        via = [
            sample_from_pb(
                await client._stub.Sample(sample_request("", 128, 0.6, True, s, 0, 30.0, True))
            )
            for s in range(4)
        ]
        router = client._router
        stale = common_pb2.SlotMap()
        stale.CopyFrom(router.cached_map)
        stale.epoch -= 1
        router._map = stale
        after_stale = await client.sample(128, alpha=0.6, seed=0)
        waited = await client.sample(128, alpha=0.6, seed=1, min_size=1)
        again = await client.sample(128, alpha=0.6, seed=2)  # direct with the refreshed map

    # Assert
    assert direct_calls == 0
    for s, (a, b) in enumerate(zip(direct, via, strict=True)):
        assert (
            (a.seed, a.size, a.total_weight)
            == (b.seed, b.size, b.total_weight)
            == (
                s,
                500,
                b.total_weight,
            )
        )
        np.testing.assert_array_equal(a.ids, b.ids)
        assert a.strengths.tobytes() == b.strengths.tobytes()
        assert a.payloads == b.payloads
        assert a.probabilities.tobytes() == b.probabilities.tobytes()
        assert_sample_equals(a, ref.sample(128, 0.6, s))
    assert len(through_coordinator) == 4 + 2  # the stale map's sample and min_size's
    np.testing.assert_array_equal(after_stale.ids, direct[0].ids)
    np.testing.assert_array_equal(waited.ids, direct[1].ids)
    np.testing.assert_array_equal(again.ids, direct[2].ids)
