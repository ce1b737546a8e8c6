"""Mutual TLS, token roles and limits against real servers on port 0 with generated certs."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import structlog
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from shared.certs import CertPaths, write_dev_certs
from shared.client import Client, NeuroshardError
from shared.codec import f32_to_bytes, ids_to_bytes
from shared.config import AuthConfig, TlsConfig
from shared.proto import coordinator_pb2, coordinator_pb2_grpc, worker_pb2, worker_pb2_grpc
from shared.rpc import channel
from shared.security import ChannelSecurity, TlsFiles, client_security
from shared.tokens import TokenSource, create_token, read_secret, write_secret
from tests.conftest import wait_until
from tests.integration.cli_helpers import CLI, REPO

pytestmark = pytest.mark.integration

DIGITS_MLP = REPO / "configs/jobs/digits-mlp.yaml"


@dataclass
class Material:
    """Certificates and a token secret generated for one test."""

    certs: CertPaths
    secret_file: Path
    secret: bytes

    @property
    def tls(self) -> TlsConfig:
        return TlsConfig(
            ca_file=str(self.certs.ca_cert),
            cert_file=str(self.certs.node_cert),
            key_file=str(self.certs.node_key),
        )

    @property
    def auth(self) -> AuthConfig:
        return AuthConfig(secret_file=str(self.secret_file))

    def token(self, role: str, subject: str = "tester", ttl_s: float = 300) -> str:
        return create_token(self.secret, role, subject, ttl_s)

    def client(self, token: str | None) -> ChannelSecurity:
        c = self.certs
        return client_security(str(c.ca_cert), str(c.client_cert), str(c.client_key), token=token)


@pytest.fixture
def material(tmp_path: Path) -> Material:
    secret_file = write_secret(tmp_path / "auth" / "secret")
    return Material(write_dev_certs(tmp_path / "certs"), secret_file, read_secret(secret_file))


@pytest.fixture
async def secure(make_cluster, material: Material):
    """Factory of in-process clusters with mutual TLS and token auth on every daemon."""

    async def make(workers: int = 0, **overrides: object):
        both = {"tls": material.tls, "auth": material.auth}
        return await make_cluster(workers=workers, worker_overrides=both, **both, **overrides)

    return make


async def _status_code(address: str, security: ChannelSecurity | None) -> tuple[str, str]:
    async with Client(address, timeout_s=10, security=security) as client:
        try:
            await client.status()
        except NeuroshardError as exc:
            return exc.code.name, str(exc)
    return "OK", ""


@pytest.mark.parametrize(
    ("case", "code", "message"),
    [
        ("no token", "UNAUTHENTICATED", "missing bearer token"),
        ("bad signature", "UNAUTHENTICATED", "token signature is invalid"),
        ("expired", "UNAUTHENTICATED", "token expired at "),
        ("wrong role", "PERMISSION_DENIED", "role worker may not call GetClusterStatus"),
        ("right role", "OK", ""),
    ],
)
async def test_each_auth_outcome(secure, material: Material, case, code, message) -> None:
    # Arrange
    cluster = await secure()
    token = {
        "no token": None,
        "bad signature": create_token(b"x" * 32, "client", "mallory", 300),
        "expired": create_token(material.secret, "client", "old", 10, now=time.time() - 600),
        "wrong role": material.token("worker"),
        "right role": material.token("client"),
    }[case]

    # Act
    got_code, got_message = await _status_code(cluster.address, material.client(token))

    # Assert
    assert got_code == code
    assert got_message.startswith(message)
    counted = cluster.coordinator.metrics.rpcs.labels("GetClusterStatus", code)
    # abort() sends the status before the server's interceptor counts it: poll
    await wait_until(lambda: counted._value.get() == 1, what=f"one {code} counted")


async def test_health_checks_need_no_token(secure, material: Material) -> None:
    cluster = await secure()
    async with channel(cluster.address, security=material.client(None)) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_plaintext_client_against_tls_server_fails_clearly(secure) -> None:
    # Arrange
    cluster = await secure()

    # Act: the Python client, then the CLI in a subprocess
    code, message = await _status_code(cluster.address, None)
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "status",
        "--coordinator",
        cluster.address,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)

    # Assert
    assert code == "UNAVAILABLE"
    assert "require TLS" in message and "\n" not in message
    assert proc.returncode == 1, err
    lines = [ln for ln in err.decode().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "cannot reach the coordinator" in lines[0], err.decode()
    assert "require TLS" in lines[0]


async def test_certificates_of_another_ca_are_refused(
    secure, material: Material, tmp_path: Path
) -> None:
    # Arrange
    cluster = await secure()
    other = write_dev_certs(tmp_path / "other")
    token = TokenSource(material.token("client"))
    ours = material.certs
    trusts_other_ca = ChannelSecurity(
        TlsFiles.load(str(other.ca_cert), str(ours.client_cert), str(ours.client_key)), token
    )
    presents_other_cert = ChannelSecurity(
        TlsFiles(
            ours.ca_cert.read_bytes(), other.client_cert.read_bytes(), other.client_key.read_bytes()
        ),
        token,
    )

    # Act
    client_side = await _status_code(cluster.address, trusts_other_ca)
    server_side = await _status_code(cluster.address, presents_other_cert)

    # Assert: the client refuses the server's certificate, the server refuses the client's
    assert client_side[0] == "UNAVAILABLE" and "handshake" in client_side[1].lower()
    assert server_side[0] == "UNAVAILABLE"
    assert await _status_code(cluster.address, material.client(token())) == ("OK", "")


async def test_worker_without_worker_token_cannot_register(
    secure, material: Material, tmp_path: Path
) -> None:
    # Arrange: a worker presenting a client token
    cluster = await secure()
    token_file = tmp_path / "client.token"
    token_file.write_text(material.token("client", "intruder"))
    cluster.worker_overrides["auth"] = AuthConfig(
        secret_file=str(material.secret_file), token_file=str(token_file)
    )

    # Act
    worker = await cluster.add_worker("intruder")
    await wait_until(worker.failed.is_set, what="the worker to give up")

    # Assert
    assert "role client may not call RegisterWorker" in worker.error
    assert cluster.coordinator.cluster.membership.get("intruder") is None


async def test_slot_data_needs_a_worker_token(secure, material: Material) -> None:
    # Arrange
    cluster = await secure(workers=1)
    target = cluster.workers[0].address
    slot_data = worker_pb2.SlotData(
        slot=1, seq=5, first=True, ids=ids_to_bytes([7]), strengths=f32_to_bytes([1.0])
    )

    async def send(token: str | None) -> grpc.StatusCode:
        async with channel(target, security=material.client(token)) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            try:
                await stub.ReceiveSlots(iter([slot_data]), timeout=5)
                await stub.Replicate(worker_pb2.ReplicateRequest(), timeout=5)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    # Act / Assert
    assert await send(None) is grpc.StatusCode.UNAUTHENTICATED
    assert await send(material.token("client")) is grpc.StatusCode.PERMISSION_DENIED
    seqs = await cluster.workers[0].servicer.SlotSeqs(worker_pb2.SlotSeqsRequest(slots=[1]), None)  # type: ignore[arg-type]
    assert list(seqs.seqs) == [0]


async def test_a_worker_may_drain_only_itself(secure, material: Material) -> None:
    cluster = await secure(workers=1)
    async with channel(
        cluster.address, security=material.client(material.token("worker", "worker-9"))
    ) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.DrainWorker(coordinator_pb2.DrainWorkerRequest(name="worker-0"), timeout=5)
    assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "may drain only itself" in info.value.details()


async def test_clients_cancel_only_their_own_jobs(secure, material: Material) -> None:
    # Arrange: alice's job waits QUEUED for a worker that never comes
    cluster = await secure()
    spec = {"kind": "train", "workers": 1, "steps": 1}
    async with Client(
        cluster.address, security=material.client(material.token("client", "alice"))
    ) as a:
        job = await a.submit(spec)
        async with (
            Client(
                cluster.address, security=material.client(material.token("client", "bob"))
            ) as bob,
            Client(
                cluster.address, security=material.client(material.token("admin", "root"))
            ) as admin,
        ):
            # Act
            with pytest.raises(NeuroshardError) as info:
                await bob.cancel(job.job_id)
            cancelled = await admin.cancel(job.job_id)

    # Assert
    assert info.value.code is grpc.StatusCode.PERMISSION_DENIED
    assert "only its own jobs" in str(info.value) and "'alice'" in str(info.value)
    assert cancelled.state == "CANCELLED"
    assert cluster.coordinator.cluster.jobs.get(job.job_id).owner == "alice"


async def test_request_logs_carry_method_caller_worker_and_job(secure, material: Material) -> None:
    # Arrange: debug logs captured with the context variables the interceptor binds
    wrapper = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
            # Act
            cluster = await secure(workers=1)
            security = material.client(material.token("client", "alice"))
            async with Client(cluster.address, security=security) as client:
                job = await client.submit({"kind": "train", "workers": 2, "steps": 1})
                await client.get_job(job.job_id)
            await wait_until(
                lambda: any(e.get("method") == "ApplySlotMap" for e in logs),
                what="a slot map pushed to the worker",
            )
    finally:
        structlog.configure(wrapper_class=wrapper)

    # Assert
    served = [e for e in logs if e["event"] == "rpc_served"]
    get = next(e for e in served if e["method"] == "GetJob")
    assert (get["subject"], get["role"], get["status"]) == ("alice", "client", "OK")
    assert get["job_id"] == job.job_id and get["peer"].startswith("ipv4:127.0.0.1:")
    assert get["duration_ms"] >= 0
    pushed = next(e for e in served if e["method"] == "ApplySlotMap")
    assert (pushed["worker"], pushed["subject"], pushed["role"]) == (
        "worker-0",
        "coordinator",
        "worker",
    )
    registered = next(
        e for e in logs if e["event"] == "worker_registered" and e.get("rpc") == "RegisterWorker"
    )
    assert registered["worker"] == "worker-0"
    submitted = next(e for e in logs if e["event"] == "job_submitted")
    assert submitted["owner"] == "alice"


async def test_job_count_per_client_is_limited(make_cluster) -> None:
    cluster = await make_cluster(workers=0, max_jobs_per_client=2)
    async with cluster.client() as client:
        for _ in range(2):
            await client.submit({"kind": "train", "workers": 1, "steps": 1})
        with pytest.raises(NeuroshardError) as info:
            await client.submit({"kind": "train", "workers": 1, "steps": 1})
    assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_jobs_per_client" in str(info.value)


async def test_batches_over_max_batch_items_are_refused_and_split(make_cluster) -> None:
    # Arrange
    cluster = await make_cluster(
        workers=2, max_batch_items=10, worker_overrides={"max_batch_items": 10}
    )
    async with cluster.client() as client:
        await client.wait_ready()
        w = cluster.workers[0]

        # Act: a raw request over the limit, then the client with a larger batch
        async with channel(w.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await worker_pb2_grpc.WorkerStub(ch).Get(
                    worker_pb2.GetRequest(epoch=1, ids=ids_to_bytes(list(range(11)))), timeout=5
                )
        written = await client.upsert(list(range(100)), [0.5] * 100)
        found, _, _ = await client.get(list(range(100)))

    # Assert
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("ids: 11 items exceed max_batch_items 10")
    assert written == 100 and found.all()


async def test_digits_training_passes_with_tls_and_tokens(secure, material: Material) -> None:
    # Arrange
    cluster = await secure(workers=3)
    spec = yaml.safe_load(DIGITS_MLP.read_text())

    # Act
    async with Client(
        cluster.address, security=material.client(material.token("client"))
    ) as client:
        job = await client.submit(spec)
        final = await client.wait(job.job_id)

    # Assert
    assert final.state == "SUCCEEDED", final.error
    assert final.result["test_accuracy"] >= 0.95
    assert set(final.result["workers"]) == {"worker-0", "worker-1", "worker-2"}


@pytest.mark.slow
def test_up_secure_runs_a_memory_job(tmp_path: Path) -> None:
    """``neuroshard up --secure``: certs and tokens generated into the data dir, and a memory
    job submitted with the settings of its ``client.env`` succeeds."""
    import os
    import subprocess

    from tests.integration.cli_helpers import processes_mentioning

    # Arrange
    data_dir = tmp_path / "up"
    proc = subprocess.Popen(
        [*CLI, "up", "--workers", "1", "--port", "0", "--data-dir", str(data_dir), "--secure"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    job = tmp_path / "memory.yaml"
    spec = {"kind": "memory", "memories": 5000, "iterations": 2, "access": {"batch": 1000}}
    job.write_text(yaml.safe_dump(spec))
    try:
        assert proc.stdout is not None and proc.stderr is not None
        address = proc.stdout.readline().strip()
        assert address, proc.stderr.read()
        lines = (data_dir / "client.env").read_text().splitlines()
        env = dict(line.removeprefix("export ").split("=", 1) for line in lines)

        # Act
        result = subprocess.run(
            [*CLI, "submit", str(job), "--follow", "--json"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=180,
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
        )
    finally:
        proc.send_signal(2)
        proc.wait(timeout=30)

    # Assert
    assert env["NEUROSHARD_COORDINATOR"] == address
    assert result.returncode == 0, result.stderr
    assert '"state": "SUCCEEDED"' in result.stdout
    assert (data_dir / "certs" / "ca.crt").is_file() and (data_dir / "auth" / "secret").is_file()
    assert processes_mentioning(str(data_dir)) == []
