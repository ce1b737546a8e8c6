"""Frames between the worker daemon and its training child: both ends, payloads, closing."""

from __future__ import annotations

import asyncio
import io

import pytest

from worker.allreduce.child_pipe import AsyncPipe, BlockingPipe, Frame, PipeClosed


def test_blocking_pipe_round_trips_fields_and_payload() -> None:
    # Arrange
    out = io.BytesIO()
    BlockingPipe(io.BytesIO(), out).write(Frame("state", {"step": 7, "reason": "epoch"}, b"\0\n1"))
    BlockingPipe(io.BytesIO(), out).write(Frame("stop"))
    reader = BlockingPipe(io.BytesIO(out.getvalue()), io.BytesIO())
    # Act
    first, second = reader.read(), reader.read()
    # Assert
    assert (first.type, first.fields, first.payload) == (
        "state",
        {"step": 7, "reason": "epoch"},
        b"\0\n1",
    )
    assert (second.type, second.fields, second.payload) == ("stop", {}, b"")
    with pytest.raises(PipeClosed):
        reader.read()


def test_a_payload_cut_short_is_a_closed_pipe() -> None:
    data = Frame("state", {}, b"abcdef").encode()[:-2]
    with pytest.raises(PipeClosed, match="inside a payload"):
        BlockingPipe(io.BytesIO(data), io.BytesIO()).read()


@pytest.mark.parametrize(
    "line", [b"[1, 2]\n", b'{"no": "type"}\n', b'{"type": "x", "nbytes": -1}\n']
)
def test_a_line_that_is_not_a_frame_is_refused(line: bytes) -> None:
    with pytest.raises(ValueError):
        BlockingPipe(io.BytesIO(line), io.BytesIO()).read()


async def test_async_pipe_reads_what_the_child_writes() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(
        Frame("progress", {"step": 3}).encode() + Frame("ready", {"port": 1}, b"xy").encode()
    )
    reader.feed_eof()
    pipe = AsyncPipe(reader, writer=None)  # type: ignore[arg-type]  # reads only

    assert (await pipe.read()).fields == {"step": 3}
    frame = await pipe.read()
    assert (frame.type, frame.payload) == ("ready", b"xy")
    with pytest.raises(PipeClosed):
        await pipe.read()
