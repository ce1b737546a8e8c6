"""Roles, and what each may call: the policy ``rpc.interceptors.AuthInterceptor`` enforces.

Callers are of two kinds (docs/architecture.md, "Trust boundaries"):

- **daemons**, known by the identity in their TLS client certificate
  (``shared.security.identity``), never by a token:
  - ``coordinator``: no Coordinator RPC at all; the Worker service's control RPCs
    (``WORKER_CONTROL``: slot maps and copies, whole-store decay/sweep/quality/top-k/sample,
    training, allreduce), the slot inspections it shares with workers (DumpSlots for
    exports, SlotSeqs for re-copies) and the keyed memory RPCs its memory jobs make (Upsert,
    Reinforce, Get, Delete);
  - ``worker``: Coordinator RegisterWorker, Heartbeat, ReportFailure, DrainWorker and
    FetchShard, each only under the name its certificate carries (``BOUND_FIELDS``); the
    Worker service's peer RPCs (``WORKER_PEER``: Replicate, ReceiveSlots, DumpSlots,
    SlotSeqs) and nothing else.
- **people and programs**, known by their bearer token (``shared.security.tokens``), whose
  audience says where it may be presented:
  - coordinator tokens (``aud`` ``neuroshard``), on the Coordinator service only:
    ``reader``: GetJob, ListJobs, WatchJob, GetModel, ListModels, GetClusterStatus,
    GetSlotMap, Quality, TopK, Sample, ListDatasets, ExportMemories, ListTables,
    ReportFailure (a suspicion, confirmed by the coordinator before it acts); ``writer``:
    those and SubmitJob, CancelJob, RunEpochs and FinishJob (a paced job's grants and
    end), PutDataset, Insert (a capped table's upsert);
    ``admin``: every Coordinator RPC (Decay and Sweep of a whole table, CreateTable,
    DropTable, DrainWorker, ForgetWorker).
  - data-plane tokens (``aud`` ``neuroshard-data``, minted by the coordinator in GetSlotMap
    for at most an hour), on the Worker service's keyed RPCs and whole-table reads only:
    ``reader`` Get, Quality, TopK, SampleSums, SamplePick; ``writer`` those and Upsert,
    Reinforce, Delete (an admin's data-plane token is a writer's). The four reads are the
    coordinator's Quality, TopK and Sample (a reader's), fanned out by the client itself; a
    worker gives a token what the coordinator gives it (TopK: k at most the map's
    ``topk_max``, no eviction ``order``; SamplePick: at most the map's ``max_sample_batch``
    draws: ``worker/memory/memory_servicer.py``). What they show beyond the coordinator's
    answers (a primary's slots' weight sums, the memories at chosen offsets) a reader can
    already read whole with ExportMemories.
  So a worker that captures a client's data-plane token can replay it only to workers, with
  the rights its holder has there, and no token a daemon sends exists to be captured.

Server reflection (``grpc.reflection.v1alpha`` and ``v1`` ServerReflectionInfo) is a read RPC
of people's tokens (``reader``, ``writer``, ``admin``) of the daemon's own audience: a
coordinator token on the coordinator, a data-plane token (``GetSlotMap``'s) on a worker. Not
of daemons: they never need it. The gRPC health service is open to all, without a token.

People (readers and writers) see their own jobs (and their saved models) only:
``may_see_job``.

A token is checked from the request's metadata before its message is deserialized; a
daemon's certificate is read from the call's auth context when the call starts, before the
servicer runs. A missing or invalid credential is UNAUTHENTICATED, a caller that may not call
the method PERMISSION_DENIED.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextvars import ContextVar, Token

from shared.security.tokens import AUD_COORDINATOR, AUD_DATA, Principal

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
        "Sample",
        "ListDatasets",
        "ReportFailure",  # from a person's token: a suspicion, confirmed before it acts
        "ExportMemories",
        "GetModel",
        "ListModels",
        "ListTables",
    }
)
_WRITER_COORDINATOR = _READER_COORDINATOR | {
    "SubmitJob",
    "CancelJob",
    "RunEpochs",
    "FinishJob",
    "PutDataset",
    "Insert",
}
_WORKER_COORDINATOR = frozenset(
    {"RegisterWorker", "Heartbeat", "ReportFailure", "DrainWorker", "FetchShard"}
)
KEYED_READ = frozenset({"Get"})
KEYED_WRITE = frozenset({"Get", "Upsert", "Reinforce", "Delete"})
# Whole-table reads a client fans out to the primaries itself (the coordinator's too):
# Quality, TopK, and a sample's two phases.
TABLE_READ = frozenset({"Quality", "TopK", "SampleSums", "SamplePick"})
# Worker RPCs only the coordinator calls (commands), and those workers call on each other.
WORKER_CONTROL = frozenset(
    {
        "ApplySlotMap",
        "CopySlots",
        "Decay",
        "Sweep",
        "Quality",
        "TopK",
        "SampleSums",
        "SamplePick",
        "StartTraining",
        "RunAllreduce",
        "ComputeGradients",
        "StopTraining",
    }
)
WORKER_PEER = frozenset({"Replicate", "ReceiveSlots", "DumpSlots", "SlotSeqs"})
_SHARED_INSPECTIONS = frozenset({"DumpSlots", "SlotSeqs"})  # the coordinator's too

# Per (role, audience): (Coordinator methods, Worker methods). Daemons have no audience.
_TABLE: dict[tuple[str, str], tuple[frozenset[str], frozenset[str]]] = {
    ("coordinator", ""): (frozenset(), WORKER_CONTROL | _SHARED_INSPECTIONS | KEYED_WRITE),
    ("worker", ""): (_WORKER_COORDINATOR, WORKER_PEER),
    ("reader", AUD_COORDINATOR): (_READER_COORDINATOR, frozenset()),
    ("writer", AUD_COORDINATOR): (_WRITER_COORDINATOR, frozenset()),
    ("reader", AUD_DATA): (frozenset(), KEYED_READ | TABLE_READ),
    ("writer", AUD_DATA): (frozenset(), KEYED_WRITE | TABLE_READ),
    ("admin", AUD_DATA): (frozenset(), KEYED_WRITE | TABLE_READ),
}

# Coordinator methods whose request names a worker: a worker may name only itself.
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


def may_call(principal: Principal, full_method: str) -> bool:
    """Tell whether ``principal`` may call a method, by the table in the module docstring.

    Job ownership (``may_see_job``) and worker names (``bound_name_error``) are checked
    separately; this looks at the role and audience alone.

    Args:
        principal: the caller (a token's, or a daemon certificate's).
        full_method: ``/package.Service/Method`` as gRPC names it.
    """
    if full_method.startswith(HEALTH_PREFIX):
        return True
    role, audience = principal.role, principal.audience
    if full_method.startswith(REFLECTION):  # a token the daemon accepted (its audience)
        return role in _REFLECTION_ROLES
    if role == "admin" and audience == AUD_COORDINATOR:
        return full_method.startswith(COORDINATOR)
    allowed = _TABLE.get((role, audience))
    if allowed is None:
        return False
    name = method_name(full_method)
    if full_method.startswith(COORDINATOR):
        return name in allowed[0]
    if full_method.startswith(WORKER):
        return name in allowed[1]
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
    """Say why a worker may not make a request that names a worker, or return None.

    The request's worker name (the field ``BOUND_FIELDS`` gives for ``method``) must be the
    name in the worker's certificate; other roles and methods always pass.

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
    return f"{method}: {principal.describe()} (by its certificate) may not act as {field} {name!r}"


class AddressRefused(PermissionError):
    """A worker advertised a host its certificate does not name (PERMISSION_DENIED).

    The message is ``address_error``'s.
    """


def address_error(principal: Principal | None, address: str) -> str | None:
    """Say why a worker may not register ``address``, or return None.

    A worker known by its certificate may advertise only a host its certificate names
    (DNS names, wildcards for one label, IP addresses), so that the coordinator and peers
    that dial it check the same certificate. Other callers (auth off) pass.

    Args:
        principal: the caller of RegisterWorker.
        address: the ``host:port`` the worker advertises.

    Returns:
        None when allowed, else the PERMISSION_DENIED message naming the host and the
        certificate's names.
    """
    if principal is None or principal.role != "worker":
        return None
    from shared.security.identity import PeerIdentity

    host = address.rpartition(":")[0] or address
    if PeerIdentity("worker", principal.subject, principal.hosts).covers_host(host):
        return None
    return (
        f"RegisterWorker: address {address!r}: host {host!r} is not among the names of "
        f"worker {principal.subject!r}'s certificate ({', '.join(principal.hosts) or 'none'})"
    )


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
