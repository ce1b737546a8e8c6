"""Every server interceptor of both daemons, and ``wrap_handler``, which they build on.

``server_interceptors`` builds a daemon's chain, outermost first, run as one interceptor
(``ChainInterceptor``: one pass of grpc.aio's interceptor pipeline per call, not one per
layer):

1. ``RequestLogInterceptor``: the ``rpc_served`` debug line and ``neuroshard_rpcs_total`` for
   every outcome, refusals by the interceptors below it included.
2. ``DecodeGuardInterceptor``: request bytes that do not parse are INVALID_ARGUMENT (grpc.aio
   alone answers UNKNOWN), before any code reads a request field.
3. ``AuthInterceptor`` (when auth is on): a bearer token (people), checked from the metadata
   before the request is deserialized, or a daemon's certificate identity, read from the
   call's TLS auth context before the servicer runs (UNAUTHENTICATED, PERMISSION_DENIED);
   streams end when their token expires.
4. ``BatchLimitInterceptor`` (workers): keyed memory requests over ``max_batch_items`` are
   INVALID_ARGUMENT before the servicer runs.
5. ``MetricsInterceptor``: serialized request and response bytes per method.

``wrap_handler`` turns an ``RpcMethodHandler`` of any of the four kinds into one whose behavior
runs inside an async context manager ``around(request, context)`` (``request`` is None for
client-streaming RPCs). The context manager may abort the RPC on entry and sees its outcome
on exit; it runs in the RPC's own task, so context variables it sets (structlog's, the
caller's ``Principal``) are visible to the servicer and to log lines of that RPC.

Handlers are rebuilt with grpc's public ``*_rpc_method_handler`` factories. grpc's type stubs
describe a handler's behaviors as synchronous functions of a ``grpc.ServicerContext``; under
grpc.aio they are coroutine functions (or async generator functions) of an
``aio.ServicerContext``, so this module types them as ``Behavior`` and handlers by their
request and response message types ``Req`` and ``Resp`` only.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import grpc
import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from google.protobuf.message import DecodeError
from grpc import aio
from prometheus_client import Counter

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
from shared.security.identity import PeerIdentities
from shared.security.tokens import (
    AUD_COORDINATOR,
    Principal,
    RevocationList,
    TokenError,
    verify_token,
)
from shared.security.transport import DaemonSecurity

Req = TypeVar("Req")
Resp = TypeVar("Resp")

# A handler's behavior as grpc.aio calls it: ``(request or request iterator, context)`` to a
# coroutine, or to an async generator for a streaming response.
Behavior: TypeAlias = Callable[..., Any]
Deserializer: TypeAlias = Callable[[bytes], Any]
Serializer: TypeAlias = Callable[[Any], bytes]

if TYPE_CHECKING:  # grpc.RpcMethodHandler is generic in the stubs only
    Context: TypeAlias = aio.ServicerContext[Any, Any]
    Handler: TypeAlias = grpc.RpcMethodHandler[Req, Resp]
    Around: TypeAlias = Callable[[Any, Context], AbstractAsyncContextManager[None]]
    Continuation: TypeAlias = Callable[
        [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Req, Resp] | None]
    ]

log = get_logger(__name__)

_FACTORIES: dict[str, Callable[..., grpc.RpcMethodHandler[Any, Any]]] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def _kind_of(handler: Handler[Any, Any]) -> tuple[str, Behavior]:
    """The kind of ``handler`` (``unary_unary``, ...) and its behavior."""
    if handler.unary_unary is not None:
        return "unary_unary", handler.unary_unary
    if handler.unary_stream is not None:
        return "unary_stream", handler.unary_stream
    if handler.stream_unary is not None:
        return "stream_unary", handler.stream_unary
    if handler.stream_stream is not None:
        return "stream_stream", handler.stream_stream
    raise ValueError("an RpcMethodHandler without a behavior")


def _handler(
    kind: str,
    behavior: Behavior,
    request_deserializer: Deserializer | None,
    response_serializer: Serializer | None,
) -> Handler[Any, Any]:
    """A new handler of ``kind`` (what ``grpc.*_rpc_method_handler`` make)."""
    return _FACTORIES[kind](
        behavior,
        request_deserializer=request_deserializer,
        response_serializer=response_serializer,
    )


def _wrap_streaming(behavior: Behavior, around: Around, with_request: bool) -> Behavior:
    """Wrap a server-streaming behavior.

    It is an async generator function, or a coroutine function that writes its replies with
    ``context.write``.
    """
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
            async with around(request if with_request else None, context):
                async for reply in behavior(request, context):
                    yield reply

        return stream
    return _wrap_unary(behavior, around, with_request)


def _wrap_unary(behavior: Behavior, around: Around, with_request: bool) -> Behavior:
    async def call(request: Any, context: Context) -> Any:
        async with around(request if with_request else None, context):
            return await behavior(request, context)

    return call


def wrap_handler(handler: Handler[Req, Resp], around: Around) -> Handler[Req, Resp]:
    """Return the same handler with its behavior run inside ``around(request, context)``.

    Args:
        handler: a grpc.aio handler of any of the four kinds.
        around: makes the async context manager each call runs in; it gets the request, or
            None for client-streaming kinds (whose requests arrive after it is entered).

    Returns:
        A handler of the same kind, with the same deserializer and serializer.
    """
    kind, behavior = _kind_of(handler)
    if kind in ("unary_unary", "stream_unary"):
        wrapped = _wrap_unary(behavior, around, kind == "unary_unary")
    else:
        wrapped = _wrap_streaming(behavior, around, kind == "unary_stream")
    return _handler(kind, wrapped, handler.request_deserializer, handler.response_serializer)


class HandlerCache:
    """One interceptor's wrapped handler per method, reused while the inner handler is the same.

    grpc.aio asks every interceptor for a handler on every call; rebuilding the wrappers each
    time cost a worker more GIL time than a one-id read itself. The inner chain answers the
    same handler object per method (the registered one, or the next interceptor's cached
    wrapper), so a wrapper built once is reused; ``key`` tells apart the wrappers that
    depend on more than the method (the caller, for ``AuthInterceptor``). Only methods with a
    handler are kept, so the cache is bounded by the registered methods.
    """

    __slots__ = ("_built",)

    def __init__(self) -> None:
        """Start empty."""
        self._built: dict[str, tuple[object, object, Handler[Any, Any]]] = {}

    def get(
        self,
        method: str,
        handler: Handler[Req, Resp],
        build: Callable[[Handler[Req, Resp]], Handler[Req, Resp]],
        key: object = None,
    ) -> Handler[Req, Resp]:
        """The wrapper of ``handler`` for ``method`` (and ``key``), built by ``build`` once."""
        hit = self._built.get(method)
        if hit is not None and hit[0] is handler and hit[1] is key:
            return hit[2]
        wrapped = build(handler)
        self._built[method] = (handler, key, wrapped)
        return wrapped


def status_of(context: Context, exc: BaseException | None) -> str:
    """Name the final status of an RPC for logs and the ``code`` label of metrics.

    Args:
        context: the RPC's server context, after its behavior returned or raised.
        exc: what the behavior raised, or None.

    Returns:
        The code the servicer aborted with or set, else UNKNOWN for an exception that escaped
        the servicer, CANCELLED when the caller went away, OK otherwise.
    """
    code: object = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int) and code:  # grpc.aio may report the numeric value
        return next((c.name for c in grpc.StatusCode if c.value[0] == code), "UNKNOWN")
    if exc is None:
        return "OK"
    return "CANCELLED" if type(exc).__name__ == "CancelledError" else "UNKNOWN"


class Layer(aio.ServerInterceptor):
    """One interceptor of a chain: its work is ``wrap``.

    Run alone (``intercept_service``) or by ``ChainInterceptor`` with the others in one pass.
    """

    async def intercept_service(
        self, continuation: Continuation[Req, Resp], handler_call_details: grpc.HandlerCallDetails
    ) -> Handler[Req, Resp] | None:
        """The inner interceptors' handler for the call, wrapped by this layer."""
        return self.wrap(await continuation(handler_call_details), handler_call_details)

    def wrap(
        self, handler: Handler[Req, Resp] | None, details: grpc.HandlerCallDetails
    ) -> Handler[Req, Resp] | None:
        """The handler this layer answers for a call, given the inner layers' ``handler``."""
        raise NotImplementedError


