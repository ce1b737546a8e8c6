"""Every slot map the coordinator hands out carries the cluster's limits: the registration
reply, ``GetSlotMap`` and the maps the rebalancer pushes (it used to drop ``max_batch_items``
from the last two kinds)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from coordinator.cluster import Cluster
from coordinator.coordinator_servicer import CoordinatorServicer
from coordinator.data_servicer import DataServicer
from shared.config import CoordinatorConfig
from shared.metrics import Metrics
from shared.proto import coordinator_pb2


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    cfg = CoordinatorConfig(
        data_dir=str(tmp_path),
        metrics_port=None,
        slots=8,
        max_payload_bytes=512,
        max_batch_items=1000,
    )
    c = Cluster(cfg, Metrics())
    yield c
    await c.close()


async def test_the_registration_reply_carries_the_slot_count_and_both_limits(
    cluster: Cluster,
) -> None:
    servicer = CoordinatorServicer(cluster, DataServicer(cluster))
    request = coordinator_pb2.RegisterWorkerRequest(name="w0", address="127.0.0.1:1")

    reply = await servicer.RegisterWorker(request, None)  # type: ignore[arg-type]

    m = reply.slot_map
    assert (m.slots, m.max_payload_bytes, m.max_batch_items) == (8, 512, 1000)
    assert (m.epoch, list(m.workers), list(m.primary)) == (0, [], [])  # no placement yet


async def test_get_slot_map_and_pushed_maps_carry_both_limits(cluster: Cluster) -> None:
    servicer = CoordinatorServicer(cluster, DataServicer(cluster))
    cluster.register_worker("w0", "127.0.0.1:1", "cpu")
    cluster.rebalancer.current.primary[:] = ["w0"] * 8
    cluster.rebalancer.current.epoch = 3

    got = await servicer.GetSlotMap(coordinator_pb2.GetSlotMapRequest(), None)  # type: ignore[arg-type]
    pushed = cluster.rebalancer.wire_map()  # what _publish and _push_to_laggards send

    assert got == pushed
    assert (got.epoch, got.slots, got.max_payload_bytes, got.max_batch_items) == (3, 8, 512, 1000)
    assert list(got.workers) == ["w0"] and list(got.addresses) == ["127.0.0.1:1"]
    assert list(got.primary) == [0] * 8 and list(got.replica) == [-1] * 8
