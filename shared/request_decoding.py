"""Refuse request bytes that do not parse as the method's message with INVALID_ARGUMENT.

grpc.aio parses a request with the handler's ``request_deserializer`` before any servicer
code runs; a ``DecodeError`` there (a corrupt or truncated message, bad UTF-8 in a string
field) ends the RPC as UNKNOWN "Unexpected DecodeError", which reads as a server bug. This
interceptor makes the deserializer return an ``UndecodableRequest`` instead, and the RPC's
behavior aborts with INVALID_ARGUMENT naming the message type before anything else sees it.
For client-streaming RPCs the check runs as the servicer reads each message, so the messages
before the bad one are read as usual (the servicer validates them first, as always).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from shared.interceptors import Continuation


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
