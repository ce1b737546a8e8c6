"""Jepsen's classic partition (issue 12, item 1): a primary cut off from the coordinator and
from its replicas while a client still reaches it.

Topology: the victim worker reaches the coordinator through one link proxy, is reached by
the coordinator and the other workers through another (its advertised address), and reaches
each other worker through a proxy of its own; a client on the victim's side of the partition
routes to it directly. Cutting those four links leaves the victim serving that client and
nobody else. It must acknowledge no write it cannot replicate (the coordinator declares it
dead after the heartbeat timeout and promotes its replicas, so an acknowledgement by it
would be a split brain), and once the links heal and the victim is back the store holds
every acknowledged write (unacknowledged ones may or may not be there), with both copies of
every slot identical.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.client.memory import MemoryRouter, RoutingError
from shared.memory.slots import slot_of
from shared.netem.link_proxy import LinkProxy, LinkSettings
from shared.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from shared.rpc import channel
from tests.conftest import InProcessCluster, wait_until
from tests.integration.cli_helpers import start_link
from tests.integration.invariant_helpers import assert_copies_identical, wait_settled
from worker.server import WorkerServer

pytestmark = pytest.mark.integration

SLOTS = 32
HEARTBEATS = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0)
BATCH = 8  # ids per write


# -- the link's cut and heal -------------------------------------------------------------------


async def test_a_cut_link_refuses_calls_until_healed(health_server: int) -> None:
    proxy = LinkProxy("127.0.0.1", 0, "127.0.0.1", health_server, LinkSettings())
    port = await proxy.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)

            proxy.cut()
            with pytest.raises(aio.AioRpcError) as err:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            proxy.heal()
            await wait_until(lambda: _serving(stub), what="a check through the healed link")

        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert proxy.counters.connections >= 2  # the one cut, and one after the heal
    finally:
        await proxy.stop()


async def test_the_link_command_cuts_on_sigusr1_and_heals_on_sigusr2(health_server: int) -> None:
    proc, address = await start_link(health_server)
    try:
        async with aio.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)

            proc.send_signal(signal.SIGUSR1)
            await wait_until(lambda: _refused(stub), what="the link cut")
            proc.send_signal(signal.SIGUSR2)
            await wait_until(lambda: _serving(stub), what="the link healed")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, stderr
    assert b'"event": "link_cut"' in stderr and b'"event": "link_healed"' in stderr


async def _refused(stub: health_pb2_grpc.HealthStub) -> bool:
    return not await _serving(stub)


async def _serving(stub: health_pb2_grpc.HealthStub) -> bool:
    try:
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
    except aio.AioRpcError:
        return False
    return True


# -- the partition -----------------------------------------------------------------------------


@dataclass
class Partition:
    """The victim and the proxies on every path to and from it but the client's."""

    victim: WorkerServer
    links: list[LinkProxy] = field(default_factory=list)

    def cut(self) -> None:
        for link in self.links:
            link.cut()

    def heal(self) -> None:
        for link in self.links:
            link.heal()

    def count_writes(self) -> tuple[list[int], list[int]]:
        """From now on note, as item counts, each upsert the victim serves across the cut
        (started or still running while the links are cut), and each of those started while
        they were cut that it acknowledged: (served, acknowledged)."""
        node = self.victim.nodes.get()
        upsert = node.upsert
        served: list[int] = []
        acked: list[int] = []

        async def counted(request, ids, strengths, payloads):  # type: ignore[no-untyped-def]
            cut_at_start = self.links[0].is_cut
            try:
                n = await upsert(request, ids, strengths, payloads)
            finally:
                if cut_at_start or self.links[0].is_cut:
                    served.append(len(ids))
            if cut_at_start:
                acked.append(n)
            return n

        node.upsert = counted  # type: ignore[method-assign]
        return served, acked

    async def stop(self) -> None:
        for link in self.links:
            await link.stop()


async def _proxy(links: list[LinkProxy], target: str) -> str:
    host, port = target.rsplit(":", 1)
    link = LinkProxy("127.0.0.1", 0, host, int(port), LinkSettings())
    links.append(link)
    return f"127.0.0.1:{await link.start()}"


async def _partitionable(cluster: InProcessCluster) -> Partition:
    """Add the victim behind its proxies, beside two workers reached directly."""
    links: list[LinkProxy] = []
    for _ in range(2):
        await cluster.add_worker()
    to_coordinator = await _proxy(links, cluster.address)
    advertised = await _proxy(links, "127.0.0.1:1")  # retargeted once the victim listens
    victim = await cluster.add_worker(
        "victim", coordinator=to_coordinator, advertise_address=advertised
    )
    links[1].target_port = victim.port
    to_peer = {w.address: await _proxy(links, w.address) for w in cluster.workers[:2]}
    direct_stub = victim.peers.stub
    victim.peers.stub = lambda name, address: direct_stub(name, to_peer.get(address, address))
    await wait_settled(cluster)
    return Partition(victim, links)


