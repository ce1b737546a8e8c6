"""Worker durability: a restarted worker reloads its data dir and only its stale slots are
copied again; a full cluster restart loses no acknowledged write; a slot whose every copy is
on dead workers waits for them instead of restarting empty."""

from __future__ import annotations

import asyncio
import errno

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.server import CoordinatorServer
from shared.config import CoordinatorConfig
from shared.proto import worker_pb2
from tests.conftest import InProcessCluster, wait_until
from tests.integration.memory_helpers import SMALL_COPIES, SMALL_MESSAGES, assert_cluster_equals
from tests.integration.test_failover import Writer, kill_abruptly
from tests.memory_reference import ReferenceStore
from worker.store import journal as journal_mod
from worker.store.journal import Journal, StorageFailed, lock_data_dir

pytestmark = pytest.mark.integration

S = 64
DURABLE = {"fsync": "always"}


async def crash_worker(cluster: InProcessCluster, name: str) -> None:
    """Stop a worker as kill -9 would (no drain, no goodbye, no fsync) and release its data
    dir, the way the end of its process would.

    Its data dir keeps exactly the bytes written before the crash: queued store jobs are
    dropped (the running one finishes, a thread cannot be killed) and the journal is
    abandoned, not closed (``close`` fsyncs, which a killed process never gets to do).
    """
    w = next(w for w in cluster.workers if w.name == name)
    cluster.workers.remove(w)
    await kill_abruptly(w)
    if w.nodes.current is not None:
        w.nodes.current.abandon()
    w._release_data_dir()
    await w.coordinator_channel.close()
    await w.peers.close()
    w.sessions.close()


async def crash_coordinator(cluster: InProcessCluster) -> None:
    c = cluster.coordinator
    if c._background is not None:
        c._background.cancel()
        await asyncio.gather(c._background, return_exceptions=True)
    await c.rpc.server.stop(0)
    await c.cluster.close()


async def restart_coordinator(
    cluster: InProcessCluster, data_dir: str, **options: object
) -> CoordinatorServer:
    """Start a coordinator on the cluster's address and ``data_dir`` (the crashed one's).

    The workers keep running and register with it again; ``options`` are more config fields.
    """
    coordinator = CoordinatorServer(
        CoordinatorConfig(
            listen=cluster.address,
            data_dir=data_dir,
            metrics_port=None,
            grace_s=0.5,
            **options,
        )
    )
    cluster.coordinator = coordinator
    assert await coordinator.start() == cluster.address
    return coordinator


async def settled(cluster: InProcessCluster, workers: int) -> None:
    coord = cluster.coordinator.cluster
    await cluster.wait_alive(workers)
    await wait_until(
        lambda: (
            coord.rebalancer.settled.is_set()
            and not coord.rebalancer.trust.unverified
            and coord.slot_summary()["under_replicated_slots"] == 0
            and all(w._epoch() == coord.rebalancer.current.epoch for w in cluster.workers)
        ),
        what="a settled, fully replicated map on every worker",
    )


async def load(cluster: InProcessCluster, n: int = 5000):
    ref = ReferenceStore(slots=S)
    ids = np.arange(n, dtype=np.uint64) * 7919
    s = np.random.default_rng(1).random(n, dtype=np.float32) * 0.5
    payloads = [b"p%d" % i if i % 3 == 0 else b"" for i in range(n)]
    client = cluster.client()
    await client.wait_ready()
    await client.upsert(ids, s, payloads)
    ref.upsert(ids, s, payloads)
    return client, ref, ids


async def test_restarted_worker_reloads_and_only_its_stale_slots_are_copied(
    make_cluster, monkeypatch: pytest.MonkeyPatch
):
    cluster = await make_cluster(
        workers=3,
        slots=S,
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=10.0,
        worker_overrides=DURABLE | SMALL_MESSAGES,
        **SMALL_COPIES,
    )
    client, ref, ids = await load(cluster)
    await settled(cluster, 3)
    coord = cluster.coordinator.cluster
    held = sum(coord.rebalancer.current.counts()["worker-1"])
    copies_before = coord.rebalancer.copies_total
    # The restart comes before a failover: the probe that a failure report starts would
    # declare the crashed worker dead at once, so probes wait until it is back.
    back, probe = asyncio.Event(), coord.failures._probe

    async def probe_once_back(name: str) -> None:
        await back.wait()
        await probe(name)

    monkeypatch.setattr(coord.failures, "_probe", probe_once_back)
    writer = Writer(client, ref, ids)
    task = asyncio.create_task(writer.run())
    await wait_until(lambda: writer.acked >= 3, what="writes before the crash")
    await writer.stop()  # no write in flight at the crash: one would leave the crashed
    await task  # primary ahead of its replica, which discards its copies of those slots

    await crash_worker(cluster, "worker-1")
    writer = Writer(client, ref, ids)
    task = asyncio.create_task(writer.run())
    await wait_until(
        lambda: coord.rebalancer.trust.untrusted.get("worker-1"),
        what="a primary reporting the copies it can no longer update",
    )
    restarted = await cluster.add_worker("worker-1")
    # Back means registered: a probe of the old address would declare it DEAD, and a DEAD
    # worker rejoins only after a hold-down, its slots copied afresh meanwhile.
    await wait_until(
        lambda: coord.membership.get("worker-1").address == restarted.address,
        what="the restarted worker registered",
    )
    back.set()
    await settled(cluster, 3)
    acked = writer.acked
    await wait_until(lambda: writer.acked >= acked + 3, what="writes after the restart")
    await writer.stop()
    await task

    assert writer.failures == []
    copied = coord.rebalancer.copies_total - copies_before
    assert 0 < copied < held, f"{copied} slots copied back to a worker holding {held}"
    assert len(restarted.nodes.get()) > 0
    await assert_cluster_equals(cluster, ref)
    await client.close()