class RequestLogInterceptor(Layer):
    """Log and count every RPC but health checks, whatever its outcome.

    Each RPC is counted in ``neuroshard_rpcs_total{method,code}`` and, when debug logging is
    on, logged as ``rpc_served`` (method, peer, subject, role, status, duration_ms).

    It binds structlog context variables for the RPC's task: ``rpc`` (method), ``worker`` (this
    worker's name on a worker; the request's ``name`` on the coordinator) and ``job_id`` when
    the request carries one, so every log line the servicer writes carries them too.
    """

    def __init__(self, metrics: Metrics, worker_name: str | None = None) -> None:
        """Count into ``metrics.rpcs``; ``worker_name`` is None on the coordinator."""
        self._metrics = metrics
        self._worker_name = worker_name
        # Decided once (logging is configured before servers are built): building the
        # debug line costs more than the rest of the interceptor.
        self._debug = debug_enabled()
        self._cache = HandlerCache()

    def wrap(
        self, handler: Handler[Req, Resp] | None, details: grpc.HandlerCallDetails
    ) -> Handler[Req, Resp] | None:
        """Wrap the method's handler so that each call binds, logs and counts itself."""
        full = details.method
        if handler is None or full.startswith(HEALTH_PREFIX):
            return handler
        return self._cache.get(full, handler, lambda h: self._wrap(h, method_name(full)))

    def _wrap(self, handler: Handler[Req, Resp], method: str) -> Handler[Req, Resp]:
        """``handler`` logged and counted; a unary call without a context manager's cost."""
        kind, behavior = _kind_of(handler)
        if kind != "unary_unary":
            return wrap_handler(handler, self._around_for(method))
        done = self._done_for(method)

        async def call(request: Any, context: Context) -> Any:
            self._bind(method, request)
            start = time.perf_counter()
            peer = context.peer() if self._debug else ""
            exc: BaseException | None = None
            try:
                return await behavior(request, context)
            except BaseException as e:
                exc = e
                raise
            finally:
                done(context, exc, peer, start)

        return _handler(kind, call, handler.request_deserializer, handler.response_serializer)

    def _done_for(self, method: str) -> Callable[[Context, BaseException | None, str, float], None]:
        """What an RPC of ``method`` does when it ends: count it, and log it on debug."""
        counter = self._metrics.rpcs
        by_code: dict[str, Counter] = {}  # counter children by status name

        def done(context: Context, exc: BaseException | None, peer: str, start: float) -> None:
            code = status_of(context, exc)
            child = by_code.get(code)
            if child is None:
                child = by_code[code] = counter.labels(method, code)
            child.inc()
            if self._debug:
                self._log(method, code, peer, time.perf_counter() - start)

        return done

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
        done = self._done_for(method)

        @asynccontextmanager
        async def around(request: Any, context: Context) -> AsyncIterator[None]:
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
                done(context, exc, peer, start)

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
    """Tell whether structlog, as configured now, lets debug lines through.

    Returns:
        False only when the configured wrapper class is a filtering bound logger above debug
        level; True for any other wrapper class (the logger then decides per line).
    """
    check = getattr(structlog.get_config()["wrapper_class"], "is_enabled_for", None)
    try:
        return True if check is None else bool(check(None, logging.DEBUG))
    except Exception:  # another wrapper class: let the logger decide per line
        return True


