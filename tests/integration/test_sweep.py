"""The coordinator's Sweep through real servers: decay once, then the merged statistics and
exact global top-k, equal to the reference's decay then quality and top-k (issue 12, item 2)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from shared.client import NeuroshardError
from tests.integration.memory_helpers import assert_cluster_equals
from tests.memory_reference import ReferenceStore

pytestmark = pytest.mark.integration

SLOTS = 64


async def test_sweeps_equal_the_reference_and_a_retry_decays_nothing_twice(make_cluster) -> None:
    # Arrange: 3 workers, 8000 memories with ties at 1.0 and 0.0, reinforced once.
    cluster = await make_cluster(workers=3, slots=SLOTS)
    ref = ReferenceStore(slots=SLOTS)
    rng = np.random.default_rng(7)
    ids = rng.choice(1 << 40, size=8000, replace=False).astype(np.uint64)
    strengths = rng.choice(np.array([0, 0.5, 1, 1], np.float32), 8000)
    strengths[::3] = rng.random(len(strengths[::3]), dtype=np.float32)
    async with cluster.client() as client:
        await client.wait_ready()
        await client.upsert(ids, strengths)
        ref.upsert(ids, strengths)
        hot = rng.choice(ids, size=3000)
        boosts = rng.random(3000, dtype=np.float32) * 0.1
        await client.reinforce(hot, boosts)
        ref.reinforce(hot, boosts)

        # Act: a sweep, the same sweep again (a retry with its op id), another sweep.
        first = await client.sweep(0.01, k=25, op_id=b"sweep-1")
        ref.decay(0.01)
        retry = await client.sweep(0.01, k=25, op_id=b"sweep-1")
        second = await client.sweep(0.02, k=25)
        ref.decay(0.02)
        read = await client.sweep(0.0, k=0, want_quality=True)

    # Assert: the first two answers describe the store after one decay; the third after
    # both; a rate of 0 changed nothing; every copy equals the reference.
    assert first[0] == retry[0] == second[0] == 8000
    assert first[1] == retry[1]
    assert np.array_equal(first[2], retry[2]) and np.array_equal(first[3], retry[3])
    rq = ref.quality()
    for q in (second[1], read[1]):
        assert q["count"] == rq.count and q["histogram"] == list(rq.histogram)
        assert (q["min"], q["max"]) == (rq.min, rq.max)
        assert q["sum"] == pytest.approx(rq.sum, rel=1e-12)
    ref_ids, ref_s = ref.topk(25)
    np.testing.assert_array_equal(second[2], ref_ids)
    np.testing.assert_array_equal(second[3].view(np.uint32), ref_s.view(np.uint32))
    assert read[2].size == 0
    await assert_cluster_equals(cluster, ref)


async def test_a_sweep_with_k_above_the_limit_is_refused(make_cluster) -> None:
    cluster = await make_cluster(workers=2, slots=SLOTS)
    async with cluster.client() as client:
        await client.wait_ready()
        with pytest.raises(NeuroshardError) as err:
            await client.sweep(0.1, k=10**9)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
