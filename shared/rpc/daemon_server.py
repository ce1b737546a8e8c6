"""A daemon's gRPC server, built, bound, served and stopped the same way by both daemons.

Each daemon serves its one proto service beside the standard health service
(``grpc.health.v1``) and server reflection, behind its interceptor chain
(``shared.rpc.interceptors.server_interceptors``) and message and stream limits
(``shared.rpc.limits.server_options``), on one port bound with mutual TLS or in plaintext
(``DaemonSecurity.add_port``), and optionally a plaintext probe port that serves health alone
(``shared.security.exposure.start_probe_server``). What differs between the daemons (their
servicer, interceptor arguments, background tasks, what they close) stays in their
``server.py``.

Lifecycle, as in grpc's ``examples/python`` and uvicorn's servers::

    rpc = DaemonServer(SERVICE, servicer, add_XServicer_to_server, security, ...)
    port = await rpc.start("127.0.0.1:0", probe_port=None)   # the port bound
    await rpc.set_serving(True)                              # once the daemon is ready
    ...
    await rpc.begin_stop()   # health NOT_SERVING for good; RPCs are still served
    await rpc.stop(grace_s)  # drain RPCs for grace_s, close the probe port
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared.rpc.limits import server_options
from shared.rpc.reflection import enable_reflection
from shared.security.exposure import start_probe_server
from shared.security.transport import DaemonSecurity

S = TypeVar("S")

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class DaemonServer:
    """One daemon's ``grpc.aio`` server: its service, health and reflection, its ports.

    Attributes:
        service: the daemon's proto service, e.g. ``neuroshard.v1.Worker``.
        server: the ``grpc.aio`` server (tests stop it abruptly to simulate a crash).
        health: the health servicer, on the main port and the probe port alike.
        port: the main port bound by ``start`` (0 before).
        probe_port: the probe port bound by ``start``; None without one.
    """

    def __init__(
        self,
        service: str,
        servicer: S,
        add_to_server: Callable[[S, aio.Server], None],
        security: DaemonSecurity,
        *,
        interceptors: Sequence[aio.ServerInterceptor],
        max_message_bytes: int,
        max_concurrent_streams: int,
    ) -> None:
        """Build the server with ``servicer``, health and reflection; nothing listens yet.

        Health answers SERVING for the whole server (the empty service name, grpc's default)
        and NOT_FOUND for ``service`` until ``set_serving``.

        Args:
            service: the full name of the service ``servicer`` implements.
            servicer: the daemon's servicer of ``service``.
            add_to_server: the generated ``add_<Service>Servicer_to_server``.
            security: the daemon's security: how ``start`` binds (mutual TLS or plaintext).
            interceptors: the daemon's chain, outermost first (``server_interceptors``).
            max_message_bytes: the largest message received or sent, bytes; larger ones are
                RESOURCE_EXHAUSTED.
            max_concurrent_streams: concurrent RPCs per client connection; more wait.
        """
        self.service = service
        self._security = security
        self.health = health.aio.HealthServicer()
        self.server = aio.server(
            interceptors=list(interceptors),
            options=server_options(max_message_bytes, max_concurrent_streams),
        )
        add_to_server(servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # grpcurl, Postman, Evans: services and descriptors without the .proto files
        enable_reflection(self.server, service)
        self.port = 0
        self.probe_port: int | None = None
        self._probe_server: aio.Server | None = None

    async def start(self, listen: str, probe_port: int | None = None) -> int:
        """Bind ``listen`` and serve; with ``probe_port``, serve health alone there too.

        The probe port is bound on ``listen``'s host, in plaintext (Kubernetes' gRPC probes
        cannot present a client certificate).

        Args:
            listen: ``host:port``; port 0 picks a free one.
            probe_port: the probe port; 0 picks a free one; None serves none.

        Returns:
            The main port bound (``port``).

        Raises:
            RuntimeError: gRPC could not bind ``listen`` or the probe port ("Failed to bind").
        """
        self.port = self._security.add_port(self.server, listen)
        await self.server.start()
        if probe_port is not None:
            host, _, _ = listen.rpartition(":")
            self._probe_server, self.probe_port = await start_probe_server(
                self.health, host, probe_port
            )
        return self.port

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING for the server and its service, on every port.

        No effect after ``begin_stop``: a stopping daemon stays NOT_SERVING.
        """
        for name in ("", self.service):
            await self.health.set(name, _SERVING if serving else _NOT_SERVING)

    async def begin_stop(self) -> None:
        """Report NOT_SERVING for good, so probes and clients go elsewhere; RPCs still run."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace_s: float) -> None:
        """Stop: health NOT_SERVING, new RPCs refused, running ones drained, probe port closed.

        Args:
            grace_s: seconds running RPCs get to finish before they are cancelled.
        """
        await self.begin_stop()
        await self.server.stop(grace_s)
        if self._probe_server is not None:
            await self._probe_server.stop(0)
            self._probe_server = None
