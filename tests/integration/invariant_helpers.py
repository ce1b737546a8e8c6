"""Helpers of the memory-store invariant tests (``test_invariant.py``, ``test_fence.py``):
the ids and operations applied to a cluster and to ``ReferenceStore``, an in-process cluster
that records failed copies, a pool that reuses one across hypothesis examples, and the
checks (every copy of every slot, the queries)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest

from coordinator.server import CoordinatorServer
from shared.client import Client, NeuroshardError
from shared.config import CoordinatorConfig
from shared.memory.slots import assign_slots
from shared.proto import worker_pb2, worker_pb2_grpc
from shared.rpc import channel
from shared.rpc.codec import f32_from_bytes, ids_from_bytes
from tests.conftest import InProcessCluster, wait_until
from tests.integration.memory_helpers import assert_cluster_equals
from tests.memory_reference import ReferenceStore
from worker.server import WorkerServer

# --- ids ----------------------------------------------------------------------------------

# Every id an upsert may write: small ids, random 64-bit ones and the extremes.
POOL = np.unique(
    np.concatenate(
        [
            np.arange(150, dtype=np.uint64),
            np.random.default_rng(2024).integers(1 << 32, 2**64 - 1, 146, np.uint64),
            np.array([2**32, 2**63, 2**64 - 2, 2**64 - 1], np.uint64),
        ]
    )
)
# Ids never upserted: reinforce and delete must skip them.
UNKNOWN = np.arange(10**15, 10**15 + 8, dtype=np.uint64)
ALL = np.concatenate([POOL, UNKNOWN])

OP_TIMEOUT_S = 10.0  # one client operation; they take milliseconds on a healthy cluster


def op_args(op: tuple) -> tuple[str, tuple]:
    """The client/reference method an operation names, and its arguments.

    Operations: ``("upsert", [(POOL index, strength, payload)], with_payloads)``,
    ``("bulk_upsert", n, seed, with_payloads)``, ``("reinforce", [(ALL index, boost)])``,
    ``("bulk_reinforce", n, seed)``, ``("reinforce_ids", ids, boosts)``,
    ``("update", [(ALL index, strength)])``, ``("bulk_update", n, seed)`` (priority
    updates: unknown ids skipped), ``("delete", [ALL index])`` and ``("decay", rate)``.
    ``bulk_*`` ones draw n items from a seeded generator (duplicates, exact 0 and 1
    strengths, boosts that clip).
    """
    kind = op[0]
    if kind == "upsert":
        items, with_payloads = op[1], op[2]
        ids = POOL[[i for i, _, _ in items]]
        strengths = np.array([s for _, s, _ in items], np.float32)
        return "upsert", (ids, strengths, [p for _, _, p in items] if with_payloads else None)
    if kind == "bulk_upsert":
        n, seed, with_payloads = op[1:]
        rng = np.random.default_rng(seed)
        strengths = rng.random(n, dtype=np.float32)
        strengths[rng.random(n) < 0.1] = 1.0
        strengths[rng.random(n) < 0.1] = 0.0
        payloads = [rng.bytes(int(rng.integers(0, 6))) for _ in range(n)] if with_payloads else None
        return "upsert", (POOL[rng.integers(0, len(POOL), n)], strengths, payloads)
    if kind == "reinforce":
        ids = ALL[[i for i, _ in op[1]]]
        return "reinforce", (ids, np.array([b for _, b in op[1]], np.float32))
    if kind == "bulk_reinforce":
        n, seed = op[1:]
        rng = np.random.default_rng(seed)
        boosts = rng.random(n, dtype=np.float32) * np.float32(0.3)
        boosts[rng.random(n) < 0.1] = 0.0
        return "reinforce", (ALL[rng.integers(0, len(ALL), n)], boosts)
    if kind == "update":
        ids = ALL[[i for i, _ in op[1]]]
        return "update_strengths", (ids, np.array([s for _, s in op[1]], np.float32))
    if kind == "bulk_update":
        n, seed = op[1:]
        rng = np.random.default_rng(seed)
        return "update_strengths", (ALL[rng.integers(0, len(ALL), n)], rng.random(n, np.float32))
    if kind == "reinforce_ids":
        return "reinforce", op[1:]
    if kind == "delete":
        return "delete", (ALL[op[1]],)
    return "decay", (op[1],)


async def apply_both(client: Client, ref: ReferenceStore, i: int, op: tuple) -> None:
    """Apply ``op`` to the cluster and the reference; their return values must agree.

    Bounded in time: a cluster whose copies diverged may refuse a write until the client's
    retry budget (30 s) runs out. ``("sample", n, alpha, seed)`` compares a seeded sample.
    """
    if op[0] == "sample":
        async with asyncio.timeout(OP_TIMEOUT_S):
            await assert_sample_matches(client, ref, *op[1:], what=f"ops[{i}]")
        return
    method, args = op_args(op)
    async with asyncio.timeout(OP_TIMEOUT_S):
        got = await getattr(client, method)(*args)
    want = getattr(ref, method)(*args)
    assert got == want, f"ops[{i}] {method} returned {got}, the reference {want}"


# --- the cluster --------------------------------------------------------------------------


@dataclass
class Cluster(InProcessCluster):
    """An in-process cluster that also records every copy a primary reported failed."""

    copy_failures: list[str] = field(default_factory=list)
    killed: list[WorkerServer] = field(default_factory=list)

    async def kill(self, index: int) -> str:
        """Stop worker ``index`` as kill -9 would (``test_failover.kill_abruptly``); its
        name. It leaves ``workers``; ``stop`` releases what it still holds."""
        w = self.workers.pop(index)
        if w._tasks is not None:
            w._tasks.cancel()
        await w.rpc.server.stop(0)
        self.killed.append(w)
        return w.name

    async def stop(self) -> None:
        await super().stop()
        for w in self.killed:
            await w.stop()

    def record_copy_failures(self) -> None:
        cluster = self.coordinator.cluster
        report = cluster.report_failure

        def recorded(reporter: str, worker: str, reason: str, slots=None) -> None:
            self.copy_failures.append(f"{reporter} reported {worker}'s slots {slots}: {reason}")
            report(reporter, worker, reason, slots)

        cluster.report_failure = recorded  # type: ignore[method-assign]


async def start_cluster(root: Path, workers: int, slots: int, **overrides: object) -> Cluster:
    """A coordinator and ``workers`` workers in this event loop, settled on rendezvous.

    ``overrides``: more coordinator config (e.g. heartbeat timings).
    """
    server = CoordinatorServer(
        CoordinatorConfig(
            listen="127.0.0.1:0",
            data_dir=str(root / "coord"),
            metrics_port=None,
            grace_s=0.5,
            slots=slots,
            **overrides,  # type: ignore[arg-type]
        )
    )
    # fsync "never": durability is not under test here, and an fsync per write on a shared
    # disk costs up to a second; the journal is still written.
    cluster = Cluster(
        root, server, await server.start(), worker_overrides=dict(grace_s=0.5, fsync="never")
    )
    cluster.record_copy_failures()
    try:
        for _ in range(workers):
            await cluster.add_worker()
        await wait_settled(cluster)
    except BaseException:
        await cluster.stop()
        raise
    return cluster


async def wait_settled(cluster: InProcessCluster) -> None:
    """Wait until every worker is alive and the published map is rendezvous over all."""
    names = sorted(w.name for w in cluster.workers)
    await cluster.wait_alive(len(names))
    p_idx, r_idx = assign_slots(names, cluster.coordinator.cluster.rebalancer.current.slots)
    primary = [names[i] for i in p_idx.tolist()]
    replica = [names[i] if i >= 0 else "" for i in r_idx.tolist()]
    rb = cluster.coordinator.cluster.rebalancer
    await wait_until(
        lambda: (
            rb.settled.is_set() and rb.current.primary == primary and rb.current.replica == replica
        ),
        what=f"the slot map to settle on {names}",
    )


class ClusterPool:
    """One cluster reused across a test's examples while clean and at its initial size."""

    def __init__(self, root: Path, workers: int, slots: int, **overrides: object) -> None:
        self.root, self.workers, self.slots = root, workers, slots
        self.overrides = overrides  # coordinator config of every cluster built
        self.cluster: Cluster | None = None
        self.dirty = False
        self.builds = 0

    def __repr__(self) -> str:  # hypothesis prints it with a failing example
        return f"ClusterPool(workers={self.workers}, slots={self.slots})"

    async def checkout(self) -> Cluster:
        c = self.cluster
        if c is None or self.dirty or len(c.workers) != self.workers:
            await self.close()
            self.builds += 1
            c = await start_cluster(
                self.root / f"cluster-{self.builds}", self.workers, self.slots, **self.overrides
            )
            self.cluster = c
        self.dirty = True  # until the example cleans up after itself
        return c

    def checkin(self) -> None:
        self.dirty = False

    async def close(self) -> None:
        c, self.cluster = self.cluster, None
        if c is not None:
            await c.stop()