class MetricsInterceptor(Layer):
    """Count serialized request and response bytes per RPC method.

    Into ``neuroshard_rpc_received_bytes_total`` and ``neuroshard_rpc_sent_bytes_total``,
    labelled by method; health checks are not counted.
    """

    def __init__(self, metrics: Metrics) -> None:
        """Count into ``metrics.rpc_received_bytes`` and ``metrics.rpc_sent_bytes``."""
        self._m = metrics
        self._cache = HandlerCache()

    def wrap(
        self, handler: Handler[Req, Resp] | None, details: grpc.HandlerCallDetails
    ) -> Handler[Req, Resp] | None:
        """Wrap the method's (de)serializers so that they count the bytes they see."""
        full = details.method
        if handler is None or full.startswith(HEALTH_PREFIX):
            return handler
        return self._cache.get(full, handler, lambda h: self._counting(h, method_name(full)))

    def _counting(self, handler: Handler[Req, Resp], method: str) -> Handler[Req, Resp]:
        """``handler`` with (de)serializers that count bytes into ``method``'s counters."""
        recv = self._m.rpc_received_bytes.labels(method)
        sent = self._m.rpc_sent_bytes.labels(method)
        deser, ser = handler.request_deserializer, handler.response_serializer

        def count_in(data: bytes) -> Any:
            recv.inc(len(data))
            return deser(data) if deser else data

        def count_out(msg: Any) -> bytes:
            data: bytes = ser(msg) if ser else msg
            sent.inc(len(data))
            return data

        kind, behavior = _kind_of(handler)
        return _handler(kind, behavior, count_in, count_out)


