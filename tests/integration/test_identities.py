"""Identities against real servers: roles, daemons known by their certificates (worker names
and addresses bound to them, no token sent between daemons), token audiences, job visibility,
and refusals decided before a request is parsed. Every refusal is checked to have changed
nothing."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2_grpc

from shared.client import Client, NeuroshardError
from shared.proto import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from shared.rpc import channel
from shared.rpc.codec import f32_to_bytes, ids_to_bytes, rows_to_bytes
from shared.security.tokens import AUD_DATA, verify_token
from shared.security.transport import TlsFiles
from tests.conftest import wait_until
from tests.integration.security_helpers import Material, coordinator_state, worker_state

pytestmark = pytest.mark.integration

QUEUED_JOB = {"kind": "train", "workers": 9, "steps": 1}  # 9 workers never come: stays QUEUED


async def _code(call) -> tuple[grpc.StatusCode, str]:
    """Await an RPC; its status code and details (OK, "" on success)."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def _seeded(secure, material: Material, workers: int = 2):
    """A secure cluster whose slot map has settled, with memories 0..99 at strength 0.5."""
    cluster = await secure(workers=workers)
    async with Client(cluster.address, security=material.client(material.token("writer"))) as c:
        await c.wait_ready()
        await c.upsert(list(range(100)), [0.5] * 100)
    members = cluster.coordinator.cluster.membership
    # Heartbeats report each worker's primary memories: wait for them, so that only a
    # refused request could change the membership snapshot taken next.
    await wait_until(
        lambda: sum(w.memories for w in members.alive()) == 100, what="heartbeats of 100"
    )
    return cluster


async def test_a_worker_certificate_cannot_act_as_another_worker(
    secure, material: Material
) -> None:
    # Arrange: worker-0's own certificate in the hands of whoever wants to be worker-1
    cluster = await _seeded(secure, material)
    before = coordinator_state(cluster), [worker_state(w) for w in cluster.workers]
    stolen = material.daemon_client("worker-0")
    calls = {
        "RegisterWorker": coordinator_pb2.RegisterWorkerRequest(
            name="worker-1", address="127.0.0.1:1", incarnation="evil"
        ),
        "Heartbeat": coordinator_pb2.HeartbeatRequest(name="worker-1", memories=999),
        "ReportFailure": coordinator_pb2.ReportFailureRequest(
            reporter="worker-1", worker="worker-0", reason="lies", slots=list(range(16))
        ),
        "DrainWorker": coordinator_pb2.DrainWorkerRequest(name="worker-1"),
    }

    # Act
    got = {}
    async with channel(cluster.address, security=stolen) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        for method, request in calls.items():
            got[method] = await _code(getattr(stub, method)(request, timeout=5))
        # control: the certificate works for its own name (repeating what worker-0 reports)
        memories = cluster.coordinator.cluster.membership.get("worker-0").memories
        own = await _code(
            stub.Heartbeat(
                coordinator_pb2.HeartbeatRequest(
                    name="worker-0", memories=memories, slot_map_epoch=before[0]["epoch"]
                )
            )
        )
        shard = stub.FetchShard(coordinator_pb2.FetchShardRequest(job_id="j", worker="worker-1"))
        got["FetchShard"] = await _code(shard.read())

    # Assert: each refused naming both names; the certificate still works for its own name
    for method, (code, details) in got.items():
        assert code is grpc.StatusCode.PERMISSION_DENIED, (method, details)
        assert details.startswith(
            f"{method}: worker 'worker-0' (by its certificate) may not act as"
        ), details
        assert "'worker-1'" in details
    assert own[0] is grpc.StatusCode.OK
    assert (coordinator_state(cluster), [worker_state(w) for w in cluster.workers]) == before


async def test_a_worker_registers_only_an_address_its_certificate_names(
    secure, material: Material
) -> None:
    # Arrange: a valid certificate for "evil" (localhost and 127.0.0.1 only)
    cluster = await secure(workers=1)
    async with Client(cluster.address, security=material.client(material.token("admin"))) as c:
        await c.wait_ready()
    before = coordinator_state(cluster)

    # Act: it claims to live at another host, where the coordinator would then send slots
    async with channel(cluster.address, security=material.daemon_client("evil")) as ch:
        code, details = await _code(
            coordinator_pb2_grpc.CoordinatorStub(ch).RegisterWorker(
                coordinator_pb2.RegisterWorkerRequest(name="evil", address="192.0.2.7:50052"),
                timeout=5,
            )
        )

    # Assert
    assert code is grpc.StatusCode.PERMISSION_DENIED
    assert details.startswith("RegisterWorker: address '192.0.2.7:50052': host '192.0.2.7' is")
    assert "localhost, 127.0.0.1" in details
    assert coordinator_state(cluster) == before


