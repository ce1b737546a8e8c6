"""Tensor and array codec: raw little-endian bytes on the wire, chunked streams for big tensors.

Arrays never travel as ``repeated float``: a tensor is sent as ``TensorChunk`` messages, each
carrying the dtype, the shape and up to ``chunk_bytes`` of the raw little-endian C-order
bytes, which the receiver reassembles; id and strength arrays of the memory store are plain
little-endian ``bytes`` fields (uint64 ids, float32 strengths and boosts), made and read by
the ``*_to_bytes`` and ``*_from_bytes`` pairs.

Every decoder checks byte lengths against the declared dtype and shape before it allocates,
and raises ``CodecError``, which servers answer with INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterable, Iterable, Iterator
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from shared.proto import common_pb2
from shared.rpc.limits import BudgetExceeded

M = TypeVar("M")  # a protobuf message type of a chunked stream

_WIRE_DTYPES = {
    "float32",
    "float64",
    "float16",
    "int64",
    "int32",
    "int16",
    "uint16",
    "uint64",
    "uint32",
    "uint8",
    "int8",
    "bool",
}


class CodecError(ValueError):
    """Bytes do not decode to the declared dtype/shape (INVALID_ARGUMENT)."""


def _le(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return dtype.newbyteorder("<") if dtype.byteorder not in ("|", "<") else dtype


def _wire_dtype(dtype: str) -> np.dtype[Any]:
    """The little-endian dtype of a wire dtype name. Raises: CodecError (unsupported)."""
    if dtype not in _WIRE_DTYPES:
        raise CodecError(f"tensor dtype {dtype!r} is not supported")
    return np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).itemsize > 1 else np.dtype(dtype)


def _from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    dt = _wire_dtype(dtype)
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


def _from_parts(parts: list[bytes], dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """``_from_bytes`` of the concatenated ``parts``, copying each part once into the array.

    Raises:
        CodecError: as ``_from_bytes``.
    """
    if len(parts) == 1:
        return _from_bytes(parts[0], dtype, shape)
    size = sum(len(p) for p in parts)
    dt = _wire_dtype(dtype)
    if any(d < 0 for d in shape) or size != math.prod(shape) * dt.itemsize:
        return _from_bytes(b"".join(parts), dtype, shape)  # raises its errors
    flat = np.empty(size, np.uint8)
    at = 0
    for p in parts:
        flat[at : at + len(p)] = np.frombuffer(p, np.uint8)
        at += len(p)
    try:
        return flat.view(dt).astype(np.dtype(dtype), copy=False).reshape(shape)
    except ValueError as exc:
        raise CodecError(f"tensor shape {list(shape)[:8]}: {exc}") from None


def tensor_to_chunks(
    name: str, array: np.ndarray, chunk_bytes: int
) -> Iterator[common_pb2.TensorChunk]:
    """Split one array into ``TensorChunk`` messages of at most ``chunk_bytes`` data each.

    Each chunk repeats the name, dtype, shape and total size, and carries its byte offset,
    so the receiver can check order and completeness.

    Args:
        name: the tensor's name in the stream (a parameter name, ``x``, ``y``).
        array: any shape (0-d and empty ones too) of a wire dtype (float16/32/64,
            int8/16/32/64, uint8/16/32/64, bool), sent as raw little-endian C-order bytes.
        chunk_bytes: most data bytes per chunk, >= 1; an empty array is one empty chunk.

    Yields:
        The chunks in offset order; only one chunk's bytes are copied at a time.
    """
    yield from _fill_chunks(name, array, chunk_bytes, common_pb2.TensorChunk, None)


def tensors_to_messages(
    tensors: Iterable[tuple[str, np.ndarray]], chunk_bytes: int, message: type[M], field: str
) -> Iterator[M]:
    """Chunk named arrays straight into stream messages: ``message`` with its ``field`` set.

    The same chunks as ``tensors_to_chunks``, each written in place into the ``TensorChunk``
    field ``field`` of a new ``message`` (``GradientRequest``'s ``param``,
    ``GradientResponse``'s ``grad``): wrapping a ready ``TensorChunk`` instead
    (``message(field=chunk)``) copies its bytes once more.

    Args:
        tensors: ``(name, array)`` pairs; names must be distinct; arrays as
            ``tensor_to_chunks`` takes them.
        chunk_bytes: most data bytes per message, >= 1.
        message: the stream's message type.
        field: the name of its ``TensorChunk`` field.

    Yields:
        Every message of the first tensor, then of the second, and so on.
    """
    for name, array in tensors:
        yield from _fill_chunks(name, array, chunk_bytes, message, field)


def little_endian_bytes(array: npt.ArrayLike) -> memoryview:
    """A flat byte view of ``array``'s little-endian C-order bytes (copied only if needed).

    Chunks are sliced from it, each copying only its own bytes, so a large tensor (a data
    shard) is never copied whole. Flat first: memoryview refuses to cast a view with a zero
    in its shape, e.g. (0, 64), an empty shard's x.

    Args:
        array: any shape (0-d and empty ones too) of a wire dtype.
    """
    a = np.asarray(array)
    flat = np.ascontiguousarray(a.astype(_le(a.dtype), copy=False)).reshape(-1)
    return flat.data.cast("B")


def _fill_chunks(
    name: str, array: np.ndarray, chunk_bytes: int, message: type[M], field: str | None
) -> Iterator[M]:
    """One ``message`` per chunk of ``array``, its ``TensorChunk`` filled in place.

    ``field`` names the message's ``TensorChunk`` field; None: the message is one.
    """
    a = np.asarray(array)  # not ascontiguousarray: it turns a 0-d array into shape (1,)
    data = little_endian_bytes(a)
    total, dtype, shape = data.nbytes, a.dtype.name, list(a.shape)
    offset = 0
    while True:
        msg = message()
        chunk = cast(common_pb2.TensorChunk, msg if field is None else getattr(msg, field))
        piece = bytes(data[offset : offset + chunk_bytes])
        chunk.name, chunk.dtype, chunk.offset, chunk.total_bytes = name, dtype, offset, total
        chunk.shape.extend(shape)
        chunk.data = piece
        yield msg
        offset += len(piece)
        if offset >= total:
            return


def block_to_chunks(
    name: str, block: np.ndarray, shape: tuple[int, ...], offset: int, chunk_bytes: int
) -> Iterator[common_pb2.TensorChunk]:
    """Chunk one block of rows of a larger tensor that is sent block by block.

    The chunks carry the whole tensor's ``shape`` and byte size and their offsets within
    it, so the receiver sees one tensor (``ChunkAssembler``, or a file written in place).

    Args:
        name: the tensor's name in the stream.
        block: [b, ...] consecutive rows of the tensor, of a wire dtype.
        shape: the whole tensor's shape [R, ...].
        offset: byte offset of the block's first row within the whole tensor.
        chunk_bytes: most data bytes per chunk, >= 1.
    """
    flat = np.ascontiguousarray(block.astype(_le(block.dtype), copy=False)).reshape(-1)
    data = flat.data.cast("B")
    total = math.prod(shape) * block.dtype.itemsize
    for at in range(0, data.nbytes, chunk_bytes):
        yield common_pb2.TensorChunk(
            name=name,
            dtype=block.dtype.name,
            shape=list(shape),
            offset=offset + at,
            data=bytes(data[at : at + chunk_bytes]),
            total_bytes=total,
        )


def tensors_to_chunks(
    tensors: Iterable[tuple[str, np.ndarray]], chunk_bytes: int
) -> Iterator[common_pb2.TensorChunk]:
    """Chunk several named arrays, one after the other (see ``tensor_to_chunks``).

    Args:
        tensors: ``(name, array)`` pairs; names must be distinct.
        chunk_bytes: most data bytes per chunk.

    Yields:
        Every chunk of the first tensor, then of the second, and so on.
    """
    for name, array in tensors:
        yield from tensor_to_chunks(name, array, chunk_bytes)


class ChunkAssembler:
    """Reassemble ``TensorChunk`` messages into named arrays, in arrival order.

    Chunks of several tensors may interleave; each tensor's chunks must arrive in offset
    order. Feed every chunk to ``add``, then call ``result`` once the stream ended. Every
    chunk is checked before its bytes are kept: its declared size must match its dtype and
    shape, its data must not run past that size, and (when the receiver knows what to expect)
    its tensor must be one of ``expected`` with that shape, within the call's byte budget.
    """

    def __init__(
        self,
        expected: dict[str, tuple[int, ...]] | None = None,
        max_bytes: int | None = None,
    ) -> None:
        """Start with no tensors.

        Args:
            expected: name -> shape of every tensor the stream may carry (the model's
                parameters and buffers). A name ``base#part`` (a compressed wire part,
                ``shared/training/compression.py``) is allowed when ``base`` is expected, at
                most 8 bytes per element of ``base`` (plus 8); a bare name must have its
                expected shape exactly. None: any name and shape.
            max_bytes: the most bytes all the stream's tensors may declare together; None:
                no limit.
        """
        self._parts: dict[str, list[bytes]] = {}
        self._meta: dict[str, tuple[str, tuple[int, ...], int]] = {}
        self._received: dict[str, int] = {}
        self._expected = expected
        self._max_bytes = max_bytes
        self._declared = 0

    def _admit(self, chunk: common_pb2.TensorChunk) -> None:
        """Check the first chunk of a tensor before anything of it is kept.

        Raises:
            CodecError: a dtype not on the wire, a size that does not match the dtype and
                shape, an unexpected name, or a shape other than expected (INVALID_ARGUMENT).
            BudgetExceeded: the stream's tensors together exceed ``max_bytes``
                (RESOURCE_EXHAUSTED).
        """
        name, shape = chunk.name, tuple(chunk.shape)
        if chunk.dtype not in _WIRE_DTYPES:
            raise CodecError(f"tensor dtype {chunk.dtype!r} is not supported (tensor {name!r})")
        if any(d < 0 for d in shape):
            raise CodecError(
                f"tensor shape {list(shape)[:8]} has a negative dimension (tensor {name!r})"
            )
        need = math.prod(shape) * np.dtype(chunk.dtype).itemsize
        if chunk.total_bytes != need:
            raise CodecError(
                f"tensor of dtype {chunk.dtype} and shape {list(shape)[:8]} needs {need} bytes, "
                f"got {chunk.total_bytes} (tensor {name!r})"
            )
        if self._expected is not None:
            base, sep, _ = name.partition("#")
            if base not in self._expected:
                raise CodecError(f"tensor {name!r} is not one of the expected tensors")
            want = self._expected[base]
            if not sep and shape != tuple(want):
                raise CodecError(f"tensor {name!r}: shape {list(shape)[:8]}, expected {list(want)}")
            if sep and need > 8 * math.prod(want) + 8:
                raise CodecError(
                    f"tensor {name!r}: {need} bytes for a tensor of shape {list(want)}"
                )
        self._declared += need
        if self._max_bytes is not None and self._declared > self._max_bytes:
            raise BudgetExceeded(
                f"tensor {name!r}: the stream's tensors declare {self._declared} bytes, over "
                f"the call's budget of {self._max_bytes}"
            )

    def add(self, chunk: common_pb2.TensorChunk) -> None:
        """Add one chunk to its tensor.

        Raises:
            CodecError: a chunk out of order, one whose dtype, shape or total size differs
                from earlier chunks of its tensor, data past the declared size, or a first
                chunk ``_admit`` refuses (INVALID_ARGUMENT).
            BudgetExceeded: as ``_admit`` (RESOURCE_EXHAUSTED).
        """
        got = self._received.get(chunk.name, 0)
        if chunk.offset != got:
            raise CodecError(f"chunk of {chunk.name!r} at offset {chunk.offset}, expected {got}")
        meta = (chunk.dtype, tuple(chunk.shape), chunk.total_bytes)
        if chunk.name not in self._meta:
            self._admit(chunk)
            self._meta[chunk.name] = meta
        elif self._meta[chunk.name] != meta:
            raise CodecError(f"chunks of {chunk.name!r} disagree on dtype/shape/size")
        data = chunk.data  # each read of a bytes field copies it out of the message
        if got + len(data) > chunk.total_bytes:
            raise CodecError(f"tensor {chunk.name!r}: data runs past its {chunk.total_bytes} bytes")
        self._parts.setdefault(chunk.name, []).append(data)
        self._received[chunk.name] = got + len(data)

    def result(self) -> dict[str, np.ndarray]:
        """Return the arrays, by name, in the order their first chunk arrived.

        Raises:
            CodecError: a tensor is incomplete, or its bytes do not match its dtype and shape
                (INVALID_ARGUMENT).
        """
        out: dict[str, np.ndarray] = {}
        for name, parts in self._parts.items():
            dtype, shape, total = self._meta[name]
            if self._received[name] != total:
                raise CodecError(
                    f"tensor {name!r} incomplete: {self._received[name]}/{total} bytes"
                )
            out[name] = _from_parts(parts, dtype, shape)
        return out


async def read_header_and_tensors(
    stream: AsyncIterable[Any],
    header_field: str,
    chunk_field: str,
    expected: dict[str, tuple[int, ...]] | None = None,
    max_bytes: int | None = None,
) -> tuple[Any | None, dict[str, np.ndarray]]:
    """Read a stream of ``oneof {header, chunk}`` messages to its end.

    The shape of ComputeGradients in both directions and of FetchShard: a header message
    (step, loss, ...) and the tensors it describes, chunked.

    Args:
        stream: the messages; each has a message field ``header_field`` and a
            ``TensorChunk`` field ``chunk_field`` in one oneof.
        header_field: the name of the header field.
        chunk_field: the name of the chunk field.
        expected: name -> shape of the tensors the stream may carry (``ChunkAssembler``).
        max_bytes: the most bytes the stream's tensors may declare together.

    Returns:
        The last header seen (None when none came) and the reassembled arrays by name.

    Raises:
        CodecError: chunks out of order, incomplete, or not as expected (INVALID_ARGUMENT).
        BudgetExceeded: the tensors exceed ``max_bytes`` (RESOURCE_EXHAUSTED).
    """
    header = None
    assembler = ChunkAssembler(expected, max_bytes)
    async for msg in stream:
        if msg.HasField(header_field):
            header = getattr(msg, header_field)
        else:
            assembler.add(getattr(msg, chunk_field))
    return header, assembler.result()


def ids_to_bytes(ids: npt.ArrayLike) -> bytes:
    """Encode memory ids for a ``bytes`` field.

    Args:
        ids: [N] non-negative integers (cast to uint64).

    Returns:
        8 * N bytes, uint64 little-endian.
    """
    return np.ascontiguousarray(ids, dtype="<u8").tobytes()


def f32_to_bytes(values: npt.ArrayLike) -> bytes:
    """Encode strengths or boosts for a ``bytes`` field.

    Args:
        values: [N] numbers (cast to float32).

    Returns:
        4 * N bytes, float32 little-endian.
    """
    return np.ascontiguousarray(values, dtype="<f4").tobytes()


def rows_to_bytes(rows: npt.ArrayLike) -> bytes:
    """Encode training row indices for a ``bytes`` field (``StepHeader.rows``).

    Args:
        rows: [R] integers (cast to int64).

    Returns:
        8 * R bytes, int64 little-endian.
    """
    return np.ascontiguousarray(rows, dtype="<i8").tobytes()


def rows_from_bytes(data: bytes, field: str = "rows") -> npt.NDArray[np.int64]:
    """Decode ``rows_to_bytes`` output.

    Raises:
        CodecError: the byte length is not a multiple of 8 (INVALID_ARGUMENT), naming
            ``field``.
    """
    return _from_le_bytes(data, field, "<i8", np.int64)


def ids_from_bytes(data: bytes, field: str = "ids") -> npt.NDArray[np.uint64]:
    """Decode a ``bytes`` field of memory ids.

    Args:
        data: uint64 little-endian bytes.
        field: the message field, named in the error.

    Returns:
        [len(data) / 8] uint64, a read-only view of ``data`` on little-endian hosts.

    Raises:
        CodecError: the byte length is not a multiple of 8 (INVALID_ARGUMENT).
    """
    return _from_le_bytes(data, field, "<u8", np.uint64)


def f32_from_bytes(data: bytes, field: str = "values") -> npt.NDArray[np.float32]:
    """Decode a ``bytes`` field of float32 values (strengths, boosts).

    Args:
        data: float32 little-endian bytes.
        field: the message field, named in the error.

    Returns:
        [len(data) / 4] float32, a read-only view of ``data`` on little-endian hosts.

    Raises:
        CodecError: the byte length is not a multiple of 4 (INVALID_ARGUMENT).
    """
    return _from_le_bytes(data, field, "<f4", np.float32)


def _from_le_bytes(
    data: bytes, field: str, wire: str, native: type[np.generic]
) -> npt.NDArray[Any]:
    """Decode ``data`` as ``wire`` values into ``native`` ones (a view on little-endian hosts).

    Raises:
        CodecError: the byte length is not a multiple of the item size, naming ``field``.
    """
    if len(data) % np.dtype(wire).itemsize:
        name = np.dtype(native).name
        raise CodecError(f"{field}: {len(data)} bytes is not a whole number of {name} values")
    return np.frombuffer(data, dtype=wire).astype(native, copy=False)
