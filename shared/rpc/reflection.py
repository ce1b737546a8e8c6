"""gRPC server reflection on a daemon's server, so standard tools need no .proto files.

grpcurl, Postman and Evans ask the ``grpc.reflection.v1alpha.ServerReflection`` service for
the services a server offers and for their file descriptors, then build requests from them
(https://github.com/grpc/grpc/blob/master/doc/server-reflection.md). Reflection is an RPC
like the others: with auth on it needs a ``reader``, ``writer`` or ``admin`` token
(``shared.security.auth.may_call``); only the health service is open to all.
"""

from __future__ import annotations

from grpc import aio
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_SERVICE: str = reflection.SERVICE_NAME


def enable_reflection(server: aio.Server, service: str) -> tuple[str, ...]:
    """Add the reflection service to ``server``, listing ``service``, health and itself.

    The descriptors come from protobuf's default pool, where importing the generated
    ``*_pb2`` modules registered them.

    Args:
        server: the daemon's server, before ``start()``.
        service: the daemon's own service, e.g. ``neuroshard.v1.Coordinator``.

    Returns:
        The full names of the services reflection lists.
    """
    names = (service, HEALTH_SERVICE, REFLECTION_SERVICE)
    reflection.enable_server_reflection(names, server)
    return names