async def test_each_daemon_identity_calls_only_its_own_rpcs(secure, material: Material) -> None:
    # Arrange: the coordinator's certificate, and a worker's, each dialling on its own
    cluster = await _seeded(secure, material)
    before = coordinator_state(cluster), [worker_state(w) for w in cluster.workers]
    target, other = cluster.workers
    epoch = worker_state(target)[0]
    as_coordinator = material.daemon_client()
    as_worker = material.daemon_client("worker-1")

    # Act
    got = {}
    async with channel(cluster.address, security=as_coordinator) as ch:
        c = coordinator_pb2_grpc.CoordinatorStub(ch)
        got["coordinator: ListJobs"] = await _code(
            c.ListJobs(coordinator_pb2.ListJobsRequest(), timeout=5)
        )
        got["coordinator: Decay"] = await _code(
            c.Decay(coordinator_pb2.DecayRequest(rate=1.0), timeout=5)
        )
        got["coordinator: SubmitJob"] = await _code(
            c.SubmitJob(coordinator_pb2.SubmitJobRequest(spec_json="{}"), timeout=5)
        )
    async with channel(target.address, security=as_coordinator) as ch:
        got["coordinator: Replicate"] = await _code(
            worker_pb2_grpc.WorkerStub(ch).Replicate(worker_pb2.ReplicateRequest(), timeout=5)
        )
    async with channel(target.address, security=as_worker) as ch:
        w = worker_pb2_grpc.WorkerStub(ch)
        got["worker: Decay"] = await _code(
            w.Decay(worker_pb2.WorkerDecayRequest(rate=1.0, epoch=epoch), timeout=5)
        )
        got["worker: ApplySlotMap"] = await _code(
            w.ApplySlotMap(common_pb2.SlotMap(epoch=10**6, slots=16), timeout=5)
        )
        got["worker: CopySlots"] = await _code(
            w.CopySlots(worker_pb2.CopySlotsRequest(target=other.address, slots=[1]), timeout=5)
        )
        got["worker: Upsert"] = await _code(
            w.Upsert(
                worker_pb2.UpsertRequest(
                    epoch=epoch, ids=ids_to_bytes([1]), strengths=f32_to_bytes([1.0])
                ),
                timeout=5,
            )
        )
    async with channel(cluster.address, security=as_worker) as ch:
        got["worker: ListJobs"] = await _code(
            coordinator_pb2_grpc.CoordinatorStub(ch).ListJobs(
                coordinator_pb2.ListJobsRequest(), timeout=5
            )
        )

    # Assert
    for case, (code, details) in got.items():
        who, method = case.split(": ")
        subject = "coordinator" if who == "coordinator" else "worker-1"
        assert (code, details) == (
            grpc.StatusCode.PERMISSION_DENIED,
            f"{who} '{subject}' may not call {method}",
        ), case
    assert (coordinator_state(cluster), [worker_state(w) for w in cluster.workers]) == before


