"""``DaemonServer``, the one gRPC server builder of both daemons, with a trivial servicer.

What each daemon relies on: the port bound for port 0, its servicer behind its interceptors
and message limit, health (SERVING once set, NOT_SERVING for good from ``begin_stop``),
reflection, the plaintext probe port, mutual TLS, and nothing left listening after ``stop``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shared.proto import coordinator_pb2, coordinator_pb2_grpc
from shared.rpc import channel
from shared.rpc.daemon_server import DaemonServer
from shared.rpc.reflection import HEALTH_SERVICE, REFLECTION_SERVICE
from shared.security.transport import ChannelSecurity, DaemonSecurity
from tests.conftest import wait_until
from tests.integration.security_helpers import Material

pytestmark = pytest.mark.integration

SERVICE = "neuroshard.v1.Coordinator"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
MAX_MESSAGE_BYTES = 4096


class OneRpc(coordinator_pb2_grpc.CoordinatorServicer):
    """Answers ListJobs with no jobs; every other RPC is UNIMPLEMENTED."""

    async def ListJobs(
        self, request: coordinator_pb2.ListJobsRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.ListJobsResponse:
        return coordinator_pb2.ListJobsResponse()


class Recorder(aio.ServerInterceptor):
    """Records the method of every call it sees."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        self.methods.append(details.method)
        return await continuation(details)


def plaintext() -> DaemonSecurity:
    return DaemonSecurity(tls=None, public_key=None, channel=ChannelSecurity(None))


def build(security: DaemonSecurity, *interceptors: aio.ServerInterceptor) -> DaemonServer:
    return DaemonServer(
        SERVICE,
        OneRpc(),
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server,
        security,
        interceptors=interceptors,
        max_message_bytes=MAX_MESSAGE_BYTES,
        max_concurrent_streams=16,
    )


@pytest.fixture
async def started() -> AsyncIterator[Callable[..., Any]]:
    """Factory: ``await started(server, probe_port=None)`` starts it; stopped on teardown."""
    servers: list[DaemonServer] = []

    async def start(server: DaemonServer, probe_port: int | None = None) -> int:
        servers.append(server)
        return await server.start("127.0.0.1:0", probe_port)

    yield start
    for server in servers:
        await server.stop(0)


async def check(port: int, service: str = "", security: ChannelSecurity | None = None) -> Any:
    """The health status of ``service`` on ``port``, or the call's status code if refused."""
    async with channel(f"127.0.0.1:{port}", security=security) as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return reply.status


async def refuses_connections(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    writer.close()
    await writer.wait_closed()
    return False


async def test_port_zero_binds_a_free_port_and_serves_the_servicer_behind_its_chain(
    started,
) -> None:
    # Arrange
    recorder = Recorder()
    server = build(plaintext(), recorder)

    # Act
    port = await started(server)
    async with channel(f"127.0.0.1:{port}") as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        reply = await stub.ListJobs(coordinator_pb2.ListJobsRequest(), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as too_big:
            await stub.SubmitJob(
                coordinator_pb2.SubmitJobRequest(spec_json="x" * 2 * MAX_MESSAGE_BYTES), timeout=5
            )
        call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        (listed,) = [r async for r in call]

    # Assert
    assert port > 0 and port == server.port
    assert reply == coordinator_pb2.ListJobsResponse()
    assert "/neuroshard.v1.Coordinator/ListJobs" in recorder.methods
    assert too_big.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert {s.name for s in listed.list_services_response.service} == {
        SERVICE,
        HEALTH_SERVICE,
        REFLECTION_SERVICE,
    }
    assert server.probe_port is None


async def test_health_follows_set_serving_until_begin_stop(started) -> None:
    # Arrange
    server = build(plaintext())
    port = await started(server)

    # Act
    before = (await check(port), await check(port, SERVICE))
    await server.set_serving(True)
    serving = (await check(port), await check(port, SERVICE))
    await server.set_serving(False)
    failed = (await check(port), await check(port, SERVICE))
    await server.set_serving(True)
    await server.begin_stop()
    await server.set_serving(True)  # too late: a stopping daemon stays NOT_SERVING
    stopping = (await check(port), await check(port, SERVICE))

    # Assert
    assert before == (SERVING, grpc.StatusCode.NOT_FOUND)
    assert serving == (SERVING, SERVING)
    assert failed == (NOT_SERVING, NOT_SERVING)
    assert stopping == (NOT_SERVING, NOT_SERVING)


async def test_the_probe_port_serves_health_alone_in_plaintext(started, material: Material) -> None:
    # Arrange: the main port is mutual TLS only
    security = DaemonSecurity.from_config(material.tls, None, "coordinator", coordinator=True)
    server = build(security)

    # Act
    port = await started(server, probe_port=0)
    await server.set_serving(True)
    over_tls = await check(port, SERVICE, material.daemon_client())
    plaintext_main = await check(port, SERVICE)
    probe = await check(server.probe_port, SERVICE)
    async with channel(f"127.0.0.1:{server.probe_port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await coordinator_pb2_grpc.CoordinatorStub(ch).ListJobs(
                coordinator_pb2.ListJobsRequest(), timeout=5
            )

    # Assert
    assert over_tls == SERVING
    assert plaintext_main == grpc.StatusCode.UNAVAILABLE
    assert server.probe_port and server.probe_port != port
    assert probe == SERVING
    assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED


async def test_stop_leaves_nothing_listening() -> None:
    # Arrange
    server = build(plaintext())
    port = await server.start("127.0.0.1:0", probe_port=0)
    probe_port = server.probe_port
    assert probe_port is not None
    await server.set_serving(True)
    assert await check(port) == SERVING and await check(probe_port) == SERVING
    assert not await refuses_connections(port)

    # Act
    await server.stop(0)

    # Assert
    await wait_until(lambda: refuses_connections(port), timeout_s=5, what="main port closed")
    await wait_until(lambda: refuses_connections(probe_port), timeout_s=5, what="probe closed")