class BatchLimitInterceptor(Layer):
    """Refuse, on a worker, keyed memory requests that carry more than ``limit`` ids.

    Upsert, Get, Delete and Reinforce requests over the limit are INVALID_ARGUMENT before
    any work is done; clients split their batches to the limit the slot map publishes.
    """

    def __init__(self, limit: int = DEFAULT_MAX_BATCH_ITEMS) -> None:
        """Refuse requests with more than ``limit`` ids (the worker's ``max_batch_items``)."""
        self.limit = limit
        self._cache = HandlerCache()

    def wrap(
        self, handler: Handler[Req, Resp] | None, details: grpc.HandlerCallDetails
    ) -> Handler[Req, Resp] | None:
        """Wrap keyed memory methods with the size check; pass the others through."""
        method = details.method
        if handler is None or method not in KEYED_METHODS:
            return handler
        return self._cache.get(method, handler, self._limited)

    def _limited(self, handler: Handler[Req, Resp]) -> Handler[Req, Resp]:
        """``handler`` (a unary keyed method) refusing requests over the limit."""
        kind, behavior = _kind_of(handler)
        if kind != "unary_unary":

            @asynccontextmanager
            async def around(request: Any, context: Context) -> AsyncIterator[None]:
                await self._check(request, context)
                yield

            return wrap_handler(handler, around)

        async def call(request: Any, context: Context) -> Any:
            await self._check(request, context)
            return await behavior(request, context)

        return _handler(kind, call, handler.request_deserializer, handler.response_serializer)

    async def _check(self, request: Any, context: Context) -> None:
        error = batch_error(len(request.ids) // 8, self.limit)
        if error is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)


# --- requests that do not parse ---------------------------------------------------------


class UndecodableRequest:
    """Stands for request bytes that did not parse; ``error`` says why (INVALID_ARGUMENT)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        """Keep ``error``, the message the RPC is refused with."""
        self.error = error


def tolerant(parse: Deserializer) -> Deserializer:
    """Wrap a request deserializer so that bytes that do not parse are not an exception.

    Args:
        parse: a message type's ``FromString``.

    Returns:
        ``parse``, except that it returns an ``UndecodableRequest`` where ``parse`` raises
        protobuf's ``DecodeError``.
    """

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return UndecodableRequest(f"request is not a valid message: {exc}")

    return deserialize


async def _refuse(context: Context, request: UndecodableRequest) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)


async def _checked(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, UndecodableRequest):
            await _refuse(context, request)
        yield request


def _one_request(behavior: Behavior) -> Behavior:
    """Wrap a unary-request behavior (unary or server-streaming, generator or coroutine)."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
            if isinstance(request, UndecodableRequest):
                await _refuse(context, request)
            async for reply in behavior(request, context):
                yield reply

        return stream

    async def call(request: Any, context: Context) -> Any:
        if isinstance(request, UndecodableRequest):
            await _refuse(context, request)
        return await behavior(request, context)

    return call