async def test_tokens_are_bound_to_their_audience(secure, material: Material) -> None:
    # Arrange: an admin's own token (coordinator audience), and a data-plane token
    cluster = await _seeded(secure, material, workers=1)
    before = coordinator_state(cluster), worker_state(cluster.workers[0])
    worker = cluster.workers[0]
    admin = material.client(material.token("admin", "ada"))
    data = material.client(material.token("writer", "ada", audience=AUD_DATA))

    # Act: the admin token replayed to a worker; the data token replayed to the coordinator
    async with channel(worker.address, security=admin) as ch:
        on_worker = await _code(
            worker_pb2_grpc.WorkerStub(ch).Decay(worker_pb2.WorkerDecayRequest(rate=1.0))
        )
    async with channel(cluster.address, security=data) as ch:
        on_coordinator = await _code(
            coordinator_pb2_grpc.CoordinatorStub(ch).ListJobs(coordinator_pb2.ListJobsRequest())
        )
    # control: the client library gets a data-plane token and reads with it
    async with Client(cluster.address, security=admin) as client:
        found, _, _ = await client.get(list(range(100)))
        data_token = client._router.data_token()

    # Assert
    assert on_worker[0] is grpc.StatusCode.UNAUTHENTICATED
    assert on_worker[1] == (
        "token is not for this daemon (audience 'neuroshard', expected 'neuroshard-data')"
    )
    assert on_coordinator[0] is grpc.StatusCode.UNAUTHENTICATED
    assert "audience 'neuroshard-data', expected 'neuroshard'" in on_coordinator[1]
    assert found.all()
    principal = verify_token(material.key.public_key(), data_token, audience=AUD_DATA)
    assert (principal.subject, principal.role) == ("ada", "writer")
    assert principal.expires_at - time.time() <= 600 + 5
    assert (coordinator_state(cluster), worker_state(cluster.workers[0])) == before


async def test_no_token_travels_between_daemons(secure, material: Material) -> None:
    """A registered worker (a valid certificate of its own) sees every call the coordinator
    and its peers make to it: none carries a bearer token to capture and replay."""
    # Arrange: a server posing as worker "evil", recording the metadata of every call
    seen: list[tuple[str, tuple[tuple[str, str | bytes], ...]]] = []

    class Recorder(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            seen.append((details.method, tuple(details.invocation_metadata or ())))
            return await continuation(details)

    cluster = await secure(workers=2)
    evil = grpc.aio.server(interceptors=[Recorder()])
    health = grpc_health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, evil)
    tls = material.worker_tls("evil")
    files = TlsFiles.load(tls.ca_file, tls.cert_file, tls.key_file)
    creds = files.server_credentials()
    port = evil.add_secure_port("127.0.0.1:0", creds)
    await evil.start()
    try:
        # Act: register, heartbeat; the coordinator probes it and pushes slot maps
        async with channel(cluster.address, security=material.daemon_client("evil")) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            await stub.RegisterWorker(
                coordinator_pb2.RegisterWorkerRequest(name="evil", address=f"127.0.0.1:{port}"),
                timeout=5,
            )
            hb = coordinator_pb2.HeartbeatRequest(name="evil")
            await wait_until(
                lambda: len({m for m, _ in seen}) >= 2,
                timeout_s=cluster.coordinator.cfg.heartbeat_timeout_s * 4,
                what="the coordinator's calls to evil",
            )
            await stub.Heartbeat(hb, timeout=5)
    finally:
        await evil.stop(0)

    # Assert: the calls arrived (a probe and a slot map at least), none with a token
    methods = {m for m, _ in seen}
    assert any(m.startswith("/grpc.health.") for m in methods), methods
    assert "/neuroshard.v1.Worker/ApplySlotMap" in methods, methods
    for method, metadata in seen:
        assert all(key != "authorization" for key, _ in metadata), (method, metadata)


async def test_a_reader_cannot_write(secure, material: Material) -> None:
    # Arrange: a writer's queued job and 100 memories
    cluster = await _seeded(secure, material)
    async with Client(cluster.address, security=material.client(material.token("writer"))) as w:
        job = await w.submit(QUEUED_JOB)
    before = coordinator_state(cluster), [worker_state(w) for w in cluster.workers]
    reader = material.client(material.token("reader", "rita"))
    reader_data = material.client(material.token("reader", "rita", audience=AUD_DATA))
    worker = cluster.workers[0]
    epoch = worker_state(worker)[0]

    # Act: the coordinator's write RPCs, then a worker's keyed writes
    async with channel(cluster.address, security=reader) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        submit = await _code(stub.SubmitJob(coordinator_pb2.SubmitJobRequest(spec_json="{}")))
        cancel = await _code(stub.CancelJob(coordinator_pb2.JobRequest(job_id=job.job_id)))
    async with channel(worker.address, security=reader_data) as ch:
        wstub = worker_pb2_grpc.WorkerStub(ch)
        ids = ids_to_bytes(list(range(100)))
        upsert = await _code(
            wstub.Upsert(
                worker_pb2.UpsertRequest(epoch=epoch, ids=ids, strengths=f32_to_bytes([1.0] * 100))
            )
        )
        delete = await _code(wstub.Delete(worker_pb2.DeleteRequest(epoch=epoch, ids=ids)))
    async with Client(cluster.address, security=reader) as r:
        with pytest.raises(NeuroshardError) as via_client:
            await r.upsert([1, 2], [1.0, 1.0])
        found, strengths, _ = await r.get(list(range(100)))  # reading is allowed

    # Assert
    assert submit == (grpc.StatusCode.PERMISSION_DENIED, "reader 'rita' may not call SubmitJob")
    assert cancel == (grpc.StatusCode.PERMISSION_DENIED, "reader 'rita' may not call CancelJob")
    assert upsert == (grpc.StatusCode.PERMISSION_DENIED, "reader 'rita' may not call Upsert")
    assert delete == (grpc.StatusCode.PERMISSION_DENIED, "reader 'rita' may not call Delete")
    assert via_client.value.code is grpc.StatusCode.PERMISSION_DENIED
    assert found.all() and (strengths == 0.5).all()
    assert (coordinator_state(cluster), [worker_state(w) for w in cluster.workers]) == before


