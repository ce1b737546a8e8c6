"""Chunked tensors written straight to their serialized stream messages (one copy of the bytes).

``shared.rpc.codec.tensors_to_messages`` fills a message per chunk: the chunk's bytes are
copied out of the array, into the message, and again when the message is serialized. A
sender that serializes anyway (the coordinator's parameter messages, made once per step and
sent to every member) can write the serialized form directly: the ``TensorChunk``'s small
fields serialized by protobuf, its ``data`` field and the enclosing message's field framed
by hand (protobuf's length-delimited wire type,
https://protobuf.dev/programming-guides/encoding/), then joined: the tensor's bytes are
copied once. A parser reads the same message as ``tensors_to_messages`` makes (fields may
come in any order on the wire; here ``data`` comes last).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from shared.proto import common_pb2
from shared.rpc.codec import little_endian_bytes

_DATA_TAG = bytes([(5 << 3) | 2])  # TensorChunk.data = 5, length-delimited


def varint(n: int) -> bytes:
    """Protobuf's base-128 varint of ``n`` >= 0."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def serialized_chunk_messages(
    tensors: Iterable[tuple[str, np.ndarray]], chunk_bytes: int, field_number: int
) -> Iterator[bytes]:
    """Serialized stream messages whose ``TensorChunk`` field ``field_number`` holds a chunk.

    The same messages as ``tensors_to_messages`` (``GradientRequest``'s ``param`` is field
    2), already serialized.

    Args:
        tensors: ``(name, array)`` pairs; names must be distinct; arrays of a wire dtype,
            any shape.
        chunk_bytes: most data bytes per message, >= 1; an empty array is one empty chunk.
        field_number: the ``TensorChunk`` field's number in the stream's message, 1-15.

    Raises:
        ValueError: ``field_number`` outside 1-15.

    Yields:
        Every message of the first tensor, then of the second, and so on.
    """
    if not 1 <= field_number < 16:
        raise ValueError(f"field_number: a one-byte tag needs 1-15, got {field_number}")
    field_tag = bytes([(field_number << 3) | 2])
    for name, array in tensors:
        dtype, shape = np.asarray(array).dtype.name, list(np.shape(array))
        data = little_endian_bytes(array)
        total = data.nbytes
        offset = 0
        while True:
            piece = data[offset : offset + chunk_bytes]
            meta = common_pb2.TensorChunk(
                name=name, dtype=dtype, shape=shape, offset=offset, total_bytes=total
            ).SerializeToString()
            body = [meta, _DATA_TAG, varint(len(piece)), piece] if len(piece) else [meta]
            size = sum(len(b) for b in body)
            yield b"".join([field_tag, varint(size), *body])
            offset += len(piece)
            if offset >= total:
                break
