"""Channels and stubs to workers, one per worker address (used by the coordinator, by
primaries forwarding to replicas, and by the client)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpc import aio

from shared import rpc
from shared.proto import worker_pb2_grpc

if TYPE_CHECKING:
    from shared.security.transport import ChannelSecurity


class WorkerClients:
    """A cache of ``WorkerStub``s keyed by worker name; a new address replaces the channel."""

    def __init__(self, max_message_bytes: int, security: ChannelSecurity | None = None) -> None:
        self._max_message_bytes = max_message_bytes
        self.security = security  # TLS and token of every channel opened here
        self._by_name: dict[str, tuple[str, aio.Channel, worker_pb2_grpc.WorkerStub]] = {}
        self._closing: list[aio.Channel] = []

    def stub(self, name: str, address: str) -> worker_pb2_grpc.WorkerStub:
        """The WorkerStub for ``name`` at ``address`` (a new address replaces the channel)."""
        cached = self._by_name.get(name)
        if cached is not None and cached[0] == address:
            return cached[2]
        if cached is not None:
            self._closing.append(cached[1])
        ch = rpc.channel(address, self._max_message_bytes, self.security)
        stub = worker_pb2_grpc.WorkerStub(ch)
        self._by_name[name] = (address, ch, stub)
        return stub

    def channel(self, name: str, address: str) -> aio.Channel:
        """The channel behind ``stub(name, address)`` (for the health service)."""
        self.stub(name, address)
        return self._by_name[name][1]

    async def close(self) -> None:
        """Close every channel."""
        channels = [c for _, c, _ in self._by_name.values()] + self._closing
        self._by_name.clear()
        self._closing = []
        for ch in channels:
            await ch.close()