async def test_a_writer_cannot_decay_the_store_or_drain_workers(secure, material: Material) -> None:
    # Arrange
    cluster = await _seeded(secure, material)
    before = coordinator_state(cluster), [worker_state(w) for w in cluster.workers]

    # Act
    async with channel(
        cluster.address, security=material.client(material.token("writer", "wendy"))
    ) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        decay = await _code(stub.Decay(coordinator_pb2.DecayRequest(rate=1.0), timeout=5))
        drain = await _code(
            stub.DrainWorker(coordinator_pb2.DrainWorkerRequest(name="worker-0"), timeout=5)
        )

    # Assert
    assert decay == (grpc.StatusCode.PERMISSION_DENIED, "writer 'wendy' may not call Decay")
    assert drain == (grpc.StatusCode.PERMISSION_DENIED, "writer 'wendy' may not call DrainWorker")
    assert (coordinator_state(cluster), [worker_state(w) for w in cluster.workers]) == before


@pytest.mark.parametrize("role", ["reader", "writer"])
async def test_people_cannot_call_worker_internal_rpcs(
    secure, material: Material, role: str
) -> None:
    # Arrange
    cluster = await _seeded(secure, material)
    before = coordinator_state(cluster), [worker_state(w) for w in cluster.workers]
    person = material.client(material.token(role, "pat"))
    person_data = material.client(material.token(role, "pat", audience=AUD_DATA))
    target, other = cluster.workers
    evil_map = common_pb2.SlotMap(epoch=10**6, slots=16)
    slot = worker_pb2.SlotData(
        slot=1, seq=99, first=True, ids=ids_to_bytes([7]), strengths=f32_to_bytes([1.0])
    )

    # Act
    async with channel(target.address, security=person_data) as ch:
        w = worker_pb2_grpc.WorkerStub(ch)
        got = {
            "ApplySlotMap": await _code(w.ApplySlotMap(evil_map, timeout=5)),
            "Replicate": await _code(w.Replicate(worker_pb2.ReplicateRequest(), timeout=5)),
            "CopySlots": await _code(
                w.CopySlots(worker_pb2.CopySlotsRequest(target=other.address, slots=[1]), timeout=5)
            ),
            "ReceiveSlots": await _code(w.ReceiveSlots(iter([slot]), timeout=5)),
            "Decay": await _code(w.Decay(worker_pb2.WorkerDecayRequest(rate=1.0), timeout=5)),
        }
    async with channel(cluster.address, security=person) as ch:
        c = coordinator_pb2_grpc.CoordinatorStub(ch)
        got["RegisterWorker"] = await _code(
            c.RegisterWorker(
                coordinator_pb2.RegisterWorkerRequest(name="pat", address="127.0.0.1:1"),
                timeout=5,
            )
        )
        got["Heartbeat"] = await _code(
            c.Heartbeat(coordinator_pb2.HeartbeatRequest(name="worker-0"), timeout=5)
        )

    # Assert
    for method, result in got.items():
        assert result == (
            grpc.StatusCode.PERMISSION_DENIED,
            f"{role} 'pat' may not call {method}",
        )
    assert (coordinator_state(cluster), [worker_state(w) for w in cluster.workers]) == before


