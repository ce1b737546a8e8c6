"""Fixtures of the integration tests: a real ``neuroshard up`` cluster in a subprocess (CLI
tests), and security material with secure in-process clusters (security tests)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from grpc import aio
from grpc_health.v1 import health, health_pb2_grpc

from tests.integration.cli_helpers import CLI, REPO, processes_mentioning
from tests.integration.security_helpers import Material


@pytest.fixture(scope="module")
def up_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """``neuroshard up --workers 3 --port 0``, one per test module: yields (address, data dir).

    Stopped with SIGINT on teardown; fails if a daemon outlives it.
    """
    data_dir = tmp_path_factory.mktemp("up")
    proc = subprocess.Popen(
        [*CLI, "up", "--workers", "3", "--port", "0", "--data-dir", str(data_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()  # printed once every worker is ALIVE
        assert address, "neuroshard up exited before printing its address"
        yield address, data_dir
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)  # waits, and closes the pipe
    deadline = time.monotonic() + 10
    while processes_mentioning(str(data_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(str(data_dir)) == [], "up left daemons running"


@pytest.fixture
def material(tmp_path: Path) -> Material:
    """Certificates and an Ed25519 token key pair for one test (``security_helpers``)."""
    return Material.make(tmp_path / "security")


@pytest.fixture
async def secure(make_cluster, material: Material):
    """Factory of in-process clusters with mutual TLS and tokens on every daemon: each daemon
    has its own certificate naming it; people's tokens are checked by the public key."""

    async def make(workers: int = 0, **overrides: object):
        coordinator: dict[str, object] = {"tls": material.tls, "auth": material.coordinator_auth}
        return await make_cluster(
            workers=workers,
            worker_overrides={"auth": material.worker_auth},
            per_worker=lambda name: {"tls": material.worker_tls(name)},
            **(coordinator | overrides),
        )

    return make


@pytest.fixture
async def health_server() -> AsyncIterator[int]:
    """A grpc.aio server with only the health service, on port 0; yields its port."""
    server = aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield port
    await server.stop(None)
