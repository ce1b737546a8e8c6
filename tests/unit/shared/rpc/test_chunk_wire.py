"""Serialized chunk messages written by hand parse to the messages protobuf would make."""

from __future__ import annotations

import numpy as np
import pytest

from shared.proto import worker_pb2
from shared.rpc.chunk_wire import serialized_chunk_messages, varint
from shared.rpc.codec import ChunkAssembler, tensors_to_messages

TENSORS = [
    ("w", np.arange(1000, dtype=np.float32).reshape(10, 100)),  # 4000 bytes: 4 chunks of 1024
    ("b", np.array([-0.0, np.inf, np.nan, 1e-45], np.float32)),
    ("scalar", np.array(3.5, np.float64)),  # 0-d
    ("empty", np.zeros((0, 64), np.float32)),  # one empty chunk
    ("big_endian", np.arange(7, dtype=">i8")),
    ("strided", np.arange(24, dtype=np.int16).reshape(4, 6)[:, ::2]),
    ("flags", np.array([True, False, True])),
]


def test_the_messages_parse_to_what_tensors_to_messages_makes() -> None:
    # Arrange
    expected = list(tensors_to_messages(TENSORS, 1024, worker_pb2.GradientRequest, "param"))

    # Act
    raw = list(serialized_chunk_messages(TENSORS, 1024, 2))

    # Assert
    got = [worker_pb2.GradientRequest.FromString(r) for r in raw]
    assert got == expected
    assert [m.param.offset for m in got[:4]] == [0, 1024, 2048, 3072]


def test_the_chunks_reassemble_to_the_arrays() -> None:
    assembler = ChunkAssembler()

    for r in serialized_chunk_messages(TENSORS, 1000, 2):
        assembler.add(worker_pb2.GradientRequest.FromString(r).param)

    out = assembler.result()
    for name, a in TENSORS:
        np.testing.assert_array_equal(out[name], a)
        assert out[name].shape == a.shape


@pytest.mark.parametrize(
    ("n", "encoded"),
    [(0, b"\x00"), (1, b"\x01"), (127, b"\x7f"), (128, b"\x80\x01"), (300, b"\xac\x02")],
)
def test_varint_is_protobufs(n: int, encoded: bytes) -> None:
    assert varint(n) == encoded  # https://protobuf.dev/programming-guides/encoding/


def test_a_field_number_over_15_is_refused() -> None:
    with pytest.raises(ValueError, match="field_number"):
        list(serialized_chunk_messages(TENSORS, 1024, 16))
