"""Token authentication and role-based authorization of every RPC (one server interceptor).

Roles and what they may call (``admin`` may call everything; the gRPC health service is open
to all, without a token):

- ``worker``: Coordinator RegisterWorker, Heartbeat, ReportFailure, DrainWorker (of itself:
  the request's name must be the token's subject); every Worker RPC.
- ``client``: Coordinator SubmitJob, GetJob, ListJobs, WatchJob, CancelJob (of its own jobs),
  GetClusterStatus, GetSlotMap, Decay, Quality, TopK; Worker Upsert, Get, Delete, Reinforce.

The daemons present a ``worker`` token to each other: the coordinator runs memory jobs and
bulk operations through the workers' keyed RPCs, hence ``worker`` may call those as well.
Refusals: a missing, malformed, badly signed or expired token is UNAUTHENTICATED; a role that
may not call the method is PERMISSION_DENIED; both messages say which.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

import grpc
from grpc import aio

from shared.interceptors import HEALTH_PREFIX, Continuation, method_name, wrap_handler
from shared.tokens import Principal, TokenError, verify_token

COORDINATOR = "/neuroshard.v1.Coordinator/"
WORKER = "/neuroshard.v1.Worker/"

_CLIENT_COORDINATOR = {
    "SubmitJob",
    "GetJob",
    "ListJobs",
    "WatchJob",
    "CancelJob",
    "GetClusterStatus",
    "GetSlotMap",
    "Decay",
    "Quality",
    "TopK",
}
_KEYED = {"Upsert", "Get", "Delete", "Reinforce"}
_WORKER_COORDINATOR = {"RegisterWorker", "Heartbeat", "ReportFailure", "DrainWorker"}

_principal: ContextVar[Principal | None] = ContextVar("neuroshard_principal", default=None)


def current_principal() -> Principal | None:
    """The caller of the RPC being served (None when auth is off or outside an RPC)."""
    return _principal.get()


def may_call(role: str, full_method: str) -> bool:
    """Whether ``role`` may call ``/package.Service/Method`` (ownership checked elsewhere)."""
    if role == "admin" or full_method.startswith(HEALTH_PREFIX):
        return True
    name = method_name(full_method)
    if full_method.startswith(COORDINATOR):
        allowed = _WORKER_COORDINATOR if role == "worker" else _CLIENT_COORDINATOR
        return role in ("worker", "client") and name in allowed
    if full_method.startswith(WORKER):
        return role == "worker" or (role == "client" and name in _KEYED)
    return False


def owner_check(owner: str, action: str) -> str | None:
    """Why the current caller may not ``action`` a resource of ``owner`` (None: it may).

    Admins and callers without auth may; a ``client`` only its own (same subject)."""
    p = current_principal()
    if p is None or p.role == "admin" or p.subject == owner:
        return None
    return (
        f"role {p.role} may {action} only its own jobs; this one belongs to {owner or 'nobody'!r}"
    )


def bearer_token(metadata: Any) -> str | None:
    """The token of an ``authorization: Bearer <token>`` metadata entry, if any."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


class AuthInterceptor(aio.ServerInterceptor):
    """Verify the bearer token of every RPC but health checks and enforce ``may_call``."""

    def __init__(self, secret: bytes, cache_size: int = 1024) -> None:
        self._secret = secret
        # Verified tokens until they expire: an HS256 check costs ~50-200 us, and a daemon
        # presents the same token on thousands of calls. Keyed by the whole token (with its
        # signature), so only a token that was verified once can hit.
        self._verified: dict[str, Principal] = {}
        self._cache_size = cache_size

    def _verify(self, token: str) -> Principal:
        """``verify_token`` with the cache. Raises: TokenError."""
        hit = self._verified.get(token)
        if hit is not None and hit.expires_at > time.time():
            return hit
        principal = verify_token(self._secret, token)
        if len(self._verified) >= self._cache_size:
            self._verified.clear()
        self._verified[token] = principal
        return principal

    def _authorize(
        self, details: grpc.HandlerCallDetails
    ) -> tuple[Principal | None, grpc.StatusCode, str]:
        token = bearer_token(details.invocation_metadata)
        if token is None:
            return (
                None,
                grpc.StatusCode.UNAUTHENTICATED,
                ("missing bearer token: pass --token, --token-file or $NEUROSHARD_TOKEN"),
            )
        if not token:
            return (
                None,
                grpc.StatusCode.UNAUTHENTICATED,
                ("authorization metadata must be 'Bearer <token>'"),
            )
        try:
            principal = self._verify(token)
        except TokenError as exc:
            return None, grpc.StatusCode.UNAUTHENTICATED, str(exc)
        if not may_call(principal.role, details.method):
            return (
                principal,
                grpc.StatusCode.PERMISSION_DENIED,
                (f"role {principal.role} may not call {method_name(details.method)}"),
            )
        return principal, grpc.StatusCode.OK, ""

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        principal, code, message = self._authorize(handler_call_details)
        drain = handler_call_details.method == COORDINATOR + "DrainWorker"

        @asynccontextmanager
        async def around(request: Any, context: aio.ServicerContext) -> AsyncIterator[None]:
            _principal.set(principal)
            if code is not grpc.StatusCode.OK:
                await context.abort(code, message)
            if (
                drain
                and principal is not None
                and principal.role == "worker"
                and request.name != principal.subject
            ):
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"role worker may drain only itself ({principal.subject!r}), "
                    f"not {request.name!r}",
                )
            yield

        return wrap_handler(handler, around)