# --- checks -------------------------------------------------------------------------------


@dataclass
class Copy:
    """One worker's copy of one slot: sequence number, rows by id, payloads."""

    seq: int
    rows: dict[int, bytes]  # id -> strength as 4 little-endian float32 bytes
    payloads: dict[int, bytes]

    def describe_difference(self, other: Copy) -> str:
        if self.seq != other.seq:
            return f"seq {self.seq} != {other.seq}"
        rows = sorted(set(self.rows.items()) ^ set(other.rows.items()))
        if rows:
            i = rows[0][0]
            a, b = (f32_from_bytes(c.rows[i])[0] if i in c.rows else None for c in (self, other))
            return f"{len(rows)} rows differ, e.g. id {i}: {a!r} != {b!r}"
        return f"payloads {self.payloads} != {other.payloads}"


async def dump_copies(address: str, slots: int, table: str = "") -> dict[int, Copy]:
    """slot -> this worker's copy of a table's part, for every slot (empty ones too, for
    their seq)."""
    out: dict[int, Copy] = {}
    async with channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        request = worker_pb2.DumpSlotsRequest(slots=range(slots), table=table)
        async for msg in stub.DumpSlots(request, timeout=30):
            copy = out.setdefault(msg.slot, Copy(msg.seq, {}, {}))
            ids = ids_from_bytes(msg.ids).tolist()
            copy.rows.update(
                zip(ids, (msg.strengths[4 * j : 4 * j + 4] for j in range(len(ids))), strict=True)
            )
            copy.payloads.update(zip(msg.payload_ids, msg.payloads, strict=True))
    return out


