"""The blocking client's direct path: one keyed request sent on a synchronous gRPC channel.

``SyncClient`` wraps the async ``Client`` with its own event loop; every call through it
costs a loop run and grpc.aio's per-call tasks, about as much as the round trip itself for a
one-id read. A request whose ids all belong to one primary in the cached slot map (e.g. any
single id) is sent here instead, on a plain ``grpc`` channel from the calling thread. Anything
else, and any retryable failure (a stale map, a failover), goes the async router's way, which
refreshes the map, retries and reports unreachable workers; a write keeps its request id
through that fallback, so the workers' de-duplication still applies it once.

Shape letters: N items of a request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias, TypeVar

import grpc
import numpy as np
import numpy.typing as npt

from shared.memory.slots import slot_of
from shared.proto import common_pb2, worker_pb2
from shared.rpc import message_options
from shared.security.transport import ChannelSecurity

Reply = TypeVar("Reply")
Req = TypeVar("Req")
Resp = TypeVar("Resp")
Metadata: TypeAlias = tuple[tuple[str, str], ...]

# Statuses after which the async router takes over (it refreshes the map and retries)
FALLBACK = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)


class BlockingStub:
    """The keyed memory RPCs of one worker on a blocking channel.

    The generated ``WorkerStub`` is typed for grpc.aio channels only.
    """

    def __init__(self, channel: grpc.Channel) -> None:
        """Make the four multi-callables on ``channel``."""
        self.Upsert = _unary(channel, "Upsert", worker_pb2.UpsertRequest, worker_pb2.WriteResponse)
        self.Reinforce = _unary(
            channel, "Reinforce", worker_pb2.ReinforceRequest, worker_pb2.WriteResponse
        )
        self.Delete = _unary(channel, "Delete", worker_pb2.DeleteRequest, worker_pb2.WriteResponse)
        self.Get = _unary(channel, "Get", worker_pb2.GetRequest, worker_pb2.GetResponse)


def _unary(
    channel: grpc.Channel, method: str, request: type[Req], reply: type[Resp]
) -> grpc.UnaryUnaryMultiCallable[Req, Resp]:
    """The blocking multi-callable of ``neuroshard.v1.Worker/<method>``."""
    return channel.unary_unary(  # type: ignore[call-arg]  # the stubs lack the keyword
        f"/neuroshard.v1.Worker/{method}",
        request_serializer=request.SerializeToString,  # type: ignore[attr-defined]
        response_deserializer=reply.FromString,  # type: ignore[attr-defined]
        _registered_method=True,
    )


# One direct call: (worker's blocking stub, map epoch, call metadata) -> its reply
DirectCall: TypeAlias = Callable[[BlockingStub, int, Metadata], Reply]


class DirectFailed(Exception):
    """A direct call failed with a status the async router would not retry either.

    ``code`` and ``details`` are the worker's (e.g. INVALID_ARGUMENT naming the field).
    """

    def __init__(self, details: str, code: grpc.StatusCode) -> None:
        """Keep ``code`` beside the details."""
        super().__init__(details)
        self.code = code


def _open_blocking(
    address: str, options: list[tuple[str, int | str]], security: ChannelSecurity | None
) -> grpc.Channel:
    """A blocking channel to ``address`` with ``security``'s TLS (the token goes per call)."""
    tls = security.tls if security is not None else None
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    options = list(options)
    if security is not None and security.server_name:
        options.append(("grpc.ssl_target_name_override", security.server_name))
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