def _request_stream(behavior: Behavior) -> Behavior:
    """Wrap a client-streaming behavior: its request iterator refuses an undecodable one."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(requests: Any, context: Context) -> AsyncIterator[Any]:
            async for reply in behavior(_checked(requests, context), context):
                yield reply

        return stream

    async def call(requests: Any, context: Context) -> Any:
        return await behavior(_checked(requests, context), context)

    return call


class DecodeGuardInterceptor(Layer):
    """Answer INVALID_ARGUMENT, not UNKNOWN, for request bytes that do not parse.

    Bytes that are not a valid message of the method's request type reach the behavior as an
    ``UndecodableRequest``, which aborts the call before the servicer runs. Install it before
    interceptors whose code reads request fields.
    """

    def __init__(self) -> None:
        """Start with no method's handler guarded yet."""
        self._cache = HandlerCache()

    def wrap(
        self, handler: Handler[Req, Resp] | None, details: grpc.HandlerCallDetails
    ) -> Handler[Req, Resp] | None:
        """Give the method's handler a tolerant deserializer and a behavior that refuses."""
        if handler is None or handler.request_deserializer is None:
            return handler
        return self._cache.get(details.method, handler, self._guarded)

    @staticmethod
    def _guarded(handler: Handler[Req, Resp]) -> Handler[Req, Resp]:
        """``handler`` with a tolerant deserializer and a behavior refusing what did not parse."""
        assert handler.request_deserializer is not None  # checked by the caller
        kind, behavior = _kind_of(handler)
        guarded = _one_request(behavior) if kind.startswith("unary_") else _request_stream(behavior)
        return _handler(
            kind, guarded, tolerant(handler.request_deserializer), handler.response_serializer
        )


# --- tokens and roles ---------------------------------------------------------------------


def refusal_handler(
    handler: Handler[Req, Resp],
    code: grpc.StatusCode,
    message: str,
    principal: Principal | None = None,
) -> Handler[Req, Resp]:
    """Build a stand-in for ``handler`` that refuses every call without reading it.

    The stand-in has no request deserializer (the bytes stay bytes) and never reads a
    client-streaming request; it aborts with ``code`` and ``message``.

    Args:
        handler: the method's real handler; only its kind is used.
        code: the refusal's status (UNAUTHENTICATED or PERMISSION_DENIED).
        message: the refusal's details, for the caller.
        principal: the caller, when known, for the request log.

    Returns:
        A handler of the same kind as ``handler``.
    """

    async def refuse(request: Any, context: Context) -> None:
        set_principal(principal)
        await context.abort(code, message)

    kind, _ = _kind_of(handler)
    return _handler(kind, refuse, None, None)


_MISSING_TOKEN = "missing bearer token: pass --token, --token-file or $NEUROSHARD_TOKEN"