async def test_a_client_cannot_see_or_cancel_another_clients_job(
    secure, material: Material
) -> None:
    # Arrange: alice's job waits QUEUED for a worker that never comes
    cluster = await secure()
    people = {
        name: Client(cluster.address, security=material.client(material.token(role, name)))
        for name, role in [("alice", "writer"), ("bob", "writer"), ("rita", "reader")]
    }
    admin = Client(cluster.address, security=material.client(material.token("admin", "root")))
    alice, bob, rita = people["alice"], people["bob"], people["rita"]
    job = await alice.submit(QUEUED_JOB)

    async def refusal(client: Client, action: str, job_id: str) -> tuple[grpc.StatusCode, str]:
        try:
            if action == "watch":
                async for _ in client.watch(job_id):
                    break
            else:
                await getattr(client, action)(job_id)
        except NeuroshardError as exc:
            return exc.code, str(exc)
        return grpc.StatusCode.OK, ""

    # Act
    try:
        theirs = {
            (who, action): await refusal(client, action, job.job_id)
            for who, client, actions in [
                ("bob", bob, ("get_job", "watch", "cancel")),
                ("rita", rita, ("get_job", "watch")),  # a reader may cancel nothing at all
            ]
            for action in actions
        }
        unknown = {
            action: await refusal(bob, action, "no-such-job")
            for action in ("get_job", "watch", "cancel")
        }
        listed = {name: [j.job_id for j in await c.jobs()] for name, c in people.items()}
        state_after_bob = cluster.coordinator.cluster.jobs.get(job.job_id).state.value
        seen_by_admin = [j.job_id for j in await admin.jobs()]
        cancelled = await admin.cancel(job.job_id)
    finally:
        for c in [*people.values(), admin]:
            await c.close()

    # Assert: exactly the answer of an unknown id (no existence oracle)
    for (who, action), (code, message) in theirs.items():
        code_u, message_u = unknown[action]
        assert code is code_u is grpc.StatusCode.NOT_FOUND, (who, action)
        assert message == message_u.replace("no-such-job", job.job_id), (who, action)
    assert listed == {"alice": [job.job_id], "bob": [], "rita": []}
    assert state_after_bob == "QUEUED"
    assert seen_by_admin == [job.job_id]
    assert cancelled.state == "CANCELLED"


async def test_a_refused_request_is_never_deserialized(secure, material: Material) -> None:
    # Arrange: bytes that are no SubmitJobRequest (a varint that never ends)
    cluster = await _seeded(secure, material, workers=1)
    garbage = b"\xff" * 12

    async def raw(address: str, method: str, token: str | None, stream: bool = False):
        async with channel(address, security=material.client(token)) as ch:
            identity = {"request_serializer": None, "response_deserializer": None}
            if stream:
                call = ch.stream_unary(method, **identity)(iter([garbage, garbage]), timeout=5)
            else:
                call = ch.unary_unary(method, **identity)(garbage, timeout=5)
            return (await _code(call))[0]

    submit = "/neuroshard.v1.Coordinator/SubmitJob"
    receive = "/neuroshard.v1.Worker/ReceiveSlots"
    forged = material.token("admin", "x", now=0)  # expired long ago
    before = coordinator_state(cluster), worker_state(cluster.workers[0])

    # Act
    got = {
        "no token": await raw(cluster.address, submit, None),
        "expired": await raw(cluster.address, submit, forged),
        "reader": await raw(cluster.address, submit, material.token("reader")),
        "stream, writer": await raw(
            cluster.workers[0].address,
            receive,
            material.token("writer", audience=AUD_DATA),
            stream=True,
        ),
        # control: a caller who may call it gets the bytes parsed, and refused as garbage
        "writer": await raw(cluster.address, submit, material.token("writer")),
    }

    # Assert
    assert got["no token"] is got["expired"] is grpc.StatusCode.UNAUTHENTICATED
    assert got["reader"] is got["stream, writer"] is grpc.StatusCode.PERMISSION_DENIED
    assert got["writer"] in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNKNOWN)
    assert (coordinator_state(cluster), worker_state(cluster.workers[0])) == before
    counted = cluster.coordinator.metrics.rpcs.labels("SubmitJob", "UNAUTHENTICATED")
    await wait_until(lambda: counted._value.get() == 2, what="two refusals counted")


