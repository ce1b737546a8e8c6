"""Refuse to be open by accident, and serve Kubernetes probes beside a TLS-only port.

A daemon serves gRPC beyond loopback only with mutual TLS and tokens, or when the operator
says ``insecure`` (and then it warns at every start). The probe listener serves only the
health service, in plaintext, because Kubernetes' gRPC probes cannot present a client
certificate.
"""

from __future__ import annotations

import ipaddress

from grpc import aio
from grpc_health.v1 import health, health_pb2_grpc

from shared.config import ConfigError
from shared.logging import get_logger

log = get_logger(__name__)


_REMEDY = (
    "configure tls and auth (README: Security), listen on 127.0.0.1, or start with --insecure "
    "to accept the risk"
)
_HINT = "anyone who reaches this port can use the cluster without credentials"


class ExposureRefused(ConfigError):
    """A daemon would listen beyond loopback without TLS and auth (the process exits 2)."""


def is_wildcard(host: str) -> bool:
    """Tell whether ``host`` (IPv6 brackets allowed) is a wildcard bind: every interface.

    ``0.0.0.0``, ``::`` and the empty host are; the listen rule (``check_listen``) decides
    whether a daemon may bind one.
    """
    return host.strip("[]") in ("0.0.0.0", "::", "")


def local_host(host: str) -> str:
    """The host this machine's processes dial for a bind on ``host``: 127.0.0.1 for a wildcard."""
    return "127.0.0.1" if is_wildcard(host) else host


def is_loopback(host: str) -> bool:
    """Tell whether ``host`` (as in HOST:PORT, IPv6 brackets allowed) only reaches this machine.

    ``localhost`` and loopback addresses (127.0.0.0/8, ::1) do; any other name may resolve
    to anything, so it does not.
    """
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost may resolve to anything
        return False


def check_listen(
    daemon: str,
    listen: str,
    tls: bool,
    auth: bool,
    insecure: bool,
    field: str = "listen",
    *,
    remedy: str = _REMEDY,
    hint: str = _HINT,
) -> None:
    """Refuse (or, with ``insecure``, warn about) serving beyond loopback unprotected.

    The one listen rule of every process that accepts connections: the daemons, their
    dashboard and ``neuroshard link`` (which has neither TLS nor auth, so only loopback or
    ``--insecure`` pass).

    Args:
        daemon: ``coordinator``, ``worker``, ``link``..., for the message and the log.
        listen: the HOST:PORT the process binds.
        tls: whether mutual TLS is configured.
        auth: whether tokens are required.
        insecure: the operator's ``insecure`` setting (``--insecure``).
        field: the config key or flag, for the message.
        remedy: what the refusal tells the operator to do, after the rule broken.
        hint: the warning's ``hint`` when ``insecure`` lets it listen.

    Raises:
        ExposureRefused: non-loopback host without both TLS and auth, and not insecure
            (a ``ConfigError``: the process exits 2).
    """
    host = listen.rpartition(":")[0]
    if is_loopback(host) or (tls and auth):
        return
    missing = " and ".join(name for name, on in (("tls", tls), ("auth", auth)) if not on)
    if not insecure:
        raise ExposureRefused(
            f"{field}: {listen} is reachable from other machines but the {daemon} has no "
            f"{missing}; {remedy}"
        )
    log.warning("insecure_listen", daemon=daemon, listen=listen, missing=missing, hint=hint)


async def start_probe_server(
    servicer: health.aio.HealthServicer, host: str, port: int
) -> tuple[aio.Server, int]:
    """Serve only ``grpc.health.v1`` on a plaintext port (Kubernetes gRPC probes).

    Args:
        servicer: the daemon's health servicer (the same statuses as on the main port).
        host: the bind host (the daemon's listen host).
        port: the port to bind; 0 picks a free one.

    Returns:
        The started server and the port bound.
    """
    server = aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound
