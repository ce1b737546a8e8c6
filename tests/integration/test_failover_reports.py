"""A failover started by the first failure report, while the rest of a batch flows on.

The heartbeat timeout is a minute here, so only a report (a client's or a primary's) followed
by a failed health probe can fail a worker over within the tests' deadlines.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from coordinator.placement import failure_detector
from coordinator.placement.membership import WorkerState
from shared.client import Client
from shared.memory.slots import slot_of
from shared.proto import coordinator_pb2, coordinator_pb2_grpc
from shared.rpc import channel
from shared.rpc.peers import WorkerClients
from tests.conftest import wait_until
from tests.integration.memory_helpers import SMALL_COPIES, SMALL_MESSAGES, assert_cluster_equals
from tests.integration.test_failover import Writer, kill_abruptly
from tests.memory_reference import ReferenceStore

pytestmark = pytest.mark.integration

SLOTS = 64
SLOW_HEARTBEATS = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=60.0, probe_timeout_s=0.5)
DEADLINE_S = 15.0  # far below the heartbeat timeout


async def _loaded(make_cluster, n_ids: int = 5_000):
    cluster = await make_cluster(
        workers=3, slots=SLOTS, worker_overrides=SMALL_MESSAGES, **SLOW_HEARTBEATS, **SMALL_COPIES
    )
    ref = ReferenceStore(slots=SLOTS)
    ids = np.arange(1, n_ids + 1, dtype=np.uint64) * 7919
    s = np.random.default_rng(0).random(n_ids, dtype=np.float32) * 0.5
    client = cluster.client()
    await client.wait_ready()
    await client.upsert(ids, s)
    ref.upsert(ids, s)
    return cluster, ref, ids, s, client


def _copies_on(m, name: str) -> np.ndarray:
    """[S] bool: slots of map ``m`` with a copy (primary or replica) on worker ``name``."""
    return np.array([name in (p, r) for p, r in zip(m.primary, m.replica, strict=True)])


async def test_a_clients_report_fails_a_dead_primary_over_before_the_heartbeat_timeout(
    make_cluster,
) -> None:
    # Arrange: reads reach the dead worker only through the client (no primary forwards)
    cluster, _, ids, s, client = await _loaded(make_cluster)
    coord = cluster.coordinator.cluster
    victim = cluster.workers[1]

    # Act
    await kill_abruptly(victim)
    found, got, _ = await asyncio.wait_for(client.get(ids), timeout=DEADLINE_S)

    # Assert: every id read from the promoted copies; the victim declared DEAD by a probe
    assert found.all()
    np.testing.assert_array_equal(got, s)
    assert coord.membership.get(victim.name).state is WorkerState.DEAD
    assert victim.name not in coord.rebalancer.current.primary
    cluster.workers.remove(victim)
    await client.close()


async def test_parts_for_live_primaries_are_acknowledged_before_the_promotion(
    make_cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange: every probe waits for a gate, so no promotion can happen before it opens
    cluster, ref, ids, _, client = await _loaded(make_cluster)
    coord = cluster.coordinator.cluster
    victim = cluster.workers[1]
    events: list[tuple[str, object]] = []
    gate = asyncio.Event()
    probe, mark_dead = coord.failures._confirmed_probe, coord.membership.mark_dead

    async def gated_probe(name: str) -> None:
        await gate.wait()
        await probe(name)

    def recorded_mark_dead(name: str) -> bool:
        events.append(("dead", name))
        return mark_dead(name)

    monkeypatch.setattr(coord.failures, "_confirmed_probe", gated_probe)
    monkeypatch.setattr(coord.membership, "mark_dead", recorded_mark_dead)
    # A batch of ids in slots the victim is primary of, and in slots it holds no copy of
    m = coord.rebalancer.current
    slot = slot_of(ids, SLOTS)
    on_victim = np.array(m.primary)[slot] == victim.name
    elsewhere = ~_copies_on(m, victim.name)[slot]
    batch = np.concatenate([ids[on_victim][:200], ids[elsewhere][:800]])
    boosts = np.full(len(batch), 0.01, np.float32)
    n_other = int(min(800, elsewhere.sum()))

    # Act: kill the victim, write the batch; open the gate once the other parts are in
    await kill_abruptly(victim)
    write = asyncio.create_task(
        client.reinforce(batch, boosts, progress=lambda n: events.append(("acked", n)))
    )
    await wait_until(
        lambda: sum(n for kind, n in events if kind == "acked") == n_other,
        timeout_s=DEADLINE_S,
        what="the parts of live primaries acknowledged",
    )
    assert coord.membership.get(victim.name).state is WorkerState.ALIVE  # not promoted yet
    gate.set()
    applied = await asyncio.wait_for(write, timeout=DEADLINE_S)
    ref.reinforce(batch, boosts)

    # Assert: acks of the live primaries' parts, then the failover, then the victim's part
    assert applied == len(batch)
    dead_at = events.index(("dead", victim.name))
    assert sum(n for kind, n in events[:dead_at] if kind == "acked") == n_other
    assert sum(n for kind, n in events[dead_at:] if kind == "acked") == len(batch) - n_other
    cluster.workers.remove(victim)
    await wait_until(
        lambda: (
            coord.rebalancer.settled.is_set()
            and coord.slot_summary()["under_replicated_slots"] == 0
        ),
        timeout_s=DEADLINE_S,
        what="replication factor back to 2",
    )
    await assert_cluster_equals(cluster, ref)
    await client.close()


async def test_a_false_report_does_not_kill_a_healthy_worker(make_cluster) -> None:
    # Arrange
    cluster = await make_cluster(workers=3, slots=SLOTS, **SLOW_HEARTBEATS)
    coord = cluster.coordinator.cluster
    client = cluster.client()
    await client.wait_ready()
    epoch, probes = coord.rebalancer.current.epoch, coord.failures.probes_total

    # Act: a client claims worker-1 is unreachable
    async with channel(cluster.address) as ch:
        await coordinator_pb2_grpc.CoordinatorStub(ch).ReportFailure(
            coordinator_pb2.ReportFailureRequest(worker="worker-1", reason="a false report"),
            timeout=10,
        )
    await wait_until(
        lambda: coord.failures.probes_total == probes + 1 and not coord.failures._probing,
        timeout_s=DEADLINE_S,
        what="the probe of worker-1 answered",
    )

    # Assert: still alive, the map and its copies untouched
    assert coord.membership.get("worker-1").state is WorkerState.ALIVE
    assert coord.rebalancer.current.epoch == epoch
    assert not coord.rebalancer.trust.untrusted.get("worker-1")
    await client.close()


async def test_after_a_reported_failover_the_store_equals_the_acknowledged_writes(
    make_cluster,
) -> None:
    # Arrange
    cluster, ref, ids, _, client = await _loaded(make_cluster)
    coord = cluster.coordinator.cluster
    writer = Writer(client, ref, ids)
    task = asyncio.create_task(writer.run())
    await wait_until(lambda: writer.acked >= 5, what="writes before the kill")

    # Act
    await kill_abruptly(cluster.workers[1])
    cluster.workers.pop(1)
    await wait_until(
        lambda: len(coord.membership.alive()) == 2, timeout_s=DEADLINE_S, what="the failover"
    )
    await wait_until(
        lambda: (
            coord.rebalancer.settled.is_set()
            and coord.slot_summary()["under_replicated_slots"] == 0
        ),
        timeout_s=DEADLINE_S,
        what="replication factor back to 2",
    )
    acked = writer.acked
    await wait_until(lambda: writer.acked >= acked + 5, what="writes after the recovery")
    await writer.stop()
    await task

    # Assert
    assert writer.failures == []
    await assert_cluster_equals(cluster, ref)
    await client.close()


async def test_a_readers_reports_about_a_busy_worker_kill_nothing(
    secure, material, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 7 of the second security review: a reader's ReportFailure about a live worker
    whose event loop was busy (its probe timed out, its heartbeats still arrive) declared it
    DEAD, a failover and a full re-copy at will. Now a failed probe needs a missed heartbeat
    or a second failed probe to confirm it, and a caller's reports are rate-limited."""
    # Arrange: worker-0 fails the first probe of each report (busy for a moment), answers
    # the next, and keeps heartbeating
    cluster = await secure(workers=2, heartbeat_interval_s=0.1, heartbeat_timeout_s=60.0)
    reader = material.client(material.token("reader", "rita"))
    async with Client(cluster.address, security=reader) as c:
        await c.wait_ready()
    coord = cluster.coordinator.cluster
    probe = failure_detector.probe_health

    probed: list[str] = []

    async def busy(clients: WorkerClients, name: str, address: str, timeout_s: float) -> str | None:
        probed.append(name)
        if name == "worker-0" and probed.count(name) % 2:
            return "DEADLINE_EXCEEDED: deadline exceeded"
        return await probe(clients, name, address, timeout_s)

    monkeypatch.setattr(failure_detector, "probe_health", busy)
    epoch, probes = coord.rebalancer.current.epoch, coord.failures.probes_total

    # Act: the reader reports worker-0 again and again
    codes = []
    async with channel(cluster.address, security=reader) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        for _ in range(30):
            try:
                await stub.ReportFailure(
                    coordinator_pb2.ReportFailureRequest(worker="worker-0", reason="lies"),
                    timeout=5,
                )
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
    await wait_until(
        lambda: coord.failures.probes_total > probes and not coord.failures._probing,
        timeout_s=DEADLINE_S,
        what="the probes of worker-0 finished",
    )

    # Assert: probed, not confirmed, still ALIVE, the map unchanged; the excess refused
    unconfirmed = "neuroshard_worker_suspicions_unconfirmed_total"
    assert coord.metrics.registry.get_sample_value(unconfirmed) >= 1
    assert coord.membership.get("worker-0").state is WorkerState.ALIVE
    assert coord.rebalancer.current.epoch == epoch
    assert codes.count(grpc.StatusCode.OK) <= 11  # burst 10 (+1 refilled)
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 19


async def test_a_clients_report_about_a_stopped_worker_is_confirmed_by_its_silence(
    make_cluster,
) -> None:
    # Arrange
    cluster = await make_cluster(workers=3, slots=SLOTS, **SLOW_HEARTBEATS)
    coord = cluster.coordinator.cluster
    async with cluster.client() as client:
        await client.wait_ready()
    victim = cluster.workers[2]

    # Act: the worker dies (no probe answer, no heartbeat); a client reports it
    await kill_abruptly(victim)
    coord.failures.suspect(victim.name, "unreachable")
    await wait_until(
        lambda: coord.membership.get(victim.name).state is WorkerState.DEAD,
        timeout_s=DEADLINE_S,
        what="the reported worker declared DEAD",
    )

    # Assert: DEAD long before the heartbeat timeout (60 s), confirmed by a missed heartbeat
    assert coord.membership.heartbeat_age_s(coord.membership.get(victim.name)) < 30
