"""A stand-in for ``grpc.aio.ServicerContext`` in unit tests of servicers (no network).

``FakeContext.abort`` records the status and raises ``Aborted``, as grpc.aio's raises
``AbortError``; ``outcome`` runs a unary or streaming handler to its end and returns the
status it ended with (None: it answered).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from typing import Any

import grpc


class Aborted(Exception):
    """Raised by ``FakeContext.abort`` (grpc.aio raises ``AbortError``)."""


class FakeContext:
    """What the servicers use of a call's context: ``abort`` and ``peer``."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing_metadata: tuple[tuple[str, str], ...] = ()

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.code, self.details = code, details
        self.trailing_metadata = tuple(trailing_metadata)
        raise Aborted(f"{code.name}: {details}")

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"


async def outcome(call: Any, context: FakeContext) -> tuple[grpc.StatusCode | None, str]:
    """Run a handler's call (a coroutine, or an async generator: drained) to its end.

    Returns:
        The status code and message it aborted with; (None, "") when it answered.
    """
    with contextlib.suppress(Aborted):
        if inspect.isasyncgen(call):
            async for _ in call:
                pass
        else:
            await call
    return context.code, context.details
