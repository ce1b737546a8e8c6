"""The client side of the data set RPCs: PutDataset (upload an ``.npz``) and ListDatasets.

``shared.client.Client`` calls these.

A file travels as a ``DatasetHeader`` (name, size, replace) and, once the coordinator
accepted it, 1 MiB chunks of its bytes, read in a thread (a directory of ``.npy`` files as
an uncompressed ``.npz`` made as it is sent, never whole in memory); the coordinator counts
them against its ``max_dataset_bytes``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from shared.client.npz_stream import array_files, npz_chunks
from shared.proto import coordinator_pb2, coordinator_pb2_grpc

CHUNK_BYTES = 1 << 20  # well under any gRPC message limit
# The deadline of an upload grows with the file: the call's base timeout plus one second per
# this many bytes (a link slower than ~1 MB/s times out).
MIN_UPLOAD_BYTES_PER_S = 1_000_000

Progress = Callable[[int], None]  # called with the size of each chunk sent, bytes


def upload_timeout_s(base_s: float, size_bytes: int) -> float:
    """Return the deadline of an upload, seconds: ``base_s`` plus 1 s per MB.

    Args:
        base_s: the client's call timeout, seconds.
        size_bytes: the file's size, bytes.
    """
    return base_s + size_bytes / MIN_UPLOAD_BYTES_PER_S


class UploadRefused(Exception):
    """The coordinator ended an upload without sending the reply the client waited for.

    It closed the stream while a chunk was being sent, so its status may be lost; ``code`` is
    what the call reported.
    """

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        """Keep the call's ``code`` beside the message."""
        super().__init__(message)
        self.code = code


async def put_file(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    path: Path,
    header: coordinator_pb2.DatasetHeader,
    progress: Progress | None,
    timeout_s: float,
    chunk_bytes: int = CHUNK_BYTES,
) -> coordinator_pb2.DatasetInfo:
    """Upload one file with a PutDataset call.

    Send the header, wait for ``accepted`` (a refused header costs no upload), send the
    file's bytes in chunks of ``chunk_bytes`` read in a thread, half-close and read the
    stored data set.

    Args:
        stub: the coordinator's stub.
        path: the local ``.npz`` (or ``.pt``), or a directory of ``.npy`` files sent as an
            uncompressed ``.npz`` (``shared.client.npz_stream``; ``header.total_bytes`` is
            its ``npz_size``).
        header: the name, size and ``replace`` flag.
        progress: called with ``n`` once each chunk of ``n`` bytes has been handed to gRPC.
        timeout_s: deadline of the whole call, seconds (see ``upload_timeout_s``).
        chunk_bytes: bytes per message, >= 1 (the last one may be shorter).

    Returns:
        The stored data set: its name, path in the data root, size, sha256, kind, arrays.

    Raises:
        grpc.aio.AioRpcError: the coordinator refused the upload (its status).
        UploadRefused: the stream ended without a reply.
    """
    call = stub.PutDataset(timeout=timeout_s)
    await call.write(coordinator_pb2.DatasetChunk(header=header))
    reply = await call.read()  # a refused header raises here, before any byte is sent
    if not isinstance(reply, coordinator_pb2.DatasetReply) or not reply.HasField("accepted"):
        raise UploadRefused("the coordinator did not accept the upload", await call.code())
    if await asyncio.to_thread(path.is_dir):  # .npy files: an .npz built as it is sent
        pieces: Iterator[bytes] = npz_chunks(array_files(path))
    else:
        pieces = _file_chunks(path, chunk_bytes)
    try:
        while (data := await asyncio.to_thread(next, pieces, b"")) != b"":
            if call.done():  # refused mid-stream: its status is read below
                break
            await call.write(coordinator_pb2.DatasetChunk(data=data))
            if progress is not None:
                progress(len(data))
    finally:
        close = getattr(pieces, "close", None)
        if close is not None:
            await asyncio.to_thread(close)
    if not call.done():
        await call.done_writing()
    reply = await call.read()
    if not isinstance(reply, coordinator_pb2.DatasetReply) or not reply.HasField("stored"):
        raise UploadRefused(
            "the coordinator ended the upload without storing it", await call.code()
        )
    return reply.stored


def _file_chunks(path: Path, chunk_bytes: int) -> Iterator[bytes]:
    """A file's bytes, ``chunk_bytes`` at a time."""
    with path.open("rb") as f:
        while data := f.read(chunk_bytes):
            yield data


def info_from_pb(info: coordinator_pb2.DatasetInfo) -> dict[str, Any]:
    """Turn a stored data set into the document ``data put --json`` prints.

    Returns:
        ``name``, ``path`` (in the data root), ``bytes``, ``sha256`` (hex), ``kind``
        (``train`` or ``memory``), ``arrays`` (name, dtype, shape of each) and ``owner``
        (the uploading token's subject, "" without auth).
    """
    return {
        "name": info.name,
        "path": info.path,
        "bytes": info.bytes,
        "sha256": info.sha256,
        "kind": info.kind,
        "arrays": [{"name": a.name, "dtype": a.dtype, "shape": list(a.shape)} for a in info.arrays],
        "owner": info.owner,
    }


def entries_from_pb(reply: coordinator_pb2.ListDatasetsResponse) -> list[dict[str, Any]]:
    """Turn a ListDatasets reply into the list ``data ls --json`` prints.

    Returns:
        One dict per file: ``path`` (relative to its root), ``bytes``, ``modified_at``
        (Unix seconds), ``root`` (index into the coordinator's data roots) and ``owner`` (the
        subject that uploaded it; "" when put there otherwise).
    """
    return [
        {
            "path": e.path,
            "bytes": e.bytes,
            "modified_at": e.modified_at,
            "root": e.root,
            "owner": e.owner,
        }
        for e in reply.datasets
    ]
