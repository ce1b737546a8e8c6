"""shared/rpc/codec.py, the seam both daemons' streams go through: round trips of every dtype the
receiver accepts (through chunk streams split at awkward sizes), little-endian bytes pinned
with literals, and each ``CodecError`` with its message. ``test_fuzz_decoders.py`` fuzzes the
same decoders with hostile bytes; this file pins what valid traffic looks like."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

import numpy as np
import pytest

from shared.proto import common_pb2, worker_pb2
from shared.rpc.codec import (
    ChunkAssembler,
    CodecError,
    f32_from_bytes,
    f32_to_bytes,
    ids_from_bytes,
    ids_to_bytes,
    read_header_and_tensors,
    rows_from_bytes,
    rows_to_bytes,
    tensor_to_chunks,
    tensors_to_chunks,
)

WIRE_DTYPES = [
    "float16",
    "float32",
    "float64",
    "int8",
    "int32",
    "int64",
    "uint8",
    "uint32",
    "uint64",
    "bool",
]
SHAPES = [(), (0,), (7,), (3, 5), (2, 0, 3), (2, 3, 4)]


def sample(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Values that use every byte of the dtype (negative, large, fractional where it can)."""
    n = int(np.prod(shape))
    if dtype == "bool":
        return (np.arange(n) % 3 == 0).reshape(shape)
    info = np.finfo(dtype) if dtype.startswith("float") else np.iinfo(dtype)
    values = np.linspace(float(info.min) / 3, float(info.max) / 3, n) if n else np.zeros(0)
    return values.astype(dtype).reshape(shape)


def assemble(chunks: Iterable[common_pb2.TensorChunk]) -> dict[str, np.ndarray]:
    assembler = ChunkAssembler()
    for chunk in chunks:
        # Through the wire format, as a peer receives it.
        assembler.add(common_pb2.TensorChunk.FromString(chunk.SerializeToString()))
    return assembler.result()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", WIRE_DTYPES)
