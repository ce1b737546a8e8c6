"""The training child's outbox: frames written in order by a thread, a failed write reported."""

from __future__ import annotations

import io

from worker.allreduce.allreduce_child import _Outbox
from worker.allreduce.child_pipe import BlockingPipe, Frame


def test_frames_and_frames_made_later_are_written_in_the_order_queued() -> None:
    # Arrange
    out = io.BytesIO()
    outbox = _Outbox(BlockingPipe(io.BytesIO(), out))
    # Act: a progress frame, a state made on the writer thread, another progress frame.
    outbox.put(Frame("progress", {"step": 15}))
    outbox.put(lambda: Frame("state", {"step": 15, "reason": "epoch"}, b"model"))
    outbox.put(Frame("progress", {"step": 30}))
    error = outbox.close()
    # Assert
    reader = BlockingPipe(io.BytesIO(out.getvalue()), io.BytesIO())
    frames = [reader.read() for _ in range(3)]
    assert error is None
    assert [(f.type, f.fields["step"], f.payload) for f in frames] == [
        ("progress", 15, b""),
        ("state", 15, b"model"),
        ("progress", 30, b""),
    ]


def test_a_frame_that_cannot_be_made_stops_the_writes_and_is_reported() -> None:
    # Arrange
    out = io.BytesIO()
    outbox = _Outbox(BlockingPipe(io.BytesIO(), out))

    def broken() -> Frame:
        raise RuntimeError("no bytes")

    # Act
    outbox.put(Frame("progress", {"step": 1}))
    outbox.put(broken)
    outbox.put(Frame("progress", {"step": 2}))  # after a lost frame: not written
    error = outbox.close()
    # Assert
    reader = BlockingPipe(io.BytesIO(out.getvalue()), io.BytesIO())
    assert isinstance(error, RuntimeError) and str(error) == "no bytes"
    assert reader.read().fields == {"step": 1}
    assert out.getvalue().count(b"\n") == 1
