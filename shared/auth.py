"""Token authentication and role-based authorization of every RPC (one server interceptor).

Roles and what they may call (the gRPC health service is open to all, without a token):

- ``reader``: Coordinator GetJob, ListJobs, WatchJob, GetClusterStatus, GetSlotMap, Quality,
  TopK, ListDatasets; Worker Get.
- ``writer``: what ``reader`` may, and Coordinator SubmitJob, CancelJob, PutDataset; Worker
  Upsert, Reinforce, Delete.
- ``admin``: everything, e.g. Coordinator Decay of the whole store, DrainWorker of any worker.
  The coordinator presents an ``admin`` token it signs itself (subject ``coordinator``).
- ``worker`` (a worker daemon): Coordinator RegisterWorker, Heartbeat, ReportFailure,
  DrainWorker and FetchShard, each only under a worker name its token covers (``BOUND_FIELDS``,
  ``Principal.may_act_as``); every Worker RPC (workers call each other's internal RPCs).

People (readers and writers) see their own jobs only: ``may_see_job``.

The token is checked from the request's metadata before its message is deserialized: a
missing or invalid token (UNAUTHENTICATED) or a role that may not call the method
(PERMISSION_DENIED) gets a stand-in handler that parses nothing and aborts, so the servicer
and the message parser never run for it. A worker naming another worker in a bound field is
PERMISSION_DENIED, naming both, before the servicer runs.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from grpc import aio

from shared.interceptors import HEALTH_PREFIX, Continuation, method_name, wrap_handler
from shared.tokens import Principal, TokenError, verify_token

COORDINATOR = "/neuroshard.v1.Coordinator/"
WORKER = "/neuroshard.v1.Worker/"

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


def current_principal() -> Principal | None:
    """The caller of the RPC being served (None when auth is off or outside an RPC)."""
    return _principal.get()


def may_call(role: str, full_method: str) -> bool:
    """Whether ``role`` may call ``/package.Service/Method`` (job ownership and worker names
    are checked elsewhere)."""
    if role == "admin" or full_method.startswith(HEALTH_PREFIX):
        return True
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
    """Whether the current caller may see (get, watch, list, cancel) a job of ``owner``:
    admins and callers without auth see every job, others only their own (same subject)."""
    p = current_principal()
    return p is None or p.role == "admin" or p.subject == owner


def bound_name_error(principal: Principal, method: str, request: Any) -> str | None:
    """Why a worker token may not make this request (None: it may): the request's worker
    name (``BOUND_FIELDS``) must be the token's subject or match its ``names`` pattern."""
    field = BOUND_FIELDS.get(method)
    if field is None or principal.role != "worker":
        return None
    name = getattr(request, field, "")
    if principal.may_act_as(name):
        return None
    return f"{method}: the worker token of {principal.describe()} may not act as {field} {name!r}"


def bearer_token(metadata: Any) -> str | None:
    """The token of an ``authorization: Bearer <token>`` metadata entry, if any."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def refusal_handler(
    handler: grpc.RpcMethodHandler,
    code: grpc.StatusCode,
    message: str,
    principal: Principal | None = None,
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that aborts with ``code`` and ``message``
    without deserializing the request (no request_deserializer: the bytes stay bytes, and a
    client-streaming request is never read). ``principal`` is the caller for request logs."""

    async def refuse(request: Any, context: aio.ServicerContext) -> None:
        _principal.set(principal)
        await context.abort(code, message)

    h: Any = handler
    if h.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse)
    if h.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse)
    if h.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.stream_stream_rpc_method_handler(refuse)


class AuthInterceptor(aio.ServerInterceptor):
    """Verify the bearer token of every RPC but health checks, enforce ``may_call`` and the
    worker-name binding, and make the caller ``current_principal()`` for the servicer."""

    def __init__(self, public_key: Ed25519PublicKey, cache_size: int = 1024) -> None:
        self._public_key = public_key
        # Verified tokens until they expire: an Ed25519 check through PyJWT costs ~100-300 us,
        # and a daemon presents the same token on thousands of calls. Keyed by the whole
        # token (with its signature), so only a token that was verified once can hit.
        self._verified: dict[str, Principal] = {}
        self._cache_size = cache_size

    def _verify(self, token: str) -> Principal:
        """``verify_token`` with the cache. Raises: TokenError."""
        hit = self._verified.get(token)
        if hit is not None and hit.expires_at > time.time():
            return hit
        principal = verify_token(self._public_key, token)
        if len(self._verified) >= self._cache_size:
            self._verified.clear()
        self._verified[token] = principal
        return principal

    def authorize(
        self, details: grpc.HandlerCallDetails
    ) -> tuple[Principal | None, grpc.StatusCode, str]:
        """The caller of an RPC from its metadata, and OK or the refusal's code and message."""
        token = bearer_token(details.invocation_metadata)
        if token is None:
            return (
                None,
                grpc.StatusCode.UNAUTHENTICATED,
                "missing bearer token: pass --token, --token-file or $NEUROSHARD_TOKEN",
            )
        if not token:
            return (
                None,
                grpc.StatusCode.UNAUTHENTICATED,
                "authorization metadata must be 'Bearer <token>'",
            )
        try:
            principal = self._verify(token)
        except TokenError as exc:
            return None, grpc.StatusCode.UNAUTHENTICATED, str(exc)
        if not may_call(principal.role, details.method):
            return (
                principal,
                grpc.StatusCode.PERMISSION_DENIED,
                f"role {principal.role} may not call {method_name(details.method)}",
            )
        return principal, grpc.StatusCode.OK, ""

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        full = handler_call_details.method
        if handler is None or full.startswith(HEALTH_PREFIX):
            return handler
        principal, code, message = self.authorize(handler_call_details)
        if code is not grpc.StatusCode.OK:
            return refusal_handler(handler, code, message, principal)
        method = method_name(full)
        bound = full.startswith(COORDINATOR) and method in BOUND_FIELDS

        @asynccontextmanager
        async def around(request: Any, context: aio.ServicerContext) -> AsyncIterator[None]:
            _principal.set(principal)
            if bound and principal is not None:
                denied = bound_name_error(principal, method, request)
                if denied is not None:
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, denied)
            yield

        return wrap_handler(handler, around)