async def assert_copies_identical(cluster: InProcessCluster, table: str = "") -> None:
    """Both copies of every slot hold the same rows, payloads and sequence number, bit for
    bit, and no worker holds data of a slot the map does not give it (in ``table``)."""
    current = cluster.coordinator.cluster.rebalancer.current
    dumps = {w.name: await dump_copies(w.address, current.slots, table) for w in cluster.workers}
    for s in range(current.slots):
        p, r = current.primary[s], current.replica[s]
        assert p, f"slot {s} has no primary at epoch {current.epoch}"
        if r and dumps[p][s] != dumps[r][s]:
            raise AssertionError(
                f"slot {s}: primary {p} and replica {r} differ: "
                f"{dumps[p][s].describe_difference(dumps[r][s])}"
            )
        for name, dump in dumps.items():
            if name not in (p, r):
                assert not dump[s].rows, f"slot {s}: {name} holds data but is no copy of it"


async def assert_invariant(cluster: Cluster, ref: ReferenceStore) -> None:
    """The cluster equals the reference, every copy matches, and no copy ever fell behind.

    The first check matters: a primary whose forward is refused reports the copy, and the
    coordinator re-copies the slot, which can hide the missed write by the time the copies
    are compared. No fault is injected here, so no forward may fail.
    """
    assert cluster.copy_failures == [], (
        f"a primary could not update a copy: {cluster.copy_failures}"
    )
    await assert_cluster_equals(cluster, ref)
    await assert_copies_identical(cluster)


async def assert_queries_match(
    cluster: InProcessCluster, client: Client, ref: ReferenceStore, k: int
) -> None:
    """quality, top-k, a seeded sample, get (with payloads) and status agree with the
    reference."""
    q, want = await client.quality(), ref.quality()
    assert (q["count"], q["min"], q["max"], q["histogram"]) == (
        want.count,
        want.min,
        want.max,
        list(want.histogram),
    )
    assert q["sum"] == pytest.approx(want.sum, rel=1e-9, abs=1e-9)
    top_ids, top_s = await client.topk(k)
    want_ids, want_s = ref.topk(k)
    np.testing.assert_array_equal(top_ids, want_ids)
    assert top_s.tobytes() == want_s.tobytes(), "top-k strengths differ bitwise"
    await assert_sample_matches(client, ref, 64, 0.6, k)
    found, strengths, payloads = await client.get(ALL, with_payloads=True)
    want_found, want_strengths, want_payloads = ref.get(ALL)
    np.testing.assert_array_equal(found, want_found)
    assert strengths.tobytes() == want_strengths.tobytes(), "get strengths differ bitwise"
    assert payloads == want_payloads
    status = await client.status()
    assert status["under_replicated_slots"] == 0
    assert status["replication_factor"] == min(2, len(cluster.workers))
    assert status["slot_map_epoch"] == cluster.coordinator.cluster.rebalancer.current.epoch
    assert sum(w["slots_primary"] for w in status["workers"]) == ref.slots


async def assert_sample_matches(
    client: Client, ref: ReferenceStore, n: int, alpha: float, seed: int, what: str = "sample"
) -> None:
    """A seeded sample of the cluster equals the reference's: ids, strengths, payloads and
    probabilities exactly; an empty store refuses it (FAILED_PRECONDITION)."""
    if len(ref.ids) == 0:
        with pytest.raises(NeuroshardError) as info:
            await client.sample(n, alpha=alpha, seed=seed)
        assert info.value.code is grpc.StatusCode.FAILED_PRECONDITION, what
        return
    batch = await client.sample(n, alpha=alpha, seed=seed)
    ids, strengths, payloads, probabilities = ref.sample(n, alpha, seed)
    np.testing.assert_array_equal(batch.ids, ids, err_msg=f"{what}: sampled ids differ")
    assert batch.strengths.tobytes() == strengths.tobytes(), f"{what}: strengths differ"
    assert batch.payloads == payloads, f"{what}: payloads differ"
    np.testing.assert_array_equal(batch.probabilities, probabilities, err_msg=what)
    assert batch.size == len(ref.ids), what


async def join_then_settle(cluster: InProcessCluster) -> None:
    await cluster.add_worker()
    await wait_settled(cluster)
