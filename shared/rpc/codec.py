"""Tensor and array codec: raw little-endian bytes on the wire, chunked streams for big tensors.

Arrays never travel as ``repeated float``: a tensor is sent as ``TensorChunk`` messages, each
carrying the dtype, the shape and up to ``chunk_bytes`` of the raw little-endian C-order
bytes, which the receiver reassembles; id and strength arrays of the memory store are plain
little-endian ``bytes`` fields.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterable, Iterable, Iterator
from typing import Any

import numpy as np

from shared.proto import common_pb2

_WIRE_DTYPES = {
    "float32",
    "float64",
    "float16",
    "int64",
    "int32",
    "uint64",
    "uint32",
    "uint8",
    "int8",
    "bool",
}


class CodecError(ValueError):
    """Bytes do not decode to the declared dtype/shape (INVALID_ARGUMENT)."""


def _le(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("<") if dtype.byteorder not in ("|", "<") else dtype


def _from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if dtype not in _WIRE_DTYPES:
        raise CodecError(f"tensor dtype {dtype!r} is not supported")
    dt = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).itemsize > 1 else np.dtype(dtype)
    if any(d < 0 for d in shape):
        raise CodecError(f"tensor shape {list(shape)} has a negative dimension")
    n = math.prod(shape)  # Python ints: a product of huge dims must not wrap around
    if len(data) != n * dt.itemsize:
        raise CodecError(
            f"tensor of dtype {dtype} and shape {list(shape)} needs {n * dt.itemsize} bytes, "
            f"got {len(data)}"
        )
    try:  # numpy still refuses some empty shapes: over 64 dims, or a size beyond intp
        return np.frombuffer(data, dtype=dt).astype(np.dtype(dtype), copy=True).reshape(shape)
    except ValueError as exc:
        raise CodecError(f"tensor shape {list(shape)[:8]}: {exc}") from None


def tensor_to_chunks(
    name: str, array: np.ndarray, chunk_bytes: int
) -> Iterator[common_pb2.TensorChunk]:
    """Split one array into ``TensorChunk`` messages of at most ``chunk_bytes`` data each.

    Args:
        name: the tensor's name in the stream.
        array: any shape (0-d and empty ones too), sent as raw little-endian C-order bytes.
        chunk_bytes: most data bytes per chunk, >= 1; an empty array is one empty chunk.
    """
    a = np.asarray(array)  # not ascontiguousarray: it turns a 0-d array into shape (1,)
    # A byte view of the (little-endian) array: each chunk copies only its own bytes, so a
    # large tensor (a data shard) is never copied whole. Flat first: memoryview refuses to
    # cast a view with a zero in its shape, e.g. (0, 64), an empty shard's x.
    flat = np.ascontiguousarray(a.astype(_le(a.dtype), copy=False)).reshape(-1)
    data = flat.data.cast("B")
    total = data.nbytes
    offset = 0
    while True:
        piece = bytes(data[offset : offset + chunk_bytes])
        yield common_pb2.TensorChunk(
            name=name,
            dtype=a.dtype.name,
            shape=list(a.shape),
            offset=offset,
            data=piece,
            total_bytes=total,
        )
        offset += len(piece)
        if offset >= total:
            return


def tensors_to_chunks(
    tensors: Iterable[tuple[str, np.ndarray]], chunk_bytes: int
) -> Iterator[common_pb2.TensorChunk]:
    """Chunk several named arrays in order (see ``tensor_to_chunks``)."""
    for name, array in tensors:
        yield from tensor_to_chunks(name, array, chunk_bytes)


class ChunkAssembler:
    """Reassemble ``TensorChunk`` messages into named arrays, in arrival order."""

    def __init__(self) -> None:
        self._parts: dict[str, list[bytes]] = {}
        self._meta: dict[str, tuple[str, tuple[int, ...], int]] = {}
        self._received: dict[str, int] = {}

    def add(self, chunk: common_pb2.TensorChunk) -> None:
        """Add one chunk.

        Raises:
            CodecError: a chunk out of order or inconsistent with earlier chunks of its tensor.
        """
        got = self._received.get(chunk.name, 0)
        if chunk.offset != got:
            raise CodecError(f"chunk of {chunk.name!r} at offset {chunk.offset}, expected {got}")
        meta = (chunk.dtype, tuple(chunk.shape), chunk.total_bytes)
        if self._meta.setdefault(chunk.name, meta) != meta:
            raise CodecError(f"chunks of {chunk.name!r} disagree on dtype/shape/size")
        self._parts.setdefault(chunk.name, []).append(chunk.data)
        self._received[chunk.name] = got + len(chunk.data)

    def result(self) -> dict[str, np.ndarray]:
        """Return the arrays, in the order their first chunk arrived.

        Raises:
            CodecError: a tensor is incomplete.
        """
        out: dict[str, np.ndarray] = {}
        for name, parts in self._parts.items():
            dtype, shape, total = self._meta[name]
            if self._received[name] != total:
                raise CodecError(
                    f"tensor {name!r} incomplete: {self._received[name]}/{total} bytes"
                )
            out[name] = _from_bytes(b"".join(parts), dtype, shape)
        return out


async def read_header_and_tensors(
    stream: AsyncIterable[Any], header_field: str, chunk_field: str
) -> tuple[Any | None, dict[str, np.ndarray]]:
    """Read a stream of ``oneof {header, chunk}`` messages: the last header seen and the
    arrays reassembled from the ``TensorChunk`` parts (ComputeGradients in both directions).

    Raises:
        CodecError: chunks out of order or incomplete (INVALID_ARGUMENT).
    """
    header = None
    assembler = ChunkAssembler()
    async for msg in stream:
        if msg.HasField(header_field):
            header = getattr(msg, header_field)
        else:
            assembler.add(getattr(msg, chunk_field))
    return header, assembler.result()


def ids_to_bytes(ids: np.ndarray) -> bytes:
    """[N] ids as uint64 little-endian bytes."""
    return np.ascontiguousarray(ids, dtype="<u8").tobytes()


def f32_to_bytes(values: np.ndarray) -> bytes:
    """[N] values as float32 little-endian bytes."""
    return np.ascontiguousarray(values, dtype="<f4").tobytes()


def ids_from_bytes(data: bytes, field: str = "ids") -> np.ndarray:
    """Decode uint64 little-endian bytes to a [N] uint64 array (read-only view).

    Raises:
        CodecError: the byte length is not a multiple of 8; the message names ``field``.
    """
    if len(data) % 8:
        raise CodecError(f"{field}: {len(data)} bytes is not a whole number of uint64 values")
    return np.frombuffer(data, dtype="<u8").astype(np.uint64, copy=False)


def f32_from_bytes(data: bytes, field: str = "values") -> np.ndarray:
    """Decode float32 little-endian bytes to a [N] float32 array (read-only view).

    Raises:
        CodecError: the byte length is not a multiple of 4; the message names ``field``.
    """
    if len(data) % 4:
        raise CodecError(f"{field}: {len(data)} bytes is not a whole number of float32 values")
    return np.frombuffer(data, dtype="<f4").astype(np.float32, copy=False)
