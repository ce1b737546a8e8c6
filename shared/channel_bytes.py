"""``CountingChannel``: a grpc.aio channel that counts the serialized bytes of its calls.

A daemon's own calls (the coordinator's to the workers, a worker's heartbeats and its copies
to its replicas) go through its ``ChannelSecurity``; with ``wire`` set, every channel it opens
is wrapped in one of these, so ``neuroshard_rpc_client_sent_bytes_total`` and
``_received_bytes_total`` count what the daemon sent and received as a client, as the server
interceptor (``shared.rpc.interceptors.MetricsInterceptor``) counts what it serves. Counting
wraps the stubs' serializers: one ``len`` per message, no second serialization. Health checks
are not counted (the server side does not count them either).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from grpc import aio

from shared.delegating_channel import DelegatingChannel

Req = TypeVar("Req")
Resp = TypeVar("Resp")
HEALTH_PREFIX = "/grpc.health.v1.Health/"


class WireBytes(Protocol):
    """Where a channel's bytes are counted (``shared.metrics.Metrics`` is one)."""

    def client_bytes(self, method: str) -> tuple[Callable[[int], None], Callable[[int], None]]:
        """``(count sent, count received)`` for RPC ``method`` (its short name)."""
        ...


def _counted(
    wire: WireBytes,
    method: str,
    serialize: Callable[[Any], bytes] | None,
    deserialize: Callable[[bytes], Any] | None,
) -> tuple[Callable[[Any], bytes] | None, Callable[[bytes], Any] | None]:
    """The stub's (de)serializers, wrapped to count the bytes they produce and read."""
    if serialize is None or deserialize is None or method.startswith(HEALTH_PREFIX):
        return serialize, deserialize
    sent, received = wire.client_bytes(method.rsplit("/", 1)[-1])
    ser, deser = serialize, deserialize

    def count_out(msg: Any) -> bytes:
        data = ser(msg)
        sent(len(data))
        return data

    def count_in(data: bytes) -> Any:
        received(len(data))
        return deser(data)

    return count_out, count_in


class CountingChannel(DelegatingChannel):
    """Wraps a grpc.aio channel; every call's request and response bytes are counted.

    Like ``shared.security.transport.TokenChannel``, it wraps the multi-callables' factories
    (a function call per message) instead of using client interceptors (an extra task per
    call); everything else is delegated to the wrapped channel.
    """

    def __init__(self, channel: aio.Channel, wire: WireBytes) -> None:
        """Wrap ``channel``; bytes go to ``wire.client_bytes(method)``."""
        super().__init__(channel)
        self._wire = wire

    def unary_unary(
        self,
        method: str,
        request_serializer: Callable[[Req], bytes] | None = None,
        response_deserializer: Callable[[bytes], Resp] | None = None,
        **kwargs: Any,
    ) -> aio.UnaryUnaryMultiCallable[Req, Resp]:
        """The wrapped channel's multi-callable, its (de)serializers counting bytes."""
        ser, deser = _counted(self._wire, method, request_serializer, response_deserializer)
        return self._channel.unary_unary(method, ser, deser, **kwargs)

    def unary_stream(
        self,
        method: str,
        request_serializer: Callable[[Req], bytes] | None = None,
        response_deserializer: Callable[[bytes], Resp] | None = None,
        **kwargs: Any,
    ) -> aio.UnaryStreamMultiCallable[Req, Resp]:
        """The wrapped channel's multi-callable, its (de)serializers counting bytes."""
        ser, deser = _counted(self._wire, method, request_serializer, response_deserializer)
        return self._channel.unary_stream(method, ser, deser, **kwargs)

    def stream_unary(
        self,
        method: str,
        request_serializer: Callable[[Req], bytes] | None = None,
        response_deserializer: Callable[[bytes], Resp] | None = None,
        **kwargs: Any,
    ) -> aio.StreamUnaryMultiCallable[Req, Resp]:
        """The wrapped channel's multi-callable, its (de)serializers counting bytes."""
        ser, deser = _counted(self._wire, method, request_serializer, response_deserializer)
        return self._channel.stream_unary(method, ser, deser, **kwargs)

    def stream_stream(
        self,
        method: str,
        request_serializer: Callable[[Req], bytes] | None = None,
        response_deserializer: Callable[[bytes], Resp] | None = None,
        **kwargs: Any,
    ) -> aio.StreamStreamMultiCallable[Req, Resp]:
        """The wrapped channel's multi-callable, its (de)serializers counting bytes."""
        ser, deser = _counted(self._wire, method, request_serializer, response_deserializer)
        return self._channel.stream_stream(method, ser, deser, **kwargs)
