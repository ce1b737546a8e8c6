"""The coordinator's one health probe of a worker: ``grpc.health.v1`` Check on its channel.

Failure reports (``failure_detector``), readmission of a DEAD worker (``readmission``) and
the round-trip samples (``coordinator/network/link_probe.py``) all ask through this function,
so they agree on what "the worker answered" means: any reply, whatever its serving status,
within the timeout, through the coordinator's own channel to the worker (the one map pushes
and slot copies use, so a channel still in gRPC's reconnect backoff fails the probe too).
"""

from __future__ import annotations

from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared import rpc
from shared.rpc.peers import WorkerClients


async def probe_health(
    clients: WorkerClients, name: str, address: str, timeout_s: float
) -> str | None:
    """Health-check worker ``name`` at ``address``: None when it answered, else why not.

    Args:
        clients: the coordinator's channels to the workers (the probe uses ``name``'s).
        name: the worker.
        address: ``host:port`` to probe (a new address replaces the worker's channel).
        timeout_s: deadline of the check, seconds, connecting included.

    Returns:
        None when the worker answered (any status: it is reachable), else the failure in
        one line (``rpc.error_message``: the gRPC status and details, or the exception).
    """
    stub = health_pb2_grpc.HealthStub(clients.channel(name, address))
    try:
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except Exception as exc:  # any failure is "not reachable"; the caller decides what follows
        return rpc.error_message(exc)
    return None