def _parse_late(handler: Handler[Req, Resp], bound_method: str | None) -> Handler[Req, Resp]:
    """The handler with its request bytes parsed inside the behavior, not before it.

    A daemon's identity is read from the call's auth context, which only the behavior's
    ``context`` carries; parsing inside the behavior (after ``AuthInterceptor``'s check, which
    runs first) keeps a refused call's bytes unparsed. Bytes that do not parse are
    INVALID_ARGUMENT; a bound method's worker name (``BOUND_FIELDS``) is checked against the
    caller right after parsing.

    Args:
        handler: the method's handler (with its request deserializer).
        bound_method: the Coordinator method's name when its request names a worker.
    """
    kind, behavior = _kind_of(handler)
    deser = handler.request_deserializer
    parse: Deserializer = tolerant(deser) if deser is not None else (lambda data: data)

    async def parsed(raw: bytes, context: Context) -> Any:
        request = parse(raw)
        if isinstance(request, UndecodableRequest):
            await _refuse(context, request)
        caller = current_principal()
        if bound_method is not None and caller is not None:
            denied = bound_name_error(caller, bound_method, request)
            if denied is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, denied)
        return request

    wrapped: Behavior
    if kind.startswith("unary_"):
        if inspect.isasyncgenfunction(behavior):

            async def one_to_stream(raw: bytes, context: Context) -> AsyncIterator[Any]:
                async for reply in behavior(await parsed(raw, context), context):
                    yield reply

            wrapped = one_to_stream
        else:

            async def one(raw: bytes, context: Context) -> Any:
                return await behavior(await parsed(raw, context), context)

            wrapped = one
    else:

        async def requests(raws: AsyncIterator[bytes], context: Context) -> AsyncIterator[Any]:
            async for raw in raws:
                yield await parsed(raw, context)

        if inspect.isasyncgenfunction(behavior):

            async def many_to_stream(raws: Any, context: Context) -> AsyncIterator[Any]:
                async for reply in behavior(requests(raws, context), context):
                    yield reply

            wrapped = many_to_stream
        else:

            async def many(raws: Any, context: Context) -> Any:
                return await behavior(requests(raws, context), context)

            wrapped = many
    return _handler(kind, wrapped, None, handler.response_serializer)