@dataclass
class Writer:
    """Upserts fresh ids, BATCH at a time, into the victim's primary slots as of the start;
    keeps which were acknowledged and which failed."""

    router: MemoryRouter
    ids: np.ndarray  # every id it may write, in order
    acked: list[np.ndarray] = field(default_factory=list)
    failed: list[np.ndarray] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def strengths(self, ids: np.ndarray) -> np.ndarray:
        return ((ids % 997) / 997).astype(np.float32)

    async def run(self) -> None:
        for start in range(0, len(self.ids), BATCH):
            if self.stop.is_set():
                return
            batch = self.ids[start : start + BATCH]
            try:
                await self.router.upsert(batch, self.strengths(batch), None)
            except RoutingError:
                self.failed.append(batch)
            else:
                self.acked.append(batch)
        raise AssertionError("the writer ran out of ids")


async def _victims_side_router(cluster: InProcessCluster, victim: WorkerServer) -> MemoryRouter:
    """A client that gets maps from the coordinator and reaches the victim directly."""
    ch = channel(cluster.address)
    stub = coordinator_pb2_grpc.CoordinatorStub(ch)

    async def fetch() -> common_pb2.SlotMap:
        m = await stub.GetSlotMap(coordinator_pb2.GetSlotMapRequest(), timeout=5)
        m.addresses[:] = [
            f"127.0.0.1:{victim.port}" if n == victim.name else a
            for n, a in zip(m.workers, m.addresses, strict=True)
        ]
        return m

    router = MemoryRouter(fetch, 5.0, 64 << 20, retry_budget_s=3.0)
    router.coordinator_channel = ch  # type: ignore[attr-defined]  # closed with the router
    return router


def _victims_ids(cluster: InProcessCluster, victim: str, n: int) -> np.ndarray:
    current = cluster.coordinator.cluster.rebalancer.current
    mine = np.flatnonzero(np.asarray(current.primary) == victim)
    candidates = np.arange(1, 200 * n, dtype=np.uint64) * np.uint64(2654435761)
    return candidates[np.isin(slot_of(candidates, SLOTS), mine)][:n]


async def test_a_partitioned_primary_acknowledges_nothing_it_cannot_replicate(
    make_cluster,
) -> None:
    # Arrange: three workers, the victim primary of about a third of the slots, and a
    # writer on its side of the coming partition.
    cluster = await make_cluster(workers=0, slots=SLOTS, **HEARTBEATS)
    part = await _partitionable(cluster)
    coord = cluster.coordinator.cluster
    served, acked_by_victim = part.count_writes()
    router = await _victims_side_router(cluster, part.victim)
    writer = Writer(router, _victims_ids(cluster, "victim", 40_000))
    task = asyncio.create_task(writer.run())
    try:
        await wait_until(lambda: len(writer.acked) >= 5, what="writes before the cut")

        # Act: cut the victim off from all but the client, until the coordinator has moved
        # its slots and writes are acknowledged by their new primaries; then heal.
        part.cut()
        acked_before = len(writer.acked)
        await wait_until(
            lambda: "victim" not in coord.rebalancer.current.primary,
            what="the victim's slots promoted",
        )
        await wait_until(
            lambda: len(writer.acked) >= acked_before + 5, what="writes through the failover"
        )
        part.heal()
        await wait_settled(cluster)
        await wait_until(
            lambda: coord.slot_summary()["under_replicated_slots"] == 0,
            what="every slot back at two copies",
        )
        await wait_until(
            lambda: len(writer.acked) >= acked_before + 10, what="writes after the heal"
        )
    finally:
        writer.stop.set()
        await task
        await router.close()
        await router.coordinator_channel.close()  # type: ignore[attr-defined]

    # Assert: the victim was asked for writes across the partition and acknowledged none;
    # every acknowledged write is there with its strength; both copies of each slot alike.
    try:
        assert served, "no write reached the victim while it was cut off"
        assert acked_by_victim == []
        acked = np.concatenate(writer.acked)
        async with cluster.client() as client:
            found, strengths, _ = await client.get(acked)
        lost = acked[~found]
        assert not len(lost), (
            f"{len(lost)} acknowledged ids lost, e.g. {lost[:3]} in slots "
            f"{sorted(set(slot_of(lost, SLOTS).tolist()))}"
        )
        assert strengths.tobytes() == writer.strengths(acked).tobytes()
        await assert_copies_identical(cluster)
    finally:
        await part.stop()
