"""Every server interceptor of both daemons, and ``wrap_handler``, which they build on.

In the order the servers install them: ``DecodeGuardInterceptor`` (request bytes that do not
parse are INVALID_ARGUMENT), ``AuthInterceptor`` (bearer token and role, checked before the
request is deserialized), ``RequestLogInterceptor`` (``rpc_served`` log line and
``neuroshard_rpcs_total``), ``MetricsInterceptor`` (request/response bytes) and, on workers,
``BatchLimitInterceptor`` (keyed memory requests over ``max_batch_items``).

``wrap_handler`` turns an ``RpcMethodHandler`` of any of the four kinds into one whose behavior
runs inside an async context manager ``around(request, context)`` (``request`` is None for
client-streaming RPCs). The context manager may abort the RPC on entry and sees its outcome
on exit; it runs in the RPC's own task, so context variables it sets (structlog's, the
caller's ``Principal``) are visible to the servicer and to log lines of that RPC.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import grpc
import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from google.protobuf.message import DecodeError
from grpc import aio

from shared.logging import get_logger
from shared.metrics import Metrics
from shared.rpc.limits import DEFAULT_MAX_BATCH_ITEMS, KEYED_METHODS, batch_error
from shared.security.auth import (
    BOUND_FIELDS,
    COORDINATOR,
    HEALTH_PREFIX,
    bearer_token,
    bound_name_error,
    current_principal,
    may_call,
    method_name,
    set_principal,
)
from shared.security.tokens import Principal, TokenError, verify_token

Around = Callable[[Any, aio.ServicerContext], AbstractAsyncContextManager[None]]
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]

log = get_logger("rpc")


def _wrap_streaming(behavior: Any, around: Around, with_request: bool) -> Any:
    """Wrap a server-streaming behavior: an async generator, or a coroutine that writes
    with ``context.write``."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            async with around(request if with_request else None, context):
                async for reply in behavior(request, context):
                    yield reply

        return stream
    return _wrap_unary(behavior, around, with_request)


def _wrap_unary(behavior: Any, around: Around, with_request: bool) -> Any:
    async def call(request: Any, context: aio.ServicerContext) -> Any:
        async with around(request if with_request else None, context):
            return await behavior(request, context)

    return call


def wrap_handler(handler: grpc.RpcMethodHandler, around: Around) -> grpc.RpcMethodHandler:
    """The same handler with its behavior run inside ``around(request, context)``."""
    h: Any = handler
    if h.unary_unary is not None:
        return h._replace(unary_unary=_wrap_unary(h.unary_unary, around, True))
    if h.unary_stream is not None:
        return h._replace(unary_stream=_wrap_streaming(h.unary_stream, around, True))
    if h.stream_unary is not None:
        return h._replace(stream_unary=_wrap_unary(h.stream_unary, around, False))
    return h._replace(stream_stream=_wrap_streaming(h.stream_stream, around, False))


def status_of(context: aio.ServicerContext, exc: BaseException | None) -> str:
    """The final status name of an RPC: the aborted/set code, UNKNOWN for an exception that
    escaped the servicer, CANCELLED when the caller went away, OK otherwise."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int) and code:  # grpc.aio may report the numeric value
        return next((c.name for c in grpc.StatusCode if c.value[0] == code), "UNKNOWN")
    if exc is None:
        return "OK"
    return "CANCELLED" if type(exc).__name__ == "CancelledError" else "UNKNOWN"


class RequestLogInterceptor(aio.ServerInterceptor):
    """Log every RPC at debug level (``rpc_served``: method, peer, subject, role, status,
    duration_ms) and count it in ``neuroshard_rpcs_total{method,code}``.

    Binds structlog context variables for the RPC's task: ``rpc`` (method), ``worker`` (this
    worker's name on a worker; the request's ``name`` on the coordinator) and ``job_id`` when
    the request carries one, so every log line the servicer writes carries them too.
    """

    def __init__(self, metrics: Metrics, worker_name: str | None = None) -> None:
        self._metrics = metrics
        self._worker_name = worker_name
        # Decided once (logging is configured before servers are built): building the
        # debug line costs more than the rest of the interceptor.
        self._debug = debug_enabled()

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        full = handler_call_details.method
        if handler is None or full.startswith(HEALTH_PREFIX):
            return handler
        return wrap_handler(handler, self._around_for(method_name(full)))

    def _bind(self, method: str, request: Any) -> None:
        fields: dict[str, Any] = {"rpc": method}
        worker = self._worker_name
        if worker is None and request is not None:
            worker = getattr(request, "name", "")
        if worker and isinstance(worker, str):
            fields["worker"] = worker
        job_id = getattr(request, "job_id", "")
        if job_id:
            fields["job_id"] = job_id
        structlog.contextvars.bind_contextvars(**fields)

    def _around_for(self, method: str) -> Around:
        counter = self._metrics.rpcs
        by_code: dict[str, Any] = {}  # counter children by status name

        @asynccontextmanager
        async def around(request: Any, context: aio.ServicerContext) -> AsyncIterator[None]:
            self._bind(method, request)
            start = time.perf_counter()
            # Asked now: after a streaming RPC ended (aborted, cancelled) the call may be gone,
            # and grpc_call_get_peer on it crashed the process.
            peer = context.peer() if self._debug else ""
            exc: BaseException | None = None
            try:
                yield
            except BaseException as e:
                exc = e
                raise
            finally:
                code = status_of(context, exc)
                child = by_code.get(code)
                if child is None:
                    child = by_code[code] = counter.labels(method, code)
                child.inc()
                if self._debug:
                    self._log(method, code, peer, time.perf_counter() - start)

        return around

    @staticmethod
    def _log(method: str, code: str, peer: str, seconds: float) -> None:
        p = current_principal()
        log.debug(
            "rpc_served",
            method=method,
            peer=peer,
            status=code,
            subject=p.subject if p else None,
            role=p.role if p else None,
            duration_ms=round(seconds * 1e3, 3),
        )


def debug_enabled() -> bool:
    """Whether structlog as configured now lets debug lines through."""
    check = getattr(structlog.get_config()["wrapper_class"], "is_enabled_for", None)
    try:
        return True if check is None else bool(check(None, logging.DEBUG))
    except Exception:  # another wrapper class: let the logger decide per line
        return True


class MetricsInterceptor(aio.ServerInterceptor):
    """Count serialized request/response bytes and status codes per RPC method."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        method = method_name(handler_call_details.method)
        recv = self._m.rpc_received_bytes.labels(method)
        sent = self._m.rpc_sent_bytes.labels(method)
        deser, ser = handler.request_deserializer, handler.response_serializer

        def count_in(data: bytes) -> Any:
            recv.inc(len(data))
            return deser(data) if deser else data

        def count_out(msg: Any) -> bytes:
            data = ser(msg) if ser else msg
            sent.inc(len(data))
            return data  # type: ignore[no-any-return]

        return handler._replace(request_deserializer=count_in, response_serializer=count_out)