@pytest.mark.parametrize("chunk_bytes", [1, 5, 1 << 20])
def test_every_wire_dtype_round_trips_through_chunks(dtype, shape, chunk_bytes) -> None:
    # Arrange
    array = sample(dtype, shape)

    # Act
    chunks = list(tensor_to_chunks("t", array, chunk_bytes))
    got = assemble(chunks)["t"]

    # Assert: same dtype, shape and bits; a writable copy; chunks within the size.
    assert (got.dtype.name, got.shape) == (dtype, shape)
    assert got.tobytes() == array.tobytes()
    assert got.flags.writeable and not np.shares_memory(got, array)
    assert all(len(c.data) <= chunk_bytes for c in chunks)
    assert [c.offset for c in chunks] == list(np.cumsum([0] + [len(c.data) for c in chunks])[:-1])
    assert {c.total_bytes for c in chunks} == {array.nbytes}
    assert len(chunks) == max(1, -(-array.nbytes // chunk_bytes))


def test_bytes_on_the_wire_are_little_endian() -> None:
    # Literals: float32 1.0 is 0x3f800000, int64 -2 is all ones but the lowest bit.
    (f32,) = tensor_to_chunks("x", np.array([1.0, -0.5], np.float32), 64)
    (i64,) = tensor_to_chunks("x", np.array([1, -2], np.int64), 64)
    (big,) = tensor_to_chunks("x", np.array([1, 258], ">u4"), 64)  # big-endian in memory

    assert f32.data == bytes.fromhex("0000803f000000bf")
    assert i64.data == bytes.fromhex("0100000000000000feffffffffffffff")
    assert (big.dtype, big.data) == ("uint32", bytes.fromhex("0100000002010000"))


def test_non_contiguous_arrays_are_sent_in_c_order() -> None:
    array = np.arange(12, dtype=np.int32).reshape(3, 4).T  # Fortran-ordered view

    got = assemble(tensor_to_chunks("t", array, 7))["t"]

    np.testing.assert_array_equal(got, array)


def test_several_tensors_keep_their_order() -> None:
    tensors = [("w", np.ones((2, 2), np.float32)), ("b", np.zeros(3)), ("n", np.array(7))]

    got = assemble(tensors_to_chunks(tensors, 5))

    assert list(got) == ["w", "b", "n"]
    for name, array in tensors:
        np.testing.assert_array_equal(got[name], array)
        assert got[name].shape == array.shape


def test_ids_and_f32_bytes_are_little_endian_and_round_trip() -> None:
    ids = np.array([0, 1, 2**63, 2**64 - 1], np.uint64)
    values = np.array([1.0, -0.0, 0.5, np.inf], np.float32)

    id_bytes, value_bytes = ids_to_bytes(ids), f32_to_bytes(values)

    assert id_bytes == bytes.fromhex(
        "000000000000000001000000000000000000000000000080ffffffffffffffff"
    )
    assert value_bytes == bytes.fromhex("0000803f000000800000003f0000807f")
    assert ids_from_bytes(id_bytes).dtype == np.uint64
    assert ids_from_bytes(id_bytes).tolist() == ids.tolist()
    assert f32_from_bytes(value_bytes).tobytes() == values.tobytes()  # -0.0 kept, bit for bit
    assert ids_from_bytes(b"").shape == f32_from_bytes(b"").shape == (0,)


@pytest.mark.parametrize(
    ("decode", "data", "message"),
    [
        (ids_from_bytes, b"\0" * 9, "ids: 9 bytes is not a whole number of uint64 values"),
        (f32_from_bytes, b"\0" * 6, "values: 6 bytes is not a whole number of float32 values"),
        (rows_from_bytes, b"\0" * 12, "rows: 12 bytes is not a whole number of int64 values"),
    ],
)
def test_ragged_id_and_value_bytes_are_refused(decode, data, message) -> None:
    with pytest.raises(CodecError) as info:
        decode(data)

    assert str(info.value) == message
    with pytest.raises(CodecError, match="^strengths: "):
        decode(data, "strengths")  # the message names the field it came from


def test_training_rows_round_trip_as_little_endian_int64() -> None:
    rows = np.array([0, 1, 1436, 2**40], np.int64)

    data = rows_to_bytes(rows)

    assert data[:16] == bytes.fromhex("00000000000000000100000000000000")
    assert rows_from_bytes(data).dtype == np.int64
    assert rows_from_bytes(data).tolist() == rows.tolist()


def chunk(**fields: Any) -> common_pb2.TensorChunk:
    defaults: dict[str, Any] = dict(name="t", dtype="float32", shape=[2], offset=0)
    defaults.update(fields)
    defaults.setdefault("total_bytes", len(defaults.get("data", b"")))
    return common_pb2.TensorChunk(**defaults)


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([chunk(data=b"\0" * 4, offset=4, total_bytes=8)], "chunk of 't' at offset 4, expected 0"),
        (
            [chunk(data=b"\0" * 4, total_bytes=8), chunk(data=b"\0" * 4, offset=4, dtype="int32")],
            "chunks of 't' disagree on dtype/shape/size",
        ),
        (
            [chunk(data=b"\0" * 4, total_bytes=8), chunk(data=b"\0" * 4, offset=4, shape=[1, 2])],
            "chunks of 't' disagree on dtype/shape/size",
        ),
        ([chunk(data=b"\0" * 4, total_bytes=8)], "tensor 't' incomplete: 4/8 bytes"),
        ([chunk(dtype="complex64", data=b"\0" * 16)], "tensor dtype 'complex64' is not supported"),
        ([chunk(dtype="object", data=b"\0" * 16)], "tensor dtype 'object' is not supported"),
        ([chunk(shape=[3], data=b"\0" * 8)], "tensor of dtype float32 and shape [3] needs 12 "),
        ([chunk(shape=[-1, -2], data=b"\0" * 8)], "tensor shape [-1, -2] has a negative dimension"),
        ([chunk(shape=[1] * 65, data=b"\0" * 4)], "tensor shape [1, 1, 1, 1, 1, 1, 1, 1]: "),
    ],
    ids=[
        "offset-gap",
        "dtype-changes",
        "shape-changes",
        "incomplete",
        "complex",
        "object",
        "short-data",
        "negative-dim",
        "too-many-dims",
    ],
)
def test_malformed_chunks_are_codec_errors(chunks, message) -> None:
    assembler = ChunkAssembler()

    with pytest.raises(CodecError) as info:
        for c in chunks:
            assembler.add(c)
        assembler.result()

    assert str(info.value).startswith(message), str(info.value)


async def _aiter(items: Iterable[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


def test_header_and_tensors_are_read_from_one_stream() -> None:
    params = [("w", np.arange(6, dtype=np.float32).reshape(2, 3)), ("s", np.array(3, np.int64))]
    header = worker_pb2.StepHeader(job_id="j", step=4, params_included=True)
    stream = [worker_pb2.GradientRequest(header=header)] + [
        worker_pb2.GradientRequest(param=c) for c in tensors_to_chunks(params, 8)
    ]

    got_header, arrays = asyncio.run(read_header_and_tensors(_aiter(stream), "header", "param"))

    assert got_header == header
    assert list(arrays) == ["w", "s"]
    for name, array in params:
        np.testing.assert_array_equal(arrays[name], array)
        assert arrays[name].shape == array.shape


def test_a_stream_without_header_or_with_a_torn_tensor() -> None:
    chunks = list(tensor_to_chunks("w", np.arange(4, dtype=np.float32), 8))
    whole = [worker_pb2.GradientRequest(param=c) for c in chunks]

    header, arrays = asyncio.run(read_header_and_tensors(_aiter(whole), "header", "param"))
    assert header is None and list(arrays) == ["w"]
    with pytest.raises(CodecError, match="^tensor 'w' incomplete: 8/16 bytes$"):
        asyncio.run(read_header_and_tensors(_aiter(whole[:1]), "header", "param"))