async def test_full_cluster_restart_loses_no_acknowledged_write(make_cluster, tmp_path):
    cluster = await make_cluster(
        workers=3,
        slots=S,
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=10.0,
        worker_overrides=DURABLE,
    )
    client, ref, ids = await load(cluster)
    writer = Writer(client, ref, ids)
    task = asyncio.create_task(writer.run())
    await wait_until(lambda: writer.acked >= 5, what="acknowledged writes")
    await writer.stop()
    await task
    await client.decay(0.01)
    ref.decay(0.01)
    await client.delete(ids[:100])
    ref.delete(ids[:100])
    await client.close()

    for name in [w.name for w in cluster.workers]:
        await crash_worker(cluster, name)
    await crash_coordinator(cluster)
    coordinator = CoordinatorServer(
        CoordinatorConfig(
            listen="127.0.0.1:0",
            data_dir=str(tmp_path / "coord"),
            metrics_port=None,
            slots=S,
            grace_s=0.5,
            heartbeat_interval_s=0.1,
            heartbeat_timeout_s=10.0,
        )
    )
    cluster.coordinator, cluster.address = coordinator, await coordinator.start()
    for name in ("worker-2", "worker-0", "worker-1"):
        await cluster.add_worker(name)
    await settled(cluster, 3)

    assert coordinator.cluster.rebalancer.copies_total == 0  # every copy checked out
    await assert_cluster_equals(cluster, ref)
    client = cluster.client()
    await client.reinforce(ids[100:200], np.full(100, 0.125, np.float32))
    ref.reinforce(ids[100:200], np.full(100, 0.125, np.float32))
    await assert_cluster_equals(cluster, ref)
    await client.close()


async def test_slots_on_dead_workers_wait_for_them(make_cluster):
    cluster = await make_cluster(
        workers=2,
        slots=S,
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=0.6,
        worker_overrides=DURABLE,
    )
    client, ref, _ = await load(cluster, 2000)
    await settled(cluster, 2)
    coord = cluster.coordinator.cluster

    # worker-0 dies first and worker-1 becomes the only holder of every slot; then worker-1
    # dies too. (Crashing both at once left the order in which the coordinator notices them
    # to the machine's load: noticed apart, the map's only holder is whichever died last, and
    # the test expected the other one under two busy processes, `make test-loaded`.)
    await crash_worker(cluster, "worker-0")
    await wait_until(
        lambda: (
            coord.rebalancer.settled.is_set()
            and set(coord.rebalancer.current.primary) == {"worker-1"}
            and not any(coord.rebalancer.current.replica)
        ),
        what="worker-1 the only holder of every slot",
    )
    await crash_worker(cluster, "worker-1")
    await cluster.wait_alive(0)
    await wait_until(coord.rebalancer.settled.is_set, what="a map for no live worker")
    assert set(coord.rebalancer.current.primary) == {"worker-1"}  # not emptied

    # worker-0 is back first: it holds no slot of the current map, so the slots still wait.
    await cluster.add_worker("worker-0")
    await cluster.wait_alive(1)
    await wait_until(
        lambda: (
            coord.rebalancer.settled.is_set()
            and not coord.rebalancer.trust.unverified
            and cluster.workers[0]._epoch() == coord.rebalancer.current.epoch
        ),
        what="worker-0 checked and given the map",
    )
    assert set(coord.rebalancer.current.primary) == {"worker-1"}

    # worker-1 is back: its copies are the data; worker-0 gets the replicas.
    await cluster.add_worker("worker-1")
    await settled(cluster, 2)
    assert set(coord.rebalancer.current.primary) <= {"worker-0", "worker-1"}
    await assert_cluster_equals(cluster, ref)
    await client.close()


async def test_data_dir_of_another_slot_count_stops_the_worker(make_cluster, tmp_path):
    cluster = await make_cluster(workers=1, slots=S)
    data_dir = tmp_path / "worker-x"
    Journal(data_dir, lock_data_dir(data_dir), 2 * S, 0, "never", 1.0, 1 << 20).close()

    w = await cluster.add_worker("worker-x")
    await wait_until(w.failed.is_set, what="the worker giving up")

    assert w.error == (
        f"data_dir {data_dir} holds {2 * S} slots but the coordinator at "
        f"{cluster.address} has {S}; use another data_dir"
    )


async def test_a_failed_fsync_makes_the_worker_refuse_writes_and_report_not_serving(
    make_cluster, monkeypatch
):
    # Arrange: one worker that fsyncs before each ack, holding every slot as primary.
    cluster = await make_cluster(workers=1, slots=S, worker_overrides=DURABLE)
    await settled(cluster, 1)
    w = cluster.workers[0]
    node = w.nodes.get()
    ids = np.arange(4, dtype=np.uint64)
    upsert = worker_pb2.UpsertRequest(epoch=node.epoch, ids=ids.astype("<u8").tobytes())
    strengths = np.full(4, 0.5, np.float32)

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(journal_mod.os, "fsync", failing_fsync)

    # Act: a write whose fsync fails, and one after it.
    with pytest.raises(StorageFailed):
        await node.upsert(upsert, ids, strengths, None)
    with pytest.raises(StorageFailed, match="acknowledges no more writes"):
        await node.upsert(upsert, ids, strengths, None)

    # Assert: the worker's gRPC health says NOT_SERVING, for probes and clients alike.
    async with grpc.aio.insecure_channel(w.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        async def not_serving() -> bool:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            return reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

        await wait_until(not_serving, what="health NOT_SERVING")
    assert "fsync: " in w.storage_failure
