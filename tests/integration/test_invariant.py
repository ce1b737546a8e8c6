"""The memory-store invariant at cluster level, property-tested with hypothesis.

DESIGN.md ("Memory store"): for any sequence of operations and any number of workers, the
cluster's ``{id: strength}`` equals a single-process NumPy reference applying the same
operations, bit for bit (float32), and both copies of every slot are identical.

Each hypothesis example drives a real in-process cluster (coordinator and workers on port 0,
served by this test's event loop) through random upserts (duplicate ids, with and without
payloads), reinforces (duplicates add, unknown ids skipped), deletes, decays and workers
joining between operations, applies the same operations to ``ReferenceStore`` and compares
every return value; after every join and at the end it compares every copy of every slot
(contents, payloads and sequence numbers), and at the end quality, top-k, get and status.

Speed: one cluster serves the examples of a test while it is clean (the example ended by
deleting every id it could have written) and has its initial size; an example that joined
workers or failed leaves it to be rebuilt (~0.1 s). So every example starts from the same
membership and an empty store, and a failing example replays the same way while hypothesis
shrinks it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.server import CoordinatorServer
from shared.client import Client
from shared.codec import f32_from_bytes, f32_to_bytes, ids_from_bytes, ids_to_bytes
from shared.config import CoordinatorConfig
from shared.proto import worker_pb2, worker_pb2_grpc
from shared.rpc import channel
from shared.slots import assign_slots, slot_of
from tests.conftest import InProcessCluster, wait_until
from tests.integration.memory_helpers import assert_cluster_equals
from tests.memory_reference import ReferenceStore

pytestmark = pytest.mark.integration

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
    st.tuples(st.just("delete"), st.lists(ANY_IDX, max_size=30)),
    st.tuples(st.just("decay"), RATE),
)
MAX_OPS = 8
OP_TIMEOUT_S = 10.0


def op_args(op: tuple) -> tuple[str, tuple]:
    """The client/reference method an operation names, and its arguments.

    ``bulk_*`` operations draw a few hundred items from a seeded generator (duplicates, exact
    0 and 1 strengths, boosts that clip); the others spell out every item.
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
    if kind == "reinforce_ids":
        return "reinforce", op[1:]
    if kind == "delete":
        return "delete", (ALL[op[1]],)
    return "decay", (op[1],)


async def apply_both(client: Client, ref: ReferenceStore, i: int, op: tuple) -> None:
    """Apply ``op`` to the cluster and the reference; their return values must agree.

    Bounded in time: a cluster whose copies diverged may refuse a write until the client's
    retry budget (30 s) runs out.
    """
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

    def record_copy_failures(self) -> None:
        cluster = self.coordinator.cluster
        report = cluster.report_failure

        def recorded(reporter: str, worker: str, reason: str, slots=None) -> None:
            self.copy_failures.append(f"{reporter} reported {worker}'s slots {slots}: {reason}")
            report(reporter, worker, reason, slots)

        cluster.report_failure = recorded  # type: ignore[method-assign]