class AuthInterceptor(Layer):
    """Authenticate every RPC but health checks and enforce ``shared.security.auth``'s table.

    A call with a bearer token is a person's or program's: the token (EdDSA signature, expiry,
    lifetime cap, revocation, and an audience this daemon accepts) is checked from the
    metadata before the request is parsed. A call without a token is a daemon's: with TLS the
    identity in the peer's certificate (``shared.security.identity``) names it, read from the
    call's auth context before the servicer runs; without TLS, or with a certificate that
    names no daemon, it is UNAUTHENTICATED. A caller whose role may not call the method
    (``may_call``), or a worker naming another worker in a bound field (``BOUND_FIELDS``), is
    PERMISSION_DENIED. An accepted caller becomes ``current_principal()`` for the servicer;
    a stream authorised by a token ends (UNAUTHENTICATED) when the token expires.
    """

    def __init__(
        self,
        public_key: Ed25519PublicKey,
        audience: str = AUD_COORDINATOR,
        revoked: RevocationList | None = None,
        tls: bool = True,
        cache_size: int = 1024,
    ) -> None:
        """Verify tokens with ``public_key`` for ``audience``, refusing the ``revoked`` ids.

        Args:
            public_key: the coordinator's token-verifying key.
            audience: the token audience this daemon accepts (``tokens.AUD_COORDINATOR`` on
                the coordinator, ``tokens.AUD_DATA`` on a worker).
            revoked: the revocation list (``auth.revoked_file``); None revokes nothing.
            tls: whether the server requires client certificates (daemons are known by
                them); without TLS every call needs a token.
            cache_size: how many verified tokens to remember until they expire.
        """
        self._public_key = public_key
        self._audience = audience
        self._revoked = revoked if revoked is not None else RevocationList(None)
        self._tls = tls
        self._identities = PeerIdentities()
        # Verified tokens until they expire: an Ed25519 check through PyJWT costs ~100-300 us,
        # and a client presents the same token on thousands of calls. Keyed by the whole
        # token (with its signature), so only a token that was verified once can hit; the
        # least recently used is dropped past ``cache_size``.
        self._verified: OrderedDict[str, Principal] = OrderedDict()
        self._cache_size = cache_size
        self._cache = HandlerCache()

    def _verify(self, token: str) -> Principal:
        """Run ``verify_token`` through the cache (a hit is still checked for revocation).

        Raises:
            TokenError: as ``verify_token`` (UNAUTHENTICATED).
        """
        verified = self._verified
        hit = verified.get(token)
        if hit is not None:
            if hit.expires_at > time.time():
                if hit.token_id in self._revoked:
                    raise TokenError(f"token {hit.token_id} is revoked")
                verified.move_to_end(token)
                return hit
            del verified[token]  # expired: verified again below, which refuses it
        principal = verify_token(
            self._public_key, token, audience=self._audience, revoked=self._revoked
        )
        verified[token] = principal
        if len(verified) > self._cache_size:
            verified.popitem(last=False)  # the least recently used
        return principal

    def authorize(
        self, details: grpc.HandlerCallDetails
    ) -> tuple[Principal | None, grpc.StatusCode, str]:
        """Decide on a call that carries a token, from its metadata only.

        Args:
            details: the method name and the invocation metadata with the token.

        Returns:
            ``(principal, OK, "")`` for an accepted caller, else the caller (None when the
            token is missing or invalid), UNAUTHENTICATED or PERMISSION_DENIED, and the
            refusal's message.
        """
        token = bearer_token(details.invocation_metadata)
        if token is None:
            return None, grpc.StatusCode.UNAUTHENTICATED, _MISSING_TOKEN
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
        return principal, *self._permission(principal, details.method)

    @staticmethod
    def _permission(principal: Principal, full_method: str) -> tuple[grpc.StatusCode, str]:
        """OK, or PERMISSION_DENIED and its message, for ``principal`` calling the method."""
        if may_call(principal, full_method):
            return grpc.StatusCode.OK, ""
        return (
            grpc.StatusCode.PERMISSION_DENIED,
            f"{principal.describe()} may not call {method_name(full_method)}",
        )

    def _daemon(
        self, context: Context, full_method: str
    ) -> tuple[Principal | None, grpc.StatusCode, str]:
        """The daemon principal of a call without a token, its status and refusal message.

        Returns:
            ``(principal, OK, "")``, or ``(None, UNAUTHENTICATED or PERMISSION_DENIED, why)``.
        """
        identity = self._identities.of_context(context)
        if identity is None:
            return (
                None,
                grpc.StatusCode.UNAUTHENTICATED,
                _MISSING_TOKEN + " (no daemon identity in the client certificate)",
            )
        principal = Principal(identity.name, identity.kind, math.inf, hosts=identity.hosts)
        code, message = self._permission(principal, full_method)
        return (principal if code is grpc.StatusCode.OK else None), code, message

    def wrap(
        self, handler: Handler[Req, Resp] | None, details: grpc.HandlerCallDetails
    ) -> Handler[Req, Resp] | None:
        """Return a refusing stand-in, or the handler wrapped to set the caller per call.

        Runs on every call: the token (or its absence) is checked per call, never cached
        with the handler.
        """
        full = details.method
        if handler is None or full.startswith(HEALTH_PREFIX):
            return handler
        has_token = bearer_token(details.invocation_metadata) is not None
        principal: Principal | None = None
        if has_token or not self._tls:
            principal, code, message = self.authorize(details)
            if code is not grpc.StatusCode.OK:
                return refusal_handler(handler, code, message, principal)
        return self._cache.get(
            full, handler, lambda h: self._authorized(h, full, principal), key=principal
        )

    def _authorized(
        self, handler: Handler[Req, Resp], full: str, principal: Principal | None
    ) -> Handler[Req, Resp]:
        """``handler`` run as ``principal`` (None: the daemon its certificate names).

        Built once per method and caller (``HandlerCache``): the token was checked for this
        call already; a daemon's certificate is read on every call, from its context.
        """
        method = method_name(full)
        bound = full.startswith(COORDINATOR) and method in BOUND_FIELDS
        kind = _kind_of(handler)[0]
        if principal is None:  # a daemon's call: known once its certificate is read
            handler = _parse_late(handler, method if bound else None)

        async def caller_of(context: Context) -> Principal | None:
            caller = principal
            if caller is None:  # a daemon, known by its certificate
                caller, code, refused = self._daemon(context, full)
                if code is not grpc.StatusCode.OK:
                    await context.abort(code, refused)
            # A worker's bound name is checked in _parse_late, once its request is parsed
            # (tokens are never a worker's).
            set_principal(caller)
            return caller

        if kind == "unary_unary":  # no stream to end at the token's expiry
            behavior = _kind_of(handler)[1]

            async def call(request: Any, context: Context) -> Any:
                await caller_of(context)
                return await behavior(request, context)

            return _handler(kind, call, handler.request_deserializer, handler.response_serializer)

        @asynccontextmanager
        async def around(request: Any, context: Context) -> AsyncIterator[None]:
            caller = await caller_of(context)
            if caller is None or math.isinf(caller.expires_at):
                yield
                return
            try:
                async with asyncio.timeout(caller.expires_at - time.time()):
                    yield
            except TimeoutError:
                expired = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(caller.expires_at))
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED, f"token expired at {expired}: stream ended"
                )

        return wrap_handler(handler, around)


