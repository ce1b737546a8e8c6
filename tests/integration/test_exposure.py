"""Refusing to be open by accident: no daemon serves beyond loopback without TLS and auth
unless told ``--insecure``; the probe port serves health checks and nothing else."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from coordinator.server import CoordinatorServer
from shared.config import CoordinatorConfig
from shared.proto import coordinator_pb2, coordinator_pb2_grpc
from shared.security.exposure import ExposureRefused, check_listen, is_loopback
from tests.integration.cli_helpers import run_cli

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("localhost", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("[::]", False),
        ("10.0.0.7", False),
        ("neuroshard-0.neuroshard", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_open_listen_needs_both_tls_and_auth() -> None:
    check_listen("coordinator", "127.0.0.1:50051", tls=False, auth=False, insecure=False)
    check_listen("coordinator", "0.0.0.0:50051", tls=True, auth=True, insecure=False)
    for tls, auth, missing in [(False, False, "tls and auth"), (True, False, "auth")]:
        with pytest.raises(ExposureRefused, match=f"has no {missing}; configure tls and auth"):
            check_listen("worker", "0.0.0.0:0", tls=tls, auth=auth, insecure=False)


@pytest.mark.parametrize("daemon", ["coordinator", "worker"])
def test_daemon_refuses_to_listen_openly_and_creates_nothing(daemon: str, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"

    run = run_cli(daemon, "--listen", "0.0.0.0:0", "--data-dir", str(data_dir), timeout=60)

    assert run.returncode == 2, run.stderr
    assert "listen: 0.0.0.0:0 is reachable from other machines" in run.stderr
    assert "--insecure" in run.stderr
    assert not data_dir.exists()


async def test_insecure_serves_and_warns_at_start(tmp_path: Path) -> None:
    cfg = CoordinatorConfig(
        listen="0.0.0.0:0", insecure=True, data_dir=str(tmp_path), metrics_port=None
    )

    with capture_logs() as logs:
        server = CoordinatorServer(cfg)
        await server.start()
    try:
        warnings = [e for e in logs if e["event"] == "insecure_listen"]
        assert warnings and warnings[0]["log_level"] == "warning"
        assert warnings[0]["missing"] == "tls and auth"
    finally:
        await server.stop()


async def test_probe_port_serves_health_only(tmp_path: Path) -> None:
    cfg = CoordinatorConfig(
        listen="127.0.0.1:0", probe_port=0, data_dir=str(tmp_path), metrics_port=None
    )
    server = CoordinatorServer(cfg)
    await server.start()
    try:
        assert server.rpc.probe_port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.rpc.probe_port}") as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await coordinator_pb2_grpc.CoordinatorStub(ch).ListJobs(
                    coordinator_pb2.ListJobsRequest(), timeout=5
                )

        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop()
