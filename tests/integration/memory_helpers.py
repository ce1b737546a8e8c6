"""Helpers for memory-store integration tests: dump every copy of every slot; copy in small
chunks."""

from __future__ import annotations

import numpy as np

from shared.proto import worker_pb2, worker_pb2_grpc
from shared.rpc.codec import f32_from_bytes, ids_from_bytes

# Slot copies in CopySlots requests of a few memories (one slot each in these tests' stores)
# and slot data in SlotData messages of 1 KiB (several per slot of a few hundred memories):
# the join, leave and failover tests then copy in many requests and messages, so one that
# is dropped leaves a slot short and fails them (issue 20 #4). Coordinator overrides, and
# the workers' (``worker_overrides``).
SMALL_COPIES: dict[str, object] = {"copy_chunk_memories": 8}
SMALL_MESSAGES: dict[str, object] = {"chunk_bytes": 1024}


async def settled_copy_counts(cluster) -> tuple[int, int]:
    """(CopySlots requests answered, slots copied by completed passes) of the coordinator,
    once its map is settled and every live worker reported the memories it holds (copy
    requests are sized by those counts)."""
    from tests.conftest import wait_until

    coord = cluster.coordinator.cluster
    rb = coord.rebalancer
    await wait_until(
        lambda: rb.settled.is_set() and all(w.memories > 0 for w in coord.membership.alive()),
        what="a settled map and every worker's count of memories",
    )
    return copy_counts(cluster)


def copy_counts(cluster) -> tuple[int, int]:
    """(CopySlots requests answered, slots copied by completed passes) of the coordinator."""
    coord = cluster.coordinator.cluster
    registry = coord.metrics.registry
    requests = registry.get_sample_value("neuroshard_slot_copy_requests_total")
    return int(requests or 0), coord.rebalancer.copies_total


async def assert_copies_were_split(cluster, before: tuple[int, int]) -> None:
    """Once the map is settled: since ``before`` (``settled_copy_counts``), slots were copied,
    in at least one request per slot."""
    from tests.conftest import wait_until

    rb = cluster.coordinator.cluster.rebalancer
    await wait_until(rb.settled.is_set, what="the copies' pass to end")
    requests, slots = (a - b for a, b in zip(copy_counts(cluster), before, strict=True))
    assert slots > 0, "no slot was copied"
    assert requests >= slots, f"{slots} slots copied in {requests} requests (not split)"


async def dump_worker(
    stub: worker_pb2_grpc.WorkerStub, table: str = ""
) -> dict[int, dict[int, float]]:
    """slot -> {id: strength} of everything a worker holds in a table ("": the default one)."""
    out: dict[int, dict[int, float]] = {}
    async for msg in stub.DumpSlots(worker_pb2.DumpSlotsRequest(table=table), timeout=30):
        d = out.setdefault(msg.slot, {})
        ids, s = ids_from_bytes(msg.ids), f32_from_bytes(msg.strengths)
        d.update(zip(ids.tolist(), s.tolist(), strict=True))
    return out


async def assert_cluster_equals(cluster, reference, table: str = "") -> None:
    """Union of primaries == reference bit for bit, and both copies of every slot equal.

    ``table``: the table compared ("": the default one), ``reference`` that table's store.
    """
    from shared.proto import worker_pb2_grpc as pbg
    from shared.rpc import channel

    rb = cluster.coordinator.cluster.rebalancer
    current = rb.current
    dumps = {}
    for w in cluster.workers:
        async with channel(w.address) as ch:
            dumps[w.name] = await dump_worker(pbg.WorkerStub(ch), table)
    merged: dict[int, float] = {}
    for s in range(current.slots):
        p, r = current.primary[s], current.replica[s]
        primary = dumps.get(p, {}).get(s, {}) if p else {}
        if r:
            replica = dumps.get(r, {}).get(s, {})
            assert primary == replica, f"slot {s}: primary {p} and replica {r} differ"
        merged.update(primary)
    ref_ids, ref_s = reference.items()
    expected = dict(zip(ref_ids.tolist(), ref_s.tolist(), strict=True))
    assert len(merged) == len(expected)
    got_ids = np.array(sorted(merged), np.uint64)
    got = np.array([merged[i] for i in got_ids.tolist()], np.float32)
    np.testing.assert_array_equal(got_ids, ref_ids)
    diff = np.flatnonzero(got != ref_s.astype(np.float32))
    assert len(diff) == 0, (
        f"{len(diff)} strengths differ, e.g. id {got_ids[diff[0]]}: cluster {got[diff[0]]!r} "
        f"vs reference {ref_s[diff[0]]!r}"
    )