class BatchLimitInterceptor(aio.ServerInterceptor):
    """On a worker: refuse keyed memory requests with more than ``limit`` ids
    (INVALID_ARGUMENT, before any work)."""

    def __init__(self, limit: int = DEFAULT_MAX_BATCH_ITEMS) -> None:
        self.limit = limit

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in KEYED_METHODS:
            return handler

        @asynccontextmanager
        async def around(request: Any, context: aio.ServicerContext) -> AsyncIterator[None]:
            error = batch_error(len(request.ids) // 8, self.limit)
            if error is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
            yield

        return wrap_handler(handler, around)


# --- requests that do not parse ---------------------------------------------------------


class UndecodableRequest:
    """Stands for request bytes that did not parse; ``error`` says why (INVALID_ARGUMENT)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``parse`` that returns an ``UndecodableRequest`` instead of raising ``DecodeError``."""

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return UndecodableRequest(f"request is not a valid message: {exc}")

    return deserialize


async def _refuse(context: aio.ServicerContext, request: UndecodableRequest) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)


async def _checked(requests: AsyncIterator[Any], context: aio.ServicerContext) -> Any:
    async for request in requests:
        if isinstance(request, UndecodableRequest):
            await _refuse(context, request)
        yield request


def _one_request(behavior: Any) -> Any:
    """Wrap a unary-request behavior (unary or server-streaming, generator or coroutine)."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, UndecodableRequest):
                await _refuse(context, request)
            async for reply in behavior(request, context):
                yield reply

        return stream

    async def call(request: Any, context: aio.ServicerContext) -> Any:
        if isinstance(request, UndecodableRequest):
            await _refuse(context, request)
        return await behavior(request, context)

    return call


def _request_stream(behavior: Any) -> Any:
    """Wrap a client-streaming behavior: its request iterator refuses an undecodable one."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(requests: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            async for reply in behavior(_checked(requests, context), context):
                yield reply

        return stream

    async def call(requests: Any, context: aio.ServicerContext) -> Any:
        return await behavior(_checked(requests, context), context)

    return call


class DecodeGuardInterceptor(aio.ServerInterceptor):
    """Answer INVALID_ARGUMENT for request bytes that are not a valid message of the
    method's request type (instead of grpc.aio's UNKNOWN). Put it before interceptors whose
    code reads request fields."""

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        h: Any = handler
        parse = tolerant(h.request_deserializer)
        if h.unary_unary is not None:
            return h._replace(request_deserializer=parse, unary_unary=_one_request(h.unary_unary))
        if h.unary_stream is not None:
            return h._replace(request_deserializer=parse, unary_stream=_one_request(h.unary_stream))
        if h.stream_unary is not None:
            return h._replace(
                request_deserializer=parse, stream_unary=_request_stream(h.stream_unary)
            )
        return h._replace(
            request_deserializer=parse, stream_stream=_request_stream(h.stream_stream)
        )


# --- tokens and roles ---------------------------------------------------------------------


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
        set_principal(principal)
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
            set_principal(principal)
            if bound and principal is not None:
                denied = bound_name_error(principal, method, request)
                if denied is not None:
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, denied)
            yield

        return wrap_handler(handler, around)


def server_interceptors(
    metrics: Metrics,
    public_key: Ed25519PublicKey | None,
    worker_name: str | None = None,
    max_batch_items: int | None = None,
) -> list[aio.ServerInterceptor]:
    """A daemon's interceptor chain, outermost first.

    The request log sees every outcome (refusals included); request bytes are checked to
    parse before anything reads a field; the token (when ``public_key`` is set: auth is on)
    before any work; on a worker (``max_batch_items`` set), keyed memory batches over the
    limit are refused before the servicer runs.

    Args:
        metrics: the daemon's metrics (rpc counts and bytes).
        public_key: the coordinator's token-signing key, or None without auth.
        worker_name: this worker's name for log lines (None on the coordinator).
        max_batch_items: a worker's ``max_batch_items`` (None on the coordinator).
    """
    chain: list[aio.ServerInterceptor] = [
        RequestLogInterceptor(metrics, worker_name=worker_name),
        DecodeGuardInterceptor(),
    ]
    if public_key is not None:
        chain.append(AuthInterceptor(public_key))
    if max_batch_items is not None:
        chain.append(BatchLimitInterceptor(max_batch_items))
    chain.append(MetricsInterceptor(metrics))
    return chain
