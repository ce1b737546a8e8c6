"""Server reflection on both daemons: what grpcurl, Postman and Evans ask, over grpc.aio.

The reflection stream is driven raw (``ServerReflectionInfo``): grpcio-reflection's
``ProtoReflectionDescriptorDatabase`` takes a blocking channel, which would stall the event
loop that serves these in-process servers.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shared.rpc import channel
from shared.security.tokens import AUD_DATA
from shared.security.transport import ChannelSecurity
from tests.conftest import wait_until
from tests.integration.security_helpers import Material

pytestmark = pytest.mark.integration

REFLECTION = "grpc.reflection.v1alpha.ServerReflection"
HEALTH = "grpc.health.v1.Health"


async def _reflect(
    address: str, requests: list[reflection_pb2.ServerReflectionRequest], security=None
) -> list[reflection_pb2.ServerReflectionResponse]:
    """Send ``requests`` on one ServerReflectionInfo stream (5 s); the responses in order."""
    async with channel(address, security=security) as ch:
        call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter(requests), timeout=5
        )
        return [r async for r in call]


def _list() -> reflection_pb2.ServerReflectionRequest:
    return reflection_pb2.ServerReflectionRequest(list_services="")


async def _services(address: str, security: ChannelSecurity | None = None) -> set[str]:
    (reply,) = await _reflect(address, [_list()], security)
    return {s.name for s in reply.list_services_response.service}


async def _methods_of(address: str, service: str) -> list[str]:
    """Fetch the file that defines ``service`` by symbol; the methods it declares."""
    ask = reflection_pb2.ServerReflectionRequest(file_containing_symbol=service)
    (reply,) = await _reflect(address, [ask])
    assert not reply.HasField("error_response"), reply.error_response.error_message
    package, _, name = service.rpartition(".")
    for blob in reply.file_descriptor_response.file_descriptor_proto:
        fd = descriptor_pb2.FileDescriptorProto.FromString(blob)
        for svc in fd.service:
            if fd.package == package and svc.name == name:
                return [m.name for m in svc.method]
    raise AssertionError(f"no descriptor of {service} in the reply")


async def test_both_daemons_list_their_services_and_describe_them(make_cluster) -> None:
    # Arrange: plaintext on loopback, no auth
    cluster = await make_cluster(workers=1)
    worker = cluster.workers[0]

    # Act
    coordinator_services = await _services(cluster.address)
    worker_services = await _services(worker.address)
    coordinator_methods = await _methods_of(cluster.address, "neuroshard.v1.Coordinator")
    worker_methods = await _methods_of(worker.address, "neuroshard.v1.Worker")

    # Assert
    assert coordinator_services == {"neuroshard.v1.Coordinator", HEALTH, REFLECTION}
    assert worker_services == {"neuroshard.v1.Worker", HEALTH, REFLECTION}
    assert {"SubmitJob", "GetClusterStatus", "WatchJob"} <= set(coordinator_methods)
    assert {"Upsert", "Get", "Replicate"} <= set(worker_methods)
    # counted like any RPC (health checks are not)
    counted = cluster.coordinator.metrics.rpcs.labels("ServerReflectionInfo", "OK")
    await wait_until(lambda: counted._value.get() == 2, what="two reflection calls counted")


async def test_an_unknown_symbol_is_an_error_response(make_cluster) -> None:
    cluster = await make_cluster(workers=0)
    ask = reflection_pb2.ServerReflectionRequest(file_containing_symbol="neuroshard.v1.Nope")

    (reply,) = await _reflect(cluster.address, [ask])

    assert reply.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


@pytest.mark.parametrize("daemon", ["coordinator", "worker"])
async def test_with_auth_on_reflection_needs_a_persons_token_for_that_daemon(
    secure, material: Material, daemon: str
) -> None:
    # Arrange
    cluster = await secure(workers=1)
    address = cluster.address if daemon == "coordinator" else cluster.workers[0].address
    outcomes: dict[str, grpc.StatusCode] = {}
    services: set[str] = set()

    # Act
    for case, security in [
        ("no token", material.client(None)),
        ("worker certificate", material.daemon_client("worker-0")),
        ("coordinator certificate", material.daemon_client()),
        ("reader", material.client(material.token("reader"))),
        ("data-plane reader", material.client(material.token("reader", audience=AUD_DATA))),
    ]:
        try:
            got = await asyncio.wait_for(_services(address, security), 10)
        except grpc.aio.AioRpcError as exc:
            outcomes[case] = exc.code()
        else:
            outcomes[case], services = grpc.StatusCode.OK, got

    # Assert: daemons never reflect; a person's token of the daemon's audience does (a
    # coordinator token on the coordinator, a data-plane token on a worker).
    if daemon == "coordinator":
        assert outcomes == {
            "no token": grpc.StatusCode.UNAUTHENTICATED,
            "worker certificate": grpc.StatusCode.PERMISSION_DENIED,
            "coordinator certificate": grpc.StatusCode.PERMISSION_DENIED,
            "reader": grpc.StatusCode.OK,
            "data-plane reader": grpc.StatusCode.UNAUTHENTICATED,  # not for this daemon
        }
        assert "neuroshard.v1.Coordinator" in services
    else:
        assert outcomes == {
            "no token": grpc.StatusCode.UNAUTHENTICATED,
            "worker certificate": grpc.StatusCode.PERMISSION_DENIED,
            "coordinator certificate": grpc.StatusCode.PERMISSION_DENIED,
            "reader": grpc.StatusCode.UNAUTHENTICATED,  # a coordinator token: not for a worker
            "data-plane reader": grpc.StatusCode.OK,
        }
        assert "neuroshard.v1.Worker" in services
