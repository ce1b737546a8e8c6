"""Roles, and what each may call: the policy ``rpc.interceptors.AuthInterceptor`` enforces.

Roles and what they may call (the gRPC health service is open to all, without a token):

- ``reader``: Coordinator GetJob, ListJobs, WatchJob, GetClusterStatus, GetSlotMap, Quality,
  TopK, ListDatasets, ExportMemories (``neuroshard memory export``), ReportFailure (a
  client's report of a worker it could not reach: the coordinator only probes that
  worker); Worker Get.
- ``writer``: what ``reader`` may, and Coordinator SubmitJob, CancelJob, PutDataset; Worker
  Upsert, Reinforce, Delete.
- ``admin``: everything, e.g. Coordinator Decay and Sweep of the whole store, DrainWorker of
  any worker, ForgetWorker. (``neuroshard memory import`` upserts through the workers: ``writer``.)
  The coordinator presents an ``admin`` token it signs itself (subject ``coordinator``).
- ``worker`` (a worker daemon): Coordinator RegisterWorker, Heartbeat, ReportFailure,
  DrainWorker and FetchShard, each only under a worker name its token covers (``BOUND_FIELDS``,
  ``Principal.may_act_as``); every Worker RPC (workers call each other's internal RPCs).

Server reflection (``grpc.reflection.v1alpha`` and ``v1`` ServerReflectionInfo, which grpcurl,
Postman and Evans use to list and describe the services) is a read RPC of ``reader``,
``writer`` and ``admin`` on both daemons. Not of ``worker``: daemons never need it, and a
worker token is not a person's. Unlike health checks it is not open to all: the schema is
the map of what the cluster can be asked.

People (readers and writers) see their own jobs only: ``may_see_job``.

The token is checked from the request's metadata before its message is deserialized: a
missing or invalid token (UNAUTHENTICATED) or a role that may not call the method
(PERMISSION_DENIED) gets a stand-in handler that parses nothing and aborts, so the servicer
and the message parser never run for it. A worker naming another worker in a bound field is
PERMISSION_DENIED, naming both, before the servicer runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextvars import ContextVar, Token

from shared.security.tokens import Principal

HEALTH_PREFIX = "/grpc.health."  # the health service: open to all, not logged or counted
COORDINATOR = "/neuroshard.v1.Coordinator/"
WORKER = "/neuroshard.v1.Worker/"
# Server reflection, under both names clients use (grpcio-reflection serves v1alpha).
REFLECTION = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")
_REFLECTION_ROLES = frozenset({"reader", "writer", "admin"})

_READER_COORDINATOR = frozenset(
    {
        "GetJob",
        "ListJobs",
        "WatchJob",
        "GetClusterStatus",
        "GetSlotMap",
        "Quality",
        "TopK",
        "ListDatasets",
        "ReportFailure",  # from a person's token: a suspicion, checked by a probe
        "ExportMemories",
    }
)
_WRITER_COORDINATOR = _READER_COORDINATOR | {"SubmitJob", "CancelJob", "PutDataset"}
_WORKER_COORDINATOR = frozenset(
    {"RegisterWorker", "Heartbeat", "ReportFailure", "DrainWorker", "FetchShard"}
)
_READER_WORKER = frozenset({"Get"})
_WRITER_WORKER = _READER_WORKER | {"Upsert", "Reinforce", "Delete"}

# Per role: (Coordinator methods, Worker methods); None: every method of that service.
_TABLE: dict[str, tuple[frozenset[str], frozenset[str] | None]] = {
    "reader": (_READER_COORDINATOR, _READER_WORKER),
    "writer": (_WRITER_COORDINATOR, _WRITER_WORKER),
    "worker": (_WORKER_COORDINATOR, None),
}

# Coordinator methods whose request names a worker: a worker token may name only itself.
BOUND_FIELDS = {
    "RegisterWorker": "name",
    "Heartbeat": "name",
    "ReportFailure": "reporter",
    "DrainWorker": "name",
    "FetchShard": "worker",
}

_principal: ContextVar[Principal | None] = ContextVar("neuroshard_principal", default=None)


def method_name(full: str) -> str:
    """Strip the service from a full method name: ``/neuroshard.v1.Worker/Upsert`` -> ``Upsert``."""
    return full.rsplit("/", 1)[-1]


def current_principal() -> Principal | None:
    """Return the caller of the RPC being served (None when auth is off or outside an RPC).

    Servicers use it to bind jobs to their owner and to check ``may_see_job``; it is a
    context variable, so each RPC's task sees its own caller.
    """
    return _principal.get()


def set_principal(principal: Principal | None) -> Token[Principal | None]:
    """Make ``principal`` the caller for the current task and the tasks it creates.

    The auth interceptor calls it in each RPC's own task.

    Returns:
        The token that ``reset_principal`` takes to undo this.
    """
    return _principal.set(principal)


def reset_principal(token: Token[Principal | None]) -> None:
    """Restore the caller that was current before the ``set_principal`` that gave ``token``."""
    _principal.reset(token)


def may_call(role: str, full_method: str) -> bool:
    """Tell whether ``role`` may call a method, by the table in the module docstring.

    Job ownership (``may_see_job``) and worker names (``bound_name_error``) are checked
    separately; this looks at the role alone.

    Args:
        role: ``worker``, ``reader``, ``writer`` or ``admin``; any other role may call
            nothing but the health service.
        full_method: ``/package.Service/Method`` as gRPC names it.
    """
    if role == "admin" or full_method.startswith(HEALTH_PREFIX):
        return True
    if full_method.startswith(REFLECTION):
        return role in _REFLECTION_ROLES
    allowed = _TABLE.get(role)
    if allowed is None:
        return False
    name = method_name(full_method)
    if full_method.startswith(COORDINATOR):
        return name in allowed[0]
    if full_method.startswith(WORKER):
        return allowed[1] is None or name in allowed[1]
    return False


def may_see_job(owner: str) -> bool:
    """Tell whether the current caller may see (get, watch, list, cancel) a job of ``owner``.

    Admins, and every caller when auth is off, see every job; others only their own (the
    job's owner is the subject of the token that submitted it). Servicers answer NOT_FOUND
    for a job the caller may not see, so that its existence does not leak.
    """
    p = current_principal()
    return p is None or p.role == "admin" or p.subject == owner


def bound_name_error(principal: Principal, method: str, request: object) -> str | None:
    """Say why a worker token may not make a request that names a worker, or return None.

    The request's worker name (the field ``BOUND_FIELDS`` gives for ``method``) must be the
    token's subject or match its ``names`` pattern; other roles and methods always pass.

    Args:
        principal: the caller.
        method: the Coordinator method's short name (``Heartbeat``).
        request: the request message.

    Returns:
        None when allowed, else the PERMISSION_DENIED message (it names both workers).
    """
    field = BOUND_FIELDS.get(method)
    if field is None or principal.role != "worker":
        return None
    name = getattr(request, field, "")
    if principal.may_act_as(name):
        return None
    return f"{method}: the worker token of {principal.describe()} may not act as {field} {name!r}"


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """Find the token of the first ``authorization: Bearer <token>`` metadata entry.

    Returns:
        The token; "" when the entry exists but its scheme is not ``Bearer`` (refused as
        malformed); None without an ``authorization`` entry.
    """
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None
