"""Mutual TLS, token roles and limits against real servers on port 0 with generated certs."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import pytest
import structlog
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from shared.client import Client, NeuroshardError
from shared.config import ConfigError
from shared.proto import coordinator_pb2, coordinator_pb2_grpc, worker_pb2, worker_pb2_grpc
from shared.rpc import channel
from shared.rpc.codec import f32_to_bytes, ids_to_bytes
from shared.security.certs import write_dev_certs
from shared.security.tokens import AUD_DATA, TokenSource
from shared.security.transport import ChannelSecurity, TlsFiles
from tests.conftest import wait_until
from tests.integration.cli_helpers import CLI, REPO
from tests.integration.security_helpers import (
    FORGED_MESSAGES,
    Material,
    coordinator_state,
    forged_tokens,
    worker_state,
)

pytestmark = pytest.mark.integration

DIGITS_MLP = REPO / "configs/jobs/digits-mlp.yaml"


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
        *[("forged: " + kind, "UNAUTHENTICATED", text) for kind, text in FORGED_MESSAGES.items()],
        ("data-plane token", "UNAUTHENTICATED", "token is not for this daemon"),
        ("right role", "OK", ""),
    ],
)
async def test_each_auth_outcome(secure, material: Material, case, code, message) -> None:
    # Arrange
    cluster = await secure()
    tokens = {"forged: " + kind: t for kind, t in forged_tokens(material).items()}
    tokens |= {
        "no token": None,
        "data-plane token": material.token("writer", audience=AUD_DATA),
        "right role": material.token("reader"),
    }

    # Act
    got_code, got_message = await _status_code(cluster.address, material.client(tokens[case]))

    # Assert
    assert got_code == code
    assert got_message.startswith(message)
    counted = cluster.coordinator.metrics.rpcs.labels("GetClusterStatus", code)
    # abort() sends the status before the server's interceptor counts it: poll
    await wait_until(lambda: counted._value.get() == 1, what=f"one {code} counted")


@pytest.mark.parametrize("kind", sorted(FORGED_MESSAGES))
async def test_a_forged_admin_token_changes_nothing(secure, material: Material, kind) -> None:
    # Arrange: a settled cluster of one worker
    cluster = await secure(workers=1)
    async with Client(cluster.address, security=material.client(material.token("admin"))) as c:
        await c.wait_ready()
    worker = cluster.workers[0]
    before = coordinator_state(cluster), worker_state(worker)
    forged = material.client(forged_tokens(material)[kind])

    # Act: a job, a write to the store, a worker registration, a drain
    async with channel(cluster.address, security=forged) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        results = [
            await _rpc(stub.SubmitJob(coordinator_pb2.SubmitJobRequest(spec_json="{}"))),
            await _rpc(
                stub.RegisterWorker(
                    coordinator_pb2.RegisterWorkerRequest(name="evil", address="127.0.0.1:1")
                )
            ),
            await _rpc(stub.DrainWorker(coordinator_pb2.DrainWorkerRequest(name="worker-0"))),
        ]
    async with channel(worker.address, security=forged) as ch:
        upsert = worker_pb2.UpsertRequest(
            epoch=before[1][0], ids=ids_to_bytes([1]), strengths=f32_to_bytes([1.0])
        )
        results.append(await _rpc(worker_pb2_grpc.WorkerStub(ch).Upsert(upsert)))

    # Assert
    for code, details in results:
        assert code is grpc.StatusCode.UNAUTHENTICATED
        assert details.startswith(FORGED_MESSAGES[kind])
    assert (coordinator_state(cluster), worker_state(worker)) == before


async def _rpc(call) -> tuple[grpc.StatusCode, str]:
    """Await an RPC (5 s); its status code and details (OK, "" on success)."""
    try:
        await asyncio.wait_for(call, 5)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


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
    token = TokenSource(material.token("reader"))
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


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("another worker's certificate", "names worker 'worker-0', not worker 'intruder'"),
        ("the coordinator's certificate", "names coordinator 'coordinator', not worker"),
        ("a client certificate", "names no daemon, not worker 'intruder'"),
        ("a worker token file", "token_file: daemons present no tokens"),
        ("the private key", "auth.private_key_file: a worker must not hold the private key"),
        ("auth without tls", "auth: needs tls"),
    ],
)
async def test_a_worker_without_its_own_certificate_does_not_start(
    secure, material: Material, case: str, message: str
) -> None:
    # Arrange
    cluster = await secure()
    c = material.certs
    worker0 = material.worker_tls("worker-0")
    tls = {
        "another worker's certificate": worker0,
        "the coordinator's certificate": material.tls,
        "a client certificate": worker0.model_copy(
            update={"cert_file": str(c.client_cert), "key_file": str(c.client_key)}
        ),
    }
    overrides: dict[str, object] = {"tls": tls.get(case, material.worker_tls("intruder"))}
    if case == "a worker token file":
        overrides["auth"] = {**material.worker_auth.model_dump(), "token_file": "/dev/null"}
    elif case == "the private key":
        overrides["auth"] = material.coordinator_auth
    elif case == "auth without tls":
        overrides["tls"] = None

    # Act
    with pytest.raises((ConfigError, ValueError)) as info:
        await cluster.add_worker("intruder", **overrides)

    # Assert: refused before serving or registering anything
    assert message in str(info.value)
    admin = material.client(material.token("admin"))
    async with Client(cluster.address, security=admin) as client:
        assert (await client.status())["workers"] == []


async def test_request_logs_carry_method_caller_worker_and_job(secure, material: Material) -> None:
    # Arrange: debug logs captured with the context variables the interceptor binds
    wrapper = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
            # Act
            cluster = await secure(workers=1)
            security = material.client(material.token("writer", "alice"))
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
    assert (get["subject"], get["role"], get["status"]) == ("alice", "writer", "OK")
    assert get["job_id"] == job.job_id and get["peer"].startswith("ipv4:127.0.0.1:")
    assert get["duration_ms"] >= 0
    pushed = next(e for e in served if e["method"] == "ApplySlotMap")
    assert (pushed["worker"], pushed["subject"], pushed["role"]) == (
        "worker-0",
        "coordinator",
        "coordinator",
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
        cluster.address, security=material.client(material.token("writer"))
    ) as client:
        job = await client.submit(spec)
        final = await client.wait(job.job_id)

    # Assert
    assert final.state == "SUCCEEDED", final.error
    assert final.result["test_accuracy"] >= 0.95
    assert set(final.result["workers"]) == {"worker-0", "worker-1", "worker-2"}


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.mark.slow
def test_up_secure_runs_a_memory_job(tmp_path: Path) -> None:
    """``neuroshard up --secure``: certs, key pair and tokens generated into the data dir;
    a memory job submitted with the settings of its ``client.env`` (a writer token)
    succeeds, the same token may not decay the whole store, and no worker is given the
    private key (nor any token: it is known by its own certificate)."""
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
        worker_cmdlines = [_cmdline(p) for p in processes_mentioning(str(data_dir / "worker-0"))]

        # Act
        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*CLI, *args],
                capture_output=True,
                text=True,
                cwd=REPO,
                timeout=180,
                env={**os.environ, **env},
                stdin=subprocess.DEVNULL,
            )

        result = run("submit", str(job), "--follow", "--json")
        decay = run("memory", "decay", "0.5")
    finally:
        proc.send_signal(2)
        proc.communicate(timeout=30)  # waits, and closes the pipes

    # Assert
    assert env["NEUROSHARD_COORDINATOR"] == address
    assert env["NEUROSHARD_TOKEN_FILE"] == str(data_dir / "auth" / "writer.token")
    assert result.returncode == 0, result.stderr
    assert '"state": "SUCCEEDED"' in result.stdout
    assert decay.returncode == 1
    assert "writer 'local-writer' may not call Decay" in decay.stderr
    auth = data_dir / "auth"
    assert (data_dir / "certs" / "ca.crt").is_file() and (auth / "public.pem").is_file()
    assert (auth / "private.pem").stat().st_mode & 0o777 == 0o600
    assert len(worker_cmdlines) == 1
    assert str(data_dir / "certs" / "workers" / "worker-0.crt") in worker_cmdlines[0]
    assert "private.pem" not in worker_cmdlines[0] and ".token" not in worker_cmdlines[0]
    assert processes_mentioning(str(data_dir)) == []


@pytest.mark.slow
def test_demo_secure_runs_a_job(tmp_path: Path) -> None:
    """``neuroshard demo --secure``: a local cluster with mutual TLS and tokens runs a job."""
    import subprocess

    # Arrange
    job = tmp_path / "memory.yaml"
    spec = {"kind": "memory", "memories": 2000, "iterations": 2, "access": {"batch": 500}}
    job.write_text(yaml.safe_dump(spec))

    # Act
    result = subprocess.run(
        [*CLI, "demo", "--secure", "--workers", "2", "--job", str(job), "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )

    # Assert
    assert result.returncode == 0, result.stderr[-3000:]
    assert '"state": "SUCCEEDED"' in result.stdout


async def test_a_stream_ends_when_its_token_expires(secure, material: Material) -> None:
    # Arrange: a job that stays QUEUED (9 workers never come), watched with a 2 s token
    cluster = await secure(workers=0)
    async with Client(cluster.address, security=material.client(material.token("writer"))) as w:
        job = await w.submit({"kind": "train", "workers": 9, "steps": 1})
    short = material.client(material.token("writer", ttl_s=2))
    started = asyncio.get_running_loop().time()

    # Act: the watch would last until the job ends (its queue timeout, 60 s)
    async with channel(cluster.address, security=short) as ch:
        stream = coordinator_pb2_grpc.CoordinatorStub(ch).WatchJob(
            coordinator_pb2.JobRequest(job_id=job.job_id), timeout=30
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stream:
                pass
    ended_after_s = asyncio.get_running_loop().time() - started

    # Assert: ended by the token's expiry, not by the deadline or the job
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert info.value.details().endswith(": stream ended")
    assert ended_after_s < 10


async def test_a_revoked_token_is_refused(secure, material: Material, tmp_path: Path) -> None:
    # Arrange: a coordinator watching a revocation list; a reader's token that works
    revoked = tmp_path / "revoked.txt"
    auth = material.coordinator_auth.model_copy(update={"revoked_file": str(revoked)})
    cluster = await secure(workers=0, auth=auth)
    token = material.token("reader", "rory")
    assert await _status_code(cluster.address, material.client(token)) == ("OK", "")

    # Act: the operator revokes it with the CLI
    proc = await asyncio.create_subprocess_exec(
        *CLI, "token", "revoke", token, "--file", str(revoked), cwd=REPO
    )
    assert await asyncio.wait_for(proc.wait(), 60) == 0

    # Assert: refused within the list's re-read interval (1 s); another token still works
    async def refused() -> bool:
        code, _ = await _status_code(cluster.address, material.client(token))
        return code == "UNAUTHENTICATED"

    await wait_until(refused, timeout_s=10, what="the revoked token refused")
    code, message = await _status_code(cluster.address, material.client(token))
    assert "is revoked" in message
    other = material.client(material.token("reader", "rory"))
    assert await _status_code(cluster.address, other) == ("OK", "")


def test_token_lifetimes_are_capped_per_role(material: Material) -> None:
    with pytest.raises(ValueError, match="ttl: at most 604800 s for a admin token"):
        material.token("admin", ttl_s=8 * 86400)
