"""The memory-store invariant at cluster level, property-tested with hypothesis.

docs/architecture.md ("Invariants"): for any sequence of operations and any number of workers, the
cluster's ``{id: strength}`` equals a single-process NumPy reference applying the same
operations, bit for bit (float32), and both copies of every slot are identical.

Each hypothesis example drives a real in-process cluster (coordinator and workers on port 0,
served by this test's event loop) through random upserts (duplicate ids, with and without
payloads), reinforces (duplicates add, unknown ids skipped), priority updates (unknown
ids skipped, payloads kept), deletes, decays, seeded prioritized samples (compared draw
for draw) and workers joining, between operations or while they run; it applies the same
operations to ``ReferenceStore`` and compares every return value; after every join and at the end it
compares every copy of every slot (contents, payloads and sequence numbers) and checks that
no primary ever failed to update a copy, and at the end it compares quality, top-k, get and
status. ``test_fence.py`` pins down the two replication bugs the join-under-traffic
property found. A third property kills a worker (as kill -9 would) between two operations:
its slots fail over and their lost copies are re-created while the operations go on, and the
cluster must still equal the reference, every copy identical.

Speed: one cluster serves the examples of a test while it is clean (the example ended by
deleting every id it could have written) and has its initial size; an example that joined
workers or failed leaves it to be rebuilt (~0.1 s). So every example starts from the same
membership and an empty store, and a failing example replays the same way while hypothesis
shrinks it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import wait_until
from tests.integration.invariant_helpers import (
    ALL,
    POOL,
    ClusterPool,
    apply_both,
    assert_copies_identical,
    assert_invariant,
    assert_queries_match,
    wait_settled,
)
from tests.integration.memory_helpers import assert_cluster_equals
from tests.memory_reference import ReferenceStore

pytestmark = pytest.mark.integration

# --- operations ---------------------------------------------------------------------------

IDX = st.integers(0, len(POOL) - 1)
ANY_IDX = st.integers(0, len(ALL) - 1)
STRENGTH = st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0, 1, width=32)
BOOST = st.sampled_from([0.0, 0.25, 1.0, 3.0]) | st.floats(0, 1.5, width=32)
RATE = st.sampled_from([0.0, 0.1, 1.0]) | st.floats(0, 1, width=32)
SEED = st.integers(0, 2**16)

OPS = st.one_of(
    st.tuples(
        st.just("upsert"),
        st.lists(st.tuples(IDX, STRENGTH, st.binary(max_size=8)), min_size=1, max_size=30),
        st.booleans(),
    ),
    st.tuples(st.just("bulk_upsert"), st.integers(1, 400), SEED, st.booleans()),
    st.tuples(st.just("reinforce"), st.lists(st.tuples(ANY_IDX, BOOST), max_size=30)),
    st.tuples(st.just("bulk_reinforce"), st.integers(1, 400), SEED),
    st.tuples(st.just("update"), st.lists(st.tuples(ANY_IDX, STRENGTH), max_size=30)),
    st.tuples(st.just("bulk_update"), st.integers(1, 400), SEED),
    st.tuples(st.just("delete"), st.lists(ANY_IDX, max_size=30)),
    st.tuples(st.just("decay"), RATE),
    st.tuples(st.just("sample"), st.integers(1, 300), st.sampled_from([0.0, 0.6, 1.0, 1.7]), SEED),
)
MAX_OPS = 8


@pytest.fixture
async def pool(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ClusterPool]:
    workers, slots, *overrides = request.param
    p = ClusterPool(tmp_path, workers, slots, **(overrides[0] if overrides else {}))
    yield p
    await p.close()


# --- the property ------------------------------------------------------------------------


async def run_example(pool: ClusterPool, ops: list[tuple], joins: list[int], k: int) -> None:
    """Apply ``ops`` to the cluster and the reference, a worker joining before op ``i`` for
    each ``i`` in ``joins`` (``i >= len(ops)``: after the last one); check along the way."""
    cluster = await pool.checkout()
    ref = ReferenceStore(slots=pool.slots)
    async with cluster.client() as client:
        at = [min(j, len(ops)) for j in joins]
        for i in range(len(ops) + 1):
            for _ in range(at.count(i)):
                await cluster.add_worker()
                await wait_settled(cluster)
                await assert_invariant(cluster, ref)
            if i < len(ops):
                await apply_both(client, ref, i, ops[i])
        await assert_invariant(cluster, ref)
        await assert_queries_match(cluster, client, ref, k)
        assert await client.delete(POOL) == ref.count()
        assert (await client.quality())["count"] == 0
    pool.checkin()


WORKERS_SLOTS = [(1, 16), (2, 32), (3, 64), (5, 16)]


@pytest.mark.slow
@pytest.mark.parametrize("pool", WORKERS_SLOTS, indirect=True, ids=lambda p: f"{p[0]}w-{p[1]}s")
@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=st.lists(OPS, max_size=MAX_OPS),
    joins=st.lists(st.integers(0, MAX_OPS), max_size=2, unique=True),
    k=st.integers(1, 40),
)
async def test_cluster_equals_reference(pool: ClusterPool, ops, joins, k) -> None:
    await run_example(pool, ops, joins, k)


async def run_join_under_traffic(pool: ClusterPool, ops: list[tuple], start: int, k: int) -> None:
    """Like ``run_example``, but one worker joins while ``ops[start:]`` are being applied
    (each awaited in turn, so the order the reference applies them in is the order the
    cluster saw them)."""
    cluster = await pool.checkout()
    ref = ReferenceStore(slots=pool.slots)

    async def join() -> None:
        await cluster.add_worker()
        await wait_settled(cluster)

    async with cluster.client() as client:
        task: asyncio.Task[None] | None = None
        try:
            for i, op in enumerate(ops):
                if i == start:
                    task = asyncio.create_task(join())
                await apply_both(client, ref, i, op)
        finally:
            if task is not None:
                await task
        await assert_invariant(cluster, ref)
        await assert_queries_match(cluster, client, ref, k)
        assert await client.delete(POOL) == ref.count()
    pool.checkin()


@pytest.mark.slow
@pytest.mark.parametrize("pool", WORKERS_SLOTS, indirect=True, ids=lambda p: f"{p[0]}w-{p[1]}s")
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(OPS, min_size=1, max_size=12), start=st.integers(0, 3), k=st.integers(1, 40))
async def test_join_under_traffic_equals_reference(pool: ClusterPool, ops, start, k) -> None:
    await run_join_under_traffic(pool, ops, min(start, len(ops) - 1), k)


async def run_kill_between(
    pool: ClusterPool, ops: list[tuple], kill_at: int, victim: int, k: int
) -> None:
    """Like ``run_example``, but worker ``victim`` (modulo the workers) is killed before
    ``ops[kill_at]`` (``kill_at >= len(ops)``: after the last one). Forwards to it fail, so
    copy failures are expected; the invariant is checked once the copies are re-created."""
    cluster = await pool.checkout()  # never checked in: a killed cluster is rebuilt
    ref = ReferenceStore(slots=pool.slots)
    async with cluster.client() as client:
        for i in range(len(ops) + 1):
            if i == min(kill_at, len(ops)):
                await cluster.kill(victim % len(cluster.workers))
            if i < len(ops):
                await apply_both(client, ref, i, ops[i])
        await wait_settled(cluster)
        await wait_until(
            lambda: cluster.coordinator.cluster.slot_summary()["under_replicated_slots"] == 0,
            what="every slot back at its replication factor",
        )
        await assert_cluster_equals(cluster, ref)
        await assert_copies_identical(cluster)
        await assert_queries_match(cluster, client, ref, k)


# Fast failure detection: the kill is noticed in about a second, not two.
KILL_HEARTBEATS = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "pool",
    [(2, 32, KILL_HEARTBEATS), (3, 64, KILL_HEARTBEATS)],
    indirect=True,
    ids=lambda p: f"{p[0]}w-{p[1]}s",
)
@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=st.lists(OPS, min_size=1, max_size=MAX_OPS),
    kill_at=st.integers(0, MAX_OPS),
    victim=st.integers(0, 4),
    k=st.integers(1, 40),
)
async def test_worker_killed_between_operations_equals_reference(
    pool: ClusterPool, ops, kill_at, victim, k
) -> None:
    await run_kill_between(pool, ops, kill_at, victim, k)
