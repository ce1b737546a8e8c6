"""Channels and stubs to workers, one per worker name.

Used by the coordinator (fan-out of bulk operations, slot hand-over), by primaries forwarding
writes to their replicas, and by the client routing keyed memory operations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpc import aio

from shared import rpc
from shared.proto import worker_pb2_grpc

if TYPE_CHECKING:
    from shared.security.transport import ChannelSecurity


class WorkerClients:
    """A cache of ``WorkerStub``s keyed by worker name; a new address replaces the channel.

    A worker restarted on another port keeps its name: its old channel is closed only in
    ``close()``, since calls on it may still be in flight.
    """

    def __init__(self, max_message_bytes: int, security: ChannelSecurity | None = None) -> None:
        """Open channels with ``max_message_bytes`` limits and ``security`` (None: plaintext)."""
        self._max_message_bytes = max_message_bytes
        self.security = security  # TLS and token of every channel opened here
        self._by_name: dict[str, tuple[str, aio.Channel, worker_pb2_grpc.WorkerStub]] = {}
        self._closing: list[aio.Channel] = []

    def stub(self, name: str, address: str) -> worker_pb2_grpc.WorkerStub:
        """Return the stub for worker ``name`` at ``address``, opening a channel if needed.

        Args:
            name: the worker's name (the cache key).
            address: ``host:port`` the worker serves on now; a different address than the
                cached one opens a new channel.
        """
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
        """Return the channel behind ``stub(name, address)``, for the health service's stub."""
        self.stub(name, address)
        return self._by_name[name][1]

    async def close(self) -> None:
        """Close every channel, including those replaced by a new address."""
        channels = [c for _, c, _ in self._by_name.values()] + self._closing
        self._by_name.clear()
        self._closing = []
        for ch in channels:
            await ch.close()