async def test_a_data_token_reads_a_worker_as_the_coordinator_would(
    secure, material: Material
) -> None:
    """Quality, TopK and a sample's phases on a worker (the client's own fan-out) give a
    reader's data-plane token what the coordinator's Quality, TopK and Sample give its
    coordinator token, no more: no eviction candidates (their insert stamps), no k above
    topk_max, no more picks than max_sample_batch, no other worker RPC."""
    # Arrange: 100 memories; a reader's data-plane token as GetSlotMap mints it
    cluster = await _seeded(secure, material, workers=1)
    before = coordinator_state(cluster), worker_state(cluster.workers[0])
    worker = cluster.workers[0]
    epoch = worker_state(worker)[0]
    topk_max = cluster.coordinator.cfg.topk_max
    batch_max = cluster.coordinator.cfg.max_sample_batch
    reader = material.client(material.token("reader", "rita"))
    async with Client(cluster.address, security=reader) as r:
        await r.get([1])
        data_token = r._router.data_token()
        via_client = await r.quality(), await r.topk(5), await r.sample(8, seed=3)
    reader_data = material.client(data_token)

    # Act: the two reads, then the attacks: eviction candidates, a k above the limit,
    # the control RPCs beside them
    async with channel(worker.address, security=reader_data) as ch:
        wstub = worker_pb2_grpc.WorkerStub(ch)
        quality = await wstub.Quality(worker_pb2.WorkerQualityRequest(epoch=epoch), timeout=5)
        top = await wstub.TopK(worker_pb2.WorkerTopKRequest(epoch=epoch, k=5), timeout=5)
        attacks = {
            "order": await _code(
                wstub.TopK(
                    worker_pb2.WorkerTopKRequest(epoch=epoch, k=5, order="oldest"), timeout=5
                )
            ),
            "k": await _code(
                wstub.TopK(worker_pb2.WorkerTopKRequest(epoch=epoch, k=topk_max + 1), timeout=5)
            ),
            "picks": await _code(
                wstub.SamplePick(
                    worker_pb2.WorkerSamplePickRequest(
                        epoch=epoch,
                        slots=rows_to_bytes([0] * (batch_max + 1)),
                        offsets=ids_to_bytes([0] * (batch_max + 1)),
                    ),
                    timeout=5,
                )
            ),
            "copy": await _code(
                wstub.CopySlots(worker_pb2.CopySlotsRequest(target="x", slots=[0]), timeout=5)
            ),
            "sweep": await _code(
                wstub.Sweep(worker_pb2.WorkerSweepRequest(epoch=epoch, rate=1.0), timeout=5)
            ),
        }

    # Assert: the reads answer; every attack is refused and changed nothing
    assert quality.count == 100
    assert len(top.ids) == 5 * 8
    assert via_client[0]["count"] == 100 and len(via_client[1][0]) == 5
    assert len(via_client[2].ids) == 8
    sums = await _sums(worker.address, reader_data, epoch)
    assert sums.memories == 100
    assert attacks["order"] == (
        grpc.StatusCode.PERMISSION_DENIED,
        "TopK: reader 'rita' may not ask for eviction candidates",
    )
    assert attacks["k"] == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"k: {topk_max + 1} exceeds the limit {topk_max}",
    )
    assert attacks["picks"] == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"n: {batch_max + 1} draws exceed max_sample_batch {batch_max}",
    )
    assert attacks["copy"] == (
        grpc.StatusCode.PERMISSION_DENIED,
        "reader 'rita' may not call CopySlots",
    )
    assert attacks["sweep"] == (
        grpc.StatusCode.PERMISSION_DENIED,
        "reader 'rita' may not call Sweep",
    )
    assert (coordinator_state(cluster), worker_state(cluster.workers[0])) == before


async def _sums(address: str, security, epoch: int) -> worker_pb2.WorkerSampleSumsResponse:
    """A sample's phase 1 on one worker with ``security``'s token."""
    async with channel(address, security=security) as ch:
        return await worker_pb2_grpc.WorkerStub(ch).SampleSums(
            worker_pb2.WorkerSampleSumsRequest(epoch=epoch), timeout=5
        )
