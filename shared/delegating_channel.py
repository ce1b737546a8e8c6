"""``DelegatingChannel``: an ``aio.Channel`` that hands everything to the channel it wraps.

The base of the channel wrappers that change only how multi-callables are made (the bearer
token's ``shared.security.transport.TokenChannel``, the byte counters'
``shared.channel_bytes.CountingChannel``): the lifecycle and connectivity calls are the wrapped
channel's.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

import grpc
from grpc import aio


class DelegatingChannel(aio.Channel):
    """Closing, connectivity and the context manager go to the wrapped channel.

    Subclasses define the four multi-callable factories (``unary_unary`` ...).
    """

    def __init__(self, channel: aio.Channel) -> None:
        """Wrap ``channel``."""
        self._channel = channel

    async def close(self, grace: float | None = None) -> None:
        """Close the wrapped channel; calls still running get ``grace`` seconds to finish."""
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        """Return the wrapped channel's connectivity state."""
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        """Wait until the wrapped channel leaves ``last_observed_state``."""
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        """Wait until the wrapped channel is READY."""
        await self._channel.channel_ready()

    async def __aenter__(self) -> Self:
        """Use the channel as an async context manager that closes it on exit."""
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        """Close the wrapped channel."""
        await self._channel.close()