class DirectPath:
    """Blocking channels to the workers, one per name, and the one-primary routing check."""

    def __init__(self, max_message_bytes: int, security: ChannelSecurity | None) -> None:
        """Open channels lazily with ``max_message_bytes`` limits and ``security``.

        Args:
            max_message_bytes: message limit of every channel, bytes.
            security: TLS files and token (the router's ``worker_security``: the data-plane
                token of its map); None is plaintext without a token.
        """
        self._options = message_options(max_message_bytes)
        self._security = security
        self._channels: dict[str, tuple[str, grpc.Channel, BlockingStub]] = {}
        self._map: common_pb2.SlotMap | None = None
        self._primary_S: npt.NDArray[np.int64] = np.empty(0, np.int64)

    def owner(self, m: common_pb2.SlotMap | None, ids: npt.NDArray[np.uint64]) -> int | None:
        """The index in ``m.workers`` of the one primary of every id, or None.

        None when there is no usable map, the ids are spread over several primaries (or
        none), or there are more of them than a worker takes in one request.

        Args:
            m: the slot map routed with (the async router's cached map).
            ids: [N] uint64.
        """
        if m is None or m.epoch == 0 or m.slots == 0 or not len(ids):
            return None
        if m.max_batch_items and len(ids) > m.max_batch_items:
            return None
        if m is not self._map:  # the same map object until the router refreshes it
            self._map, self._primary_S = m, np.asarray(m.primary, np.int64)
        owner_N = self._primary_S[slot_of(ids, m.slots)]
        w = int(owner_N[0])
        if w < 0 or (len(owner_N) > 1 and bool(np.any(owner_N != w))):
            return None
        return w

    def call(self, m: common_pb2.SlotMap, w: int, send: DirectCall[Reply]) -> Reply | None:
        """Send one request to worker ``w`` of map ``m``; None when the router should retry.

        Args:
            m: the slot map routed with.
            w: the worker's index in ``m.workers``.
            send: makes the call: ``send(stub, epoch, metadata)``.

        Returns:
            The reply, or None after a status the async router retries (FAILED_PRECONDITION,
            UNAVAILABLE, ABORTED, DEADLINE_EXCEEDED).

        Raises:
            DirectFailed: any other status (INVALID_ARGUMENT, PERMISSION_DENIED, ...).
        """
        stub = self._stub(m.workers[w], m.addresses[w])
        token = self._security.token if self._security is not None else None
        metadata: Metadata = (("authorization", "Bearer " + token()),) if token else ()
        try:
            return send(stub, m.epoch, metadata)
        except grpc.RpcError as exc:
            code: grpc.StatusCode = exc.code()
            if code in FALLBACK:
                return None
            raise DirectFailed(exc.details() or code.name, code) from None

    def _stub(self, name: str, address: str) -> BlockingStub:
        """The blocking stub of worker ``name`` at ``address`` (a new address: a new channel)."""
        cached = self._channels.get(name)
        if cached is not None and cached[0] == address:
            return cached[2]
        if cached is not None:
            cached[1].close()
        ch = self._open(address)
        stub = BlockingStub(ch)
        self._channels[name] = (address, ch, stub)
        return stub

    def _open(self, address: str) -> grpc.Channel:
        """A blocking channel to ``address`` with the client's TLS (the token goes per call)."""
        return _open_blocking(address, self._options, self._security)

    def close(self) -> None:
        """Close every channel."""
        for _, ch, _ in self._channels.values():
            ch.close()
        self._channels.clear()


class CoordinatorPath:
    """A blocking channel to the coordinator for the one-shot reads of ``SyncClient``.

    ``Quality`` and ``TopK`` through the async client cost the caller a loop run and
    grpc.aio's per-call tasks, about as much client CPU as the coordinator's fan-out itself;
    here they are one blocking call from the calling thread, with the client's TLS and token.
    UNAVAILABLE goes back to the async channel, which gRPC retries with backoff.
    """

    def __init__(
        self, address: str, max_message_bytes: int, security: ChannelSecurity | None
    ) -> None:
        """Dial ``address`` lazily with ``max_message_bytes`` limits and ``security``."""
        self._options = message_options(max_message_bytes)
        self._address = address
        self._security = security
        self._channel: grpc.Channel | None = None
        self._calls: dict[str, grpc.UnaryUnaryMultiCallable[Any, Any]] = {}

    def call(self, method: str, request: Req, reply: type[Resp], timeout_s: float) -> Resp | None:
        """Call ``neuroshard.v1.Coordinator/<method>``; None after UNAVAILABLE.

        Args:
            method: the RPC's name (``Quality``, ``TopK``).
            request: its request message.
            reply: its reply message type.
            timeout_s: the call's deadline, seconds.

        Raises:
            DirectFailed: any other status than OK and UNAVAILABLE (INVALID_ARGUMENT,
                NOT_FOUND, PERMISSION_DENIED, DEADLINE_EXCEEDED, ...).
        """
        multi = self._calls.get(method)
        if multi is None:
            if self._channel is None:
                self._channel = _open_blocking(self._address, self._options, self._security)
            multi = self._calls[method] = self._channel.unary_unary(  # type: ignore[call-arg]
                f"/neuroshard.v1.Coordinator/{method}",
                request_serializer=type(request).SerializeToString,  # type: ignore[attr-defined]
                response_deserializer=reply.FromString,  # type: ignore[attr-defined]
                _registered_method=True,
            )
        token = self._security.token if self._security is not None else None
        metadata: Metadata = (("authorization", "Bearer " + token()),) if token else ()
        try:
            answer: Resp = multi(request, timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            code: grpc.StatusCode = exc.code()
            if code is grpc.StatusCode.UNAVAILABLE:
                return None
            raise DirectFailed(exc.details() or code.name, code) from None
        return answer

    def close(self) -> None:
        """Close the channel."""
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._calls.clear()