def auth_interceptor(security: DaemonSecurity) -> AuthInterceptor | None:
    """A daemon's ``AuthInterceptor`` (tokens and certificates), or None without auth.

    Args:
        security: the daemon's security (``DaemonSecurity.from_config``): the public key,
            the token audience it accepts, its revocation list, whether it runs TLS.
    """
    if security.public_key is None:
        return None
    return AuthInterceptor(
        security.public_key, security.audience, security.revoked, tls=security.tls is not None
    )


def server_interceptors(
    metrics: Metrics,
    auth: AuthInterceptor | None,
    worker_name: str | None = None,
    max_batch_items: int | None = None,
) -> list[aio.ServerInterceptor]:
    """Build a daemon's interceptor chain, outermost first.

    The request log sees every outcome (refusals included); request bytes are checked to
    parse before anything reads a field; the caller (when ``auth`` is given: auth is on)
    before any work; on a worker (``max_batch_items`` set), keyed memory batches over the
    limit are refused before the servicer runs.

    Args:
        metrics: the daemon's metrics (rpc counts and bytes).
        auth: the daemon's ``AuthInterceptor`` (``auth_interceptor``), or None without auth.
        worker_name: this worker's name for log lines (None on the coordinator).
        max_batch_items: a worker's ``max_batch_items`` (None on the coordinator).

    Returns:
        The interceptors, for ``grpc.aio.server(interceptors=...)``: one ``ChainInterceptor``
        running the layers (grpc.aio's interceptor pipeline costs a pass per interceptor
        per call, which a one-id read felt).
    """
    layers: list[Layer] = [
        RequestLogInterceptor(metrics, worker_name=worker_name),
        DecodeGuardInterceptor(),
    ]
    if auth is not None:
        layers.append(auth)
    if max_batch_items is not None:
        layers.append(BatchLimitInterceptor(max_batch_items))
    layers.append(MetricsInterceptor(metrics))
    return [ChainInterceptor(layers)]


class ChainInterceptor(aio.ServerInterceptor):
    """A chain of interceptors run as one: a single pass of grpc.aio's interceptor pipeline.

    grpc.aio runs each interceptor of a server through its pipeline on every call (a
    coroutine and a continuation per interceptor); here the method's handler is looked up
    once and each layer's ``wrap`` applied to it, innermost first. Each call is what the
    separate interceptors made of it: the same checks in the same order (the request log
    outermost, the caller's token verified on every call), and each layer reuses the
    wrappers it built (``HandlerCache``).
    """

    def __init__(self, layers: list[Layer]) -> None:
        """Run ``layers``, outermost first (as ``grpc.aio.server(interceptors=...)`` would)."""
        self._inner_first = tuple(reversed(layers))

    async def intercept_service(
        self, continuation: Continuation[Req, Resp], handler_call_details: grpc.HandlerCallDetails
    ) -> Handler[Req, Resp] | None:
        """The method's handler wrapped by every layer, innermost first."""
        handler = await continuation(handler_call_details)
        for layer in self._inner_first:
            handler = layer.wrap(handler, handler_call_details)
        return handler
