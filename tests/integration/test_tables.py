"""Replay tables through real daemons: lifecycle, independence, refusals, and the invariant.

docs/architecture.md ("Tables"): ids are per table; every table's memories equal a
single-process reference (``ReferenceTables``) bit for bit and both copies of every slot are
identical in every table, also with workers joining and one killed between operations; a
dropped table's memories are gone on every worker and a re-created one starts empty.
Refusals (unknown table, a payload over the table's limit, bad table parameters) change
nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.client import Client, NeuroshardError
from tests.conftest import wait_until
from tests.integration.invariant_helpers import (
    ALL,
    OP_TIMEOUT_S,
    POOL,
    ClusterPool,
    assert_copies_identical,
    op_args,
    wait_settled,
)
from tests.integration.memory_helpers import assert_cluster_equals
from tests.integration.test_invariant import KILL_HEARTBEATS, MAX_OPS, OPS
from tests.memory_reference import ReferenceTables

pytestmark = pytest.mark.integration

REPLAY = "replay"
REPLAY_PAYLOAD_BYTES = 6  # the replay table's payload limit (the cluster's is 4096)
# Capped tables: (name, capacity, eviction, forget_below).
CAPPED = [("fifo", 20, "fifo", None), ("weak", 15, "weakest", 0.25)]
TABLES = ["", REPLAY] + [c[0] for c in CAPPED]  # as requests name them: "" is the default


@pytest.fixture
async def pool(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ClusterPool]:
    workers, slots, *overrides = request.param
    p = ClusterPool(tmp_path, workers, slots, **(overrides[0] if overrides else {}))
    yield p
    await p.close()


async def ensure_tables(client: Client, slots: int) -> ReferenceTables:
    """The pooled cluster has every table (an earlier example may have made them); return a
    reference with the same tables, empty."""
    held = {t["name"] for t in await client.list_tables()}
    if REPLAY not in held:
        await client.create_table(REPLAY, max_payload_bytes=REPLAY_PAYLOAD_BYTES)
    for name, capacity, eviction, forget in CAPPED:
        if name not in held:
            await client.create_table(name, capacity, eviction, forget_below=forget)
    return reference_tables(slots)


def reference_tables(slots: int) -> ReferenceTables:
    ref = ReferenceTables(slots=slots)
    ref.create(REPLAY, REPLAY_PAYLOAD_BYTES)
    for name, capacity, eviction, forget in CAPPED:
        ref.create(name, None, capacity, eviction, forget)
    return ref


async def apply_op(client: Client, ref: ReferenceTables, i: int, op: tuple) -> None:
    """Apply ``("in", table index, memory op)`` or ``("recreate",)`` to both sides."""
    import asyncio

    if op[0] == "recreate":
        await client.drop_table(REPLAY)
        await client.create_table(REPLAY, max_payload_bytes=REPLAY_PAYLOAD_BYTES)
        ref.drop(REPLAY)
        ref.create(REPLAY, REPLAY_PAYLOAD_BYTES)
        return
    table = TABLES[op[1]]
    method, args = op_args(op[2])
    async with asyncio.timeout(OP_TIMEOUT_S):
        try:
            got = await getattr(client, method)(*args, table=table or "default")
        except NeuroshardError as exc:
            got = exc.code
    try:
        want = getattr(ref[table], method)(*args)
    except ValueError:
        want = grpc.StatusCode.INVALID_ARGUMENT  # a payload over the replay table's limit
    assert got == want, f"ops[{i}] {method} on {table or 'default'}: {got}, reference {want}"


async def assert_tables_equal(cluster, ref: ReferenceTables) -> None:
    """Every table equals its reference, every copy of every slot identical."""
    assert cluster.copy_failures == [], (
        f"a primary could not update a copy: {cluster.copy_failures}"
    )
    for table in TABLES:
        await assert_cluster_equals(cluster, ref[table], table)
        await assert_copies_identical(cluster, table)


async def assert_reads_match(client: Client, ref: ReferenceTables, k: int) -> None:
    for table in TABLES:
        name = table or "default"
        found, strengths, payloads = await client.get(ALL, with_payloads=True, table=name)
        want_found, want_strengths, want_payloads = ref[table].get(ALL)
        np.testing.assert_array_equal(found, want_found)
        assert strengths.tobytes() == want_strengths.tobytes()
        assert payloads == want_payloads
        ids, s = await client.topk(k, table=name)
        want_ids, want_s = ref[table].topk(k)
        np.testing.assert_array_equal(ids, want_ids)
        assert s.tobytes() == want_s.tobytes()
        assert (await client.quality(table=name))["count"] == ref[table].count()
        if ref[table].count():  # a seeded sample of each table equals the reference's draws
            batch = await client.sample(16, alpha=0.6, seed=k, table=name)
            want_ids, want_s, want_payloads, want_p = ref[table].sample(16, 0.6, k)
            np.testing.assert_array_equal(batch.ids, want_ids)
            assert batch.strengths.tobytes() == want_s.tobytes()
            assert batch.payloads == want_payloads
            np.testing.assert_array_equal(batch.probabilities, want_p)


async def clean(client: Client, ref: ReferenceTables) -> None:
    for table in TABLES:
        assert await client.delete(POOL, table=table or "default") == ref[table].count()


TABLE_OPS = st.one_of(
    st.tuples(st.just("in"), st.integers(0, len(TABLES) - 1), OPS),
    st.tuples(st.just("recreate")),
)
SETTINGS = dict(
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@pytest.mark.slow
@pytest.mark.parametrize("pool", [(1, 16), (2, 32), (3, 64)], indirect=True, ids=str)
@settings(max_examples=10, **SETTINGS)
@given(
    ops=st.lists(TABLE_OPS, max_size=MAX_OPS),
    joins=st.lists(st.integers(0, MAX_OPS), max_size=2, unique=True),
    k=st.integers(1, 40),
)
async def test_every_table_equals_its_reference(pool: ClusterPool, ops, joins, k) -> None:
    cluster = await pool.checkout()
    async with cluster.client() as client:
        ref = await ensure_tables(client, pool.slots)
        at = [min(j, len(ops)) for j in joins]
        for i in range(len(ops) + 1):
            for _ in range(at.count(i)):
                await cluster.add_worker()
                await wait_settled(cluster)
                await assert_tables_equal(cluster, ref)
            if i < len(ops):
                await apply_op(client, ref, i, ops[i])
        await assert_tables_equal(cluster, ref)
        await assert_reads_match(client, ref, k)
        await clean(client, ref)
    pool.checkin()


@pytest.mark.slow
@pytest.mark.parametrize(
    "pool", [(2, 32, KILL_HEARTBEATS), (3, 64, KILL_HEARTBEATS)], indirect=True, ids=str
)
@settings(max_examples=4, **SETTINGS)
@given(
    ops=st.lists(TABLE_OPS, min_size=1, max_size=MAX_OPS),
    kill_at=st.integers(0, MAX_OPS),
    victim=st.integers(0, 4),
)
async def test_every_table_survives_a_kill(pool: ClusterPool, ops, kill_at, victim) -> None:
    cluster = await pool.checkout()  # never checked in: a killed cluster is rebuilt
    async with cluster.client() as client:
        ref = await ensure_tables(client, pool.slots)
        for i in range(len(ops) + 1):
            if i == min(kill_at, len(ops)):
                await cluster.kill(victim % len(cluster.workers))
            if i < len(ops):
                await apply_op(client, ref, i, ops[i])
        await wait_settled(cluster)
        await wait_until(
            lambda: cluster.coordinator.cluster.slot_summary()["under_replicated_slots"] == 0,
            what="every slot back at its replication factor",
        )
        for table in TABLES:
            await assert_cluster_equals(cluster, ref[table], table)
            await assert_copies_identical(cluster, table)
        await assert_reads_match(client, ref, 10)


# --- lifecycle ----------------------------------------------------------------------------


async def test_tables_are_created_listed_dropped_and_hold_their_own_ids(make_cluster) -> None:
    cluster = await make_cluster(workers=2)
    async with cluster.client() as client:
        await client.wait_ready()
        spec = await client.create_table("replay", capacity=0, max_payload_bytes=64)
        assert spec == {
            "name": "replay",
            "capacity": None,
            "eviction": "fifo",
            "max_payload_bytes": 64,
            "forget_below": None,
        }
        assert [t["name"] for t in await client.list_tables()] == ["default", "replay"]
        ids = np.arange(20, dtype=np.uint64)
        await client.upsert(ids, np.full(20, 0.5, np.float32))
        await client.upsert(ids[:5], np.full(5, 0.25, np.float32), table="replay")

        found, strengths, _ = await client.get(ids, table="replay")
        assert found.sum() == 5 and set(strengths[:5].tolist()) == {0.25}
        assert (await client.quality())["count"] == 20
        assert await client.decay(0.25, table="replay") == 5
        _, strengths, _ = await client.get(ids)
        assert set(strengths.tolist()) == {0.5}  # the default table was not decayed

        await client.drop_table("replay")
        assert [t["name"] for t in await client.list_tables()] == ["default"]
        for w in cluster.workers:
            assert (
                "replay" not in w.nodes.current.tables()
                and "replay" not in w.nodes.current._store.tables()
            )
        await client.create_table("replay")
        found, _, _ = await client.get(ids, table="replay")
        assert not found.any(), "a re-created table starts empty"
        assert (await client.quality())["count"] == 20


async def test_tables_are_kept_by_the_coordinator_and_by_each_worker(make_cluster) -> None:
    cluster = await make_cluster(workers=2)
    async with cluster.client() as client:
        await client.wait_ready()
        await client.create_table("replay", max_payload_bytes=16)
        ids = np.arange(50, dtype=np.uint64)
        await client.upsert(ids, np.linspace(0, 1, 50, dtype=np.float32), table="replay")
    state = cluster.coordinator.cluster.state
    doc = state.load_tables()
    assert doc is not None and [t["name"] for t in doc["tables"]] == ["replay"]
    for w in cluster.workers:  # the journal replays the table's writes into the table
        store = w.nodes.current._store
        assert store.tables()["replay"] == doc["tables"][0]["id"]
        assert store.count(table="replay") > 0 and store.count(table="default") == 0


# --- refusals -----------------------------------------------------------------------------


async def _everything(client: Client) -> list:
    out = []
    for table in ("default", "replay"):
        out.append(await client.get(POOL, with_payloads=True, table=table))
    return [(f.tobytes(), s.tobytes(), p) for f, s, p in out]


async def test_refusals_name_the_problem_and_change_nothing(make_cluster, tmp_path) -> None:
    cluster = await make_cluster(workers=2)
    async with cluster.client() as client:
        await client.wait_ready()
        await client.create_table("replay", max_payload_bytes=4)
        await client.upsert(POOL[:10], np.full(10, 0.5, np.float32), table="replay")
        await client.upsert(POOL[:10], np.full(10, 0.75, np.float32))
        before = await _everything(client)
        ids, ones = POOL[:3], np.ones(3, np.float32)
        unknown = [
            client.upsert(ids, ones, table="nope"),
            client.reinforce(ids, ones, table="nope"),
            client.delete(ids, table="nope"),
            client.get(ids, table="nope"),
            client.decay(0.5, table="nope"),
            client.quality(table="nope"),
            client.topk(3, table="nope"),
            client.sweep(0.5, 3, table="nope"),
            client.export_memories(tmp_path / "x.npz", table="nope"),
            client.drop_table("nope"),
        ]
        for call in unknown:
            with pytest.raises(NeuroshardError) as err:
                await call
            assert err.value.code == grpc.StatusCode.NOT_FOUND and "'nope'" in str(err.value)
        with pytest.raises(NeuroshardError) as err:
            await client.upsert(ids, ones, [b"ok", b"toolong", b""], table="replay")
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "payloads[1]" in str(err.value)
        bad_specs = [
            (dict(name="Bad Name"), "name"),
            (dict(name="default"), "name"),
            (dict(name="t", capacity=-1), "capacity"),
            (dict(name="t", eviction="lru"), "eviction"),
            (dict(name="t", max_payload_bytes=10**6), "max_payload_bytes"),
            (dict(name="t", forget_below=1.0), "forget_below"),
            (dict(name="t", forget_below=float("nan")), "forget_below"),
            (dict(name="replay"), "exists"),
        ]
        for kwargs, field in bad_specs:
            with pytest.raises(NeuroshardError) as err:
                await client.create_table(**kwargs)
            assert field in str(err.value), (kwargs, str(err.value))
        with pytest.raises(NeuroshardError) as err:
            await client.drop_table("default")
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert [t["name"] for t in await client.list_tables()] == ["default", "replay"]
        assert await _everything(client) == before


async def test_a_worker_refuses_an_unknown_table_before_applying_anything(make_cluster) -> None:
    from shared.proto import worker_pb2, worker_pb2_grpc
    from shared.rpc import channel
    from shared.rpc.codec import f32_to_bytes, ids_to_bytes

    cluster = await make_cluster(workers=1)
    async with cluster.client() as client:
        await client.wait_ready()
        m = await client._router.slot_map()
    w = cluster.workers[0]
    async with channel(w.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        request = worker_pb2.UpsertRequest(
            epoch=m.epoch,
            ids=ids_to_bytes(POOL[:4]),
            strengths=f32_to_bytes(np.ones(4, np.float32)),
            request_id=b"r1",
            table="nope",
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Upsert(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in err.value.details()
    assert len(w.nodes.current) == 0


# --- capacity, eviction, forgetting ---------------------------------------------------------


async def test_capped_tables_evict_exactly_as_one_process_with_a_join_and_a_kill(
    tmp_path,
) -> None:
    pool = ClusterPool(tmp_path, 3, 64, **KILL_HEARTBEATS)
    cluster = await pool.checkout()
    rng = np.random.default_rng(7)
    try:
        async with cluster.client() as client:
            ref = await ensure_tables(client, 64)
            for step in range(12):
                if step == 4:
                    await cluster.add_worker()
                    await wait_settled(cluster)
                if step == 8:
                    await cluster.kill(1)
                for name in ("fifo", "weak"):
                    n = int(rng.integers(1, 30))
                    ids = POOL[rng.integers(0, len(POOL), n)]
                    strengths = rng.random(n, dtype=np.float32)
                    got = await client.upsert(ids, strengths, table=name)
                    assert got == ref[name].upsert(ids, strengths)
                    assert (await client.quality(table=name))["count"] == ref[name].count()
                    assert ref[name].count() <= dict((c[0], c[1]) for c in CAPPED)[name]
                if step % 3 == 2:
                    assert await client.decay(0.125, table="weak") == ref["weak"].decay(0.125)
                    reinforced = await client.reinforce(
                        POOL[:40], np.full(40, 0.5, np.float32), table="weak"
                    )
                    assert reinforced == ref["weak"].reinforce(POOL[:40], np.full(40, 0.5))
            assert ref["fifo"].count() == 20 and 0 < ref["weak"].count() <= 15
            await wait_settled(cluster)
            await wait_until(
                lambda: cluster.coordinator.cluster.slot_summary()["under_replicated_slots"] == 0,
                what="every slot back at its replication factor",
            )
            for table in TABLES:
                await assert_cluster_equals(cluster, ref[table], table)
                await assert_copies_identical(cluster, table)
            await assert_reads_match(client, ref, 10)
            assert len(cluster.workers) == 3
    finally:
        await pool.close()


async def test_a_capped_table_refuses_a_direct_upsert_and_a_bad_insert(make_cluster) -> None:
    from shared.proto import coordinator_pb2, worker_pb2, worker_pb2_grpc
    from shared.rpc import channel
    from shared.rpc.codec import f32_to_bytes, ids_to_bytes

    cluster = await make_cluster(workers=1)
    async with cluster.client() as client:
        await client.wait_ready()
        await client.create_table("capped", capacity=3, max_payload_bytes=2)
        m = await client._router.slot_map(refresh=True)
        with pytest.raises(NeuroshardError) as err:
            await client.upsert(POOL[:2], np.ones(2, np.float32), [b"ok", b"big"], table="capped")
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "payloads[1]" in str(err.value)
        with pytest.raises(NeuroshardError) as err:  # an insert names a capped table
            await client._call(
                client._stub.Insert, coordinator_pb2.InsertRequest(table="default", ids=b"")
            )
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    async with channel(cluster.workers[0].address) as ch:
        request = worker_pb2.UpsertRequest(
            epoch=m.epoch,
            ids=ids_to_bytes(POOL[:4]),
            strengths=f32_to_bytes(np.ones(4, np.float32)),
            request_id=b"r1",
            table="capped",
        )
        with pytest.raises(grpc.aio.AioRpcError) as rpc_err:
            await worker_pb2_grpc.WorkerStub(ch).Upsert(request, timeout=10)
    assert rpc_err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "through the coordinator" in rpc_err.value.details()
    assert len(cluster.workers[0].nodes.current) == 0


# --- durability, export and import ------------------------------------------------------------


async def test_a_full_cluster_restart_keeps_every_table_and_the_insert_order(
    make_cluster, tmp_path
) -> None:
    from coordinator.server import CoordinatorServer
    from shared.config import CoordinatorConfig
    from tests.integration.test_durability import crash_coordinator, crash_worker, settled

    timings = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=10.0)
    cluster = await make_cluster(
        workers=3, slots=64, worker_overrides={"fsync": "always"}, **timings
    )
    async with cluster.client() as client:
        await client.wait_ready()
        ref = await ensure_tables(client, 64)
        for start in range(0, 60, 15):  # the fifo table holds the last 20 of 60 inserts
            ids = POOL[start : start + 15]
            s = np.full(15, 0.5, np.float32)
            for table in ("replay", "fifo"):
                assert await client.upsert(ids, s, table=table) == ref[table].upsert(ids, s)
    for name in [w.name for w in cluster.workers]:
        await crash_worker(cluster, name)
    await crash_coordinator(cluster)
    coordinator = CoordinatorServer(
        CoordinatorConfig(
            listen="127.0.0.1:0",
            data_dir=str(tmp_path / "coord"),
            metrics_port=None,
            slots=64,
            grace_s=0.5,
            **timings,
        )
    )
    cluster.coordinator, cluster.address = coordinator, await coordinator.start()
    for name in ("worker-2", "worker-0", "worker-1"):
        await cluster.add_worker(name)
    await settled(cluster, 3)

    async with cluster.client() as client:
        assert [t["name"] for t in await client.list_tables()] == ["default", *sorted(TABLES[1:])]
        ids, s = POOL[100:105], np.full(5, 0.75, np.float32)
        assert await client.upsert(ids, s, table="fifo") == ref["fifo"].upsert(ids, s)
        for table in TABLES:
            await assert_cluster_equals(cluster, ref[table], table)
            await assert_copies_identical(cluster, table)


async def test_a_table_exports_and_imports_into_another_table(make_cluster, tmp_path) -> None:
    cluster = await make_cluster(workers=2)
    async with cluster.client() as client:
        await client.wait_ready()
        await client.create_table("a")
        await client.create_table("b", capacity=10)
        ids = POOL[:30]
        s = np.linspace(0, 1, 30, dtype=np.float32)
        await client.upsert(ids, s, [b"x%d" % i for i in range(30)], table="a")
        await client.upsert(ids[:3], np.ones(3, np.float32))  # the default table: not exported

        doc = await client.export_memories(tmp_path / "a.npz", table="a")
        await client.import_memories(tmp_path / "a.npz", table="b")

        assert doc["memories"] == 30
        got = np.load(tmp_path / "a.npz", allow_pickle=False)
        assert sorted(got["ids"].tolist()) == sorted(ids.tolist())
        found, strengths, payloads = await client.get(ids, with_payloads=True, table="b")
        assert int(found.sum()) == 10, "the import is inserts: the capped table keeps 10"
        assert (await client.quality(table="a"))["count"] == 30


# --- roles ---------------------------------------------------------------------------------


async def test_admin_creates_and_drops_readers_list_writers_insert(secure, material) -> None:
    cluster = await secure(workers=2)
    admin, writer, reader = (
        Client(cluster.address, timeout_s=10, security=material.client(material.token(r)))
        for r in ("admin", "writer", "reader")
    )
    try:
        await admin.wait_ready()
        await admin.create_table("capped", capacity=2)
        for denied in (writer.create_table("t"), reader.drop_table("capped")):
            with pytest.raises(NeuroshardError) as err:
                await denied
            assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert [t["name"] for t in await reader.list_tables()] == ["default", "capped"]
        s = np.full(3, 0.5, np.float32)
        assert await writer.upsert(POOL[:3], s, table="capped") == 3  # through Insert
        with pytest.raises(NeuroshardError) as err:
            await reader.upsert(POOL[:3], s, table="capped")
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        found, _, _ = await reader.get(POOL[:3], table="capped")
        assert found.tolist() == [False, True, True]  # fifo: the first insert was evicted
        assert [t["name"] for t in await admin.list_tables()] == ["default", "capped"]
    finally:
        for c in (admin, writer, reader):
            await c.close()