async def start_cluster(root: Path, workers: int, slots: int) -> Cluster:
    """A coordinator and ``workers`` workers in this event loop, settled on rendezvous."""
    server = CoordinatorServer(
        CoordinatorConfig(
            listen="127.0.0.1:0",
            data_dir=str(root / "coord"),
            metrics_port=None,
            grace_s=0.5,
            slots=slots,
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

    def __init__(self, root: Path, workers: int, slots: int) -> None:
        self.root, self.workers, self.slots = root, workers, slots
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
            c = await start_cluster(self.root / f"cluster-{self.builds}", self.workers, self.slots)
            self.cluster = c
        self.dirty = True  # until the example cleans up after itself
        return c

    def checkin(self) -> None:
        self.dirty = False

    async def close(self) -> None:
        c, self.cluster = self.cluster, None
        if c is not None:
            await c.stop()


@pytest.fixture
async def pool(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ClusterPool]:
    workers, slots = request.param
    p = ClusterPool(tmp_path, workers, slots)
    yield p
    await p.close()


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


async def dump_copies(address: str, slots: int) -> dict[int, Copy]:
    """slot -> this worker's copy, for every slot (empty ones too, for their seq)."""
    out: dict[int, Copy] = {}
    async with channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        request = worker_pb2.DumpSlotsRequest(slots=range(slots))
        async for msg in stub.DumpSlots(request, timeout=30):
            copy = out.setdefault(msg.slot, Copy(msg.seq, {}, {}))
            ids = ids_from_bytes(msg.ids).tolist()
            copy.rows.update(
                zip(ids, (msg.strengths[4 * j : 4 * j + 4] for j in range(len(ids))), strict=True)
            )
            copy.payloads.update(zip(msg.payload_ids, msg.payloads, strict=True))
    return out


async def assert_copies_identical(cluster: InProcessCluster) -> None:
    """Both copies of every slot hold the same rows, payloads and sequence number, bit for
    bit, and no worker holds data of a slot the map does not give it."""
    current = cluster.coordinator.cluster.rebalancer.current
    dumps = {w.name: await dump_copies(w.address, current.slots) for w in cluster.workers}
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
    assert cluster.copy_failures == [], "a primary could not update a copy"
    await assert_cluster_equals(cluster, ref)
    await assert_copies_identical(cluster)


async def assert_queries_match(
    cluster: InProcessCluster, client: Client, ref: ReferenceStore, k: int
) -> None:
    """quality, top-k, get (with payloads) and status agree with the reference."""
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


# --- the fence: writes let through between the copies and the target map ------------------


def slots_fed_by_keepers(old: list[str], joiner: str, slots: int) -> dict[int, str]:
    """slot -> primary, for the slots whose primary keeps every primary role when ``joiner``
    joins (so it adopts each map together with the joiner, not in the first group) and whose
    new replica is the joiner (so it feeds the joiner's copy through the fence)."""
    before, after = sorted(old), sorted([*old, joiner])
    p0, _ = assign_slots(before, slots)
    p1, r1 = assign_slots(after, slots)
    moved = {
        before[a] for a, b in zip(p0.tolist(), p1.tolist(), strict=True) if before[a] != after[b]
    }
    return {
        s: after[p1[s]]
        for s in range(slots)
        if after[p1[s]] not in moved and after[r1[s]] == joiner
    }


class FenceHold:
    """Holds one side of the fence map (published after the copies, before the target) until
    the test has written inside it.

    ``adoption``: the keepers adopt the fence only once released, after the joiner did, so
    their forwards come from the older epoch. ``window``: the coordinator publishes the
    target only once released, so the keepers write at the fence's epoch.
    """

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, where: str, joiner: str, keepers: set[str]
    ) -> None:
        from coordinator.rebalance import Rebalancer
        from worker.memory_node import MemoryNode

        self.reached, self.release = asyncio.Event(), asyncio.Event()
        if where == "adoption":
            apply = MemoryNode.apply_slot_map

            async def held_apply(node: MemoryNode, m) -> int:
                fence = m.epoch > node.roles.epoch and min(m.primary) < 0
                if fence and node.name in keepers:
                    await self.release.wait()
                epoch = await apply(node, m)
                if fence and node.name == joiner:
                    self.reached.set()
                return epoch

            monkeypatch.setattr(MemoryNode, "apply_slot_map", held_apply)
        else:
            publish = Rebalancer._publish

            async def held_publish(rb: Rebalancer, new) -> None:
                await publish(rb, new)
                if "" in new.primary:
                    self.reached.set()
                    await self.release.wait()

            monkeypatch.setattr(Rebalancer, "_publish", held_publish)


async def reinforce_at_own_epoch(
    cluster: InProcessCluster, name: str, ids: np.ndarray, boosts: np.ndarray
) -> None:
    """Reinforce on worker ``name`` directly, at the epoch it is at (routing would refresh
    to the coordinator's newer map, which the held worker refuses)."""
    worker = next(w for w in cluster.workers if w.name == name)
    epoch = worker.servicer.node.roles.epoch
    async with channel(worker.address) as ch:
        request = worker_pb2.ReinforceRequest(
            epoch=epoch, ids=ids_to_bytes(ids), boosts=f32_to_bytes(boosts)
        )
        await worker_pb2_grpc.WorkerStub(ch).Reinforce(request, timeout=OP_TIMEOUT_S)


@pytest.mark.parametrize("where", ["adoption", "window"])
async def test_writes_inside_the_fence_reach_the_new_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Regression: a joining worker that had its copy but no role yet refused forwards from
    an older epoch (``adoption``), and primaries forgot their copy targets on adopting the
    fence (``window``); either way the new copy missed the writes made inside the fence."""
    fed = slots_fed_by_keepers([f"worker-{i}" for i in range(4)], "worker-4", 16)
    assert fed, "4 workers and 16 slots no longer give a slot fed by a keeper"
    ids_slot = slot_of(POOL, 16)
    cluster = await start_cluster(tmp_path, 4, 16)
    hold = FenceHold(monkeypatch, where, "worker-4", set(fed.values()))
    ref = ReferenceStore(slots=16)
    settle: asyncio.Task[None] | None = None
    try:
        async with cluster.client() as client:
            await apply_both(client, ref, 0, ("bulk_upsert", 400, 1, True))
            settle = asyncio.create_task(join_then_settle(cluster))
            async with asyncio.timeout(20):
                await hold.reached.wait()
            for s, keeper in fed.items():
                ids = POOL[ids_slot == s]
                boosts = np.full(len(ids), 0.01, np.float32)
                if where == "adoption":
                    await reinforce_at_own_epoch(cluster, keeper, ids, boosts)
                    ref.reinforce(ids, boosts)
                else:
                    await apply_both(client, ref, s, ("reinforce_ids", ids, boosts))
            hold.release.set()
            await settle
            await assert_invariant(cluster, ref)
            await assert_queries_match(cluster, client, ref, 10)
    finally:
        hold.release.set()
        if settle is not None and not settle.done():
            settle.cancel()
        await cluster.stop()


async def join_then_settle(cluster: InProcessCluster) -> None:
    await cluster.add_worker()
    await wait_settled(cluster)
