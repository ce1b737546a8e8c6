"""Emulated links end to end: gRPC through the proxy, ``neuroshard link``, ``up --links``."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared.net.link_proxy import LinkProxy, LinkSettings
from tests.integration.cli_helpers import CLI, REPO

pytestmark = pytest.mark.integration


@pytest.fixture
async def health_server() -> AsyncIterator[int]:
    """A grpc.aio server with only the health service, on port 0; yields its port."""
    server = aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield port
    await server.stop(None)


async def test_grpc_health_check_through_a_slow_link(health_server: int) -> None:
    proxy = LinkProxy(
        "127.0.0.1", 0, "127.0.0.1", health_server, LinkSettings(latency_ms=10, jitter_ms=2)
    )
    port = await proxy.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)  # connects
            start = time.perf_counter()
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            elapsed_ms = (time.perf_counter() - start) * 1e3
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert elapsed_ms >= 2 * (10 - 2)  # one round trip through the link at least
        assert proxy.counters.connections == 1 and proxy.counters.bytes_to_client > 0
    finally:
        await proxy.stop()


async def test_grpc_sees_unavailable_when_the_link_resets(health_server: int) -> None:
    proxy = LinkProxy(
        "127.0.0.1", 0, "127.0.0.1", health_server, LinkSettings(reset_every_mb=0.001)
    )
    port = await proxy.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(aio.AioRpcError) as err:
                for _ in range(50):  # ~100 bytes per check, plus the HTTP/2 preface
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert proxy.counters.resets >= 1
    finally:
        await proxy.stop()


async def test_link_command_prints_its_port_relays_and_stops_on_sigterm(
    health_server: int,
) -> None:
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        *["link", "--listen", "127.0.0.1:0", "--target", f"127.0.0.1:{health_server}"],
        *["--latency-ms", "5", "--bandwidth-mbit", "100"],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        address = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
        host, _, port = address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
        async with aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, stderr
    assert b'"event": "link_stopped"' in stderr and b'"connections": 1' in stderr
