"""The client side of the data set RPCs: streaming a local ``.npz`` to the coordinator
(PutDataset) and reading its listing (ListDatasets). ``shared.client.Client`` calls these.

A file travels as a ``DatasetHeader`` (name, size, replace) and, once the coordinator
accepted it, 1 MiB chunks of its bytes, read in a thread; the coordinator counts them against
its ``max_dataset_bytes``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from shared.proto import coordinator_pb2, coordinator_pb2_grpc

CHUNK_BYTES = 1 << 20  # well under any gRPC message limit
# The deadline of an upload grows with the file: the call's base timeout plus one second per
# this many bytes (a link slower than ~1 MB/s times out).
MIN_UPLOAD_BYTES_PER_S = 1_000_000

Progress = Callable[[int], None]


def upload_timeout_s(base_s: float, size_bytes: int) -> float:
    """Deadline of an upload of ``size_bytes``, seconds."""
    return base_s + size_bytes / MIN_UPLOAD_BYTES_PER_S


class UploadRefused(Exception):
    """The coordinator ended an upload without a status the client could read (it closed the
    stream while a chunk was being sent); ``code`` is what the call reported."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


async def put_file(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    path: Path,
    header: coordinator_pb2.DatasetHeader,
    progress: Progress | None,
    timeout_s: float,
) -> coordinator_pb2.DatasetInfo:
    """Run one PutDataset call: send the header, wait for ``accepted``, send the file's
    bytes in chunks (read in a thread), half-close and read the stored data set.

    ``progress(n)`` is called once each chunk of ``n`` bytes has been handed to gRPC.

    Raises:
        grpc.aio.AioRpcError: the coordinator refused the upload (its status).
        UploadRefused: the stream ended without a reply.
    """
    call = stub.PutDataset(timeout=timeout_s)
    await call.write(coordinator_pb2.DatasetChunk(header=header))
    reply = await call.read()  # a refused header raises here, before any byte is sent
    if reply is aio.EOF or not reply.HasField("accepted"):
        raise UploadRefused("the coordinator did not accept the upload", await call.code())
    f = await asyncio.to_thread(path.open, "rb")
    try:
        while data := await asyncio.to_thread(f.read, CHUNK_BYTES):
            if call.done():  # refused mid-stream: its status is read below
                break
            await call.write(coordinator_pb2.DatasetChunk(data=data))
            if progress is not None:
                progress(len(data))
    finally:
        f.close()
    if not call.done():
        await call.done_writing()
    reply = await call.read()
    if reply is aio.EOF or not reply.HasField("stored"):
        raise UploadRefused(
            "the coordinator ended the upload without storing it", await call.code()
        )
    return reply.stored


def info_from_pb(info: coordinator_pb2.DatasetInfo) -> dict[str, Any]:
    """A stored data set as ``data put --json`` prints it."""
    return {
        "name": info.name,
        "path": info.path,
        "bytes": info.bytes,
        "sha256": info.sha256,
        "kind": info.kind,
        "arrays": [{"name": a.name, "dtype": a.dtype, "shape": list(a.shape)} for a in info.arrays],
    }


def entries_from_pb(reply: coordinator_pb2.ListDatasetsResponse) -> list[dict[str, Any]]:
    """The listing as ``data ls --json`` prints it."""
    return [
        {"path": e.path, "bytes": e.bytes, "modified_at": e.modified_at, "root": e.root}
        for e in reply.datasets
    ]
