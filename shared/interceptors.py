"""Server interceptors that run code around each RPC, and the per-RPC request log.

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
from grpc import aio

from shared.logging import get_logger
from shared.metrics import Metrics

Around = Callable[[Any, aio.ServicerContext], AbstractAsyncContextManager[None]]
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]
HEALTH_PREFIX = "/grpc.health."

log = get_logger("rpc")


def method_name(full: str) -> str:
    """``/neuroshard.v1.Worker/Upsert`` -> ``Upsert``."""
    return full.rsplit("/", 1)[-1]


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
        from shared.auth import current_principal

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
