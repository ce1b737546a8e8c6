"""``shared.rpc.status_table``: the one helper every servicer maps its domain errors with."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from shared.rpc.status_table import BadRequest, Status, StatusTable, message_of
from tests.fake_context import FakeContext, outcome

SC = grpc.StatusCode


class Base(Exception):
    pass


class Sub(Base):
    pass


class Missing(KeyError):
    pass


class Relayed(Exception):
    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


TABLE = StatusTable(
    [
        (BadRequest, SC.INVALID_ARGUMENT),
        (Sub, SC.FAILED_PRECONDITION),  # before its base: the first match wins
        (Base, SC.UNAVAILABLE),
        (Missing, SC.NOT_FOUND),
        (Relayed, lambda e: Status(e.code, (("grpc-retry-pushback-ms", "250"),))),
    ]
)


async def unary(context: Any, exc: BaseException | None) -> str:
    """A unary handler's body: raises ``exc`` inside the table's mapping, else answers."""
    async with TABLE.mapped(context):
        if exc is not None:
            raise exc
        return "answer"


@pytest.mark.parametrize(
    ("exc", "code", "message"),
    [
        (BadRequest("k: must be positive"), SC.INVALID_ARGUMENT, "k: must be positive"),
        (Sub("sub"), SC.FAILED_PRECONDITION, "sub"),
        (Base("base"), SC.UNAVAILABLE, "base"),
        (Missing("no job with id 'j'"), SC.NOT_FOUND, "no job with id 'j'"),  # unquoted
        (Relayed("FetchShard: gone", SC.NOT_FOUND), SC.NOT_FOUND, "FetchShard: gone"),
    ],
)
async def test_a_mapped_exception_ends_the_call_with_its_status_and_message(
    exc: Exception, code: grpc.StatusCode, message: str
) -> None:
    context = FakeContext()

    assert await outcome(unary(context, exc), context) == (code, message)


async def test_a_computed_status_carries_its_trailing_metadata() -> None:
    context = FakeContext()

    await outcome(unary(context, Relayed("held down", SC.UNAVAILABLE)), context)

    assert context.trailing_metadata == (("grpc-retry-pushback-ms", "250"),)


async def test_an_exception_the_table_does_not_name_propagates_untouched() -> None:
    context = FakeContext()

    with pytest.raises(RuntimeError, match="a bug"):
        await unary(context, RuntimeError("a bug"))
    with pytest.raises(asyncio.CancelledError):
        await unary(context, asyncio.CancelledError())
    assert context.code is None


async def test_an_answer_passes_through() -> None:
    assert await unary(FakeContext(), None) == "answer"


async def test_a_streaming_handler_is_mapped_around_its_yields_and_closes_cleanly() -> None:
    closed: list[bool] = []

    async def stream(context: Any, fail: bool) -> AsyncIterator[int]:
        async with TABLE.mapped(context):
            try:
                yield 1
                if fail:
                    raise Base("after the first message")
                yield 2
            finally:
                closed.append(True)

    failing, cancelled = FakeContext(), FakeContext()

    assert await outcome(stream(failing, fail=True), failing) == (
        SC.UNAVAILABLE,
        "after the first message",
    )
    gen = stream(cancelled, fail=False)
    assert await anext(gen) == 1
    await gen.aclose()  # a cancelled call: GeneratorExit passes, nothing aborts
    assert closed == [True, True] and cancelled.code is None


def test_message_of_unquotes_a_key_error_only() -> None:
    assert message_of(KeyError("no worker named 'w'")) == "no worker named 'w'"
    assert message_of(ValueError("rows: bad")) == "rows: bad"
    assert message_of(KeyError()) == ""
