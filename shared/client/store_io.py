"""Export the memory store to a file, import one, forget a dead worker: the client's side.

Export streams ``ExportMemories`` from the coordinator into an ``ExportWriter``
(``shared/memory/export_file.py``), one chunk in memory at a time; the file appears, whole,
only when the stream ended well. Import reads and checks the file whole, then upserts it in
batches through the client's router (by slot, to the primaries, replicated like any write).

Shape letters: n memories of a chunk.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.memory.export_file import IMPORT_BATCH, ExportData, ExportWriter, read_export
from shared.proto import coordinator_pb2, coordinator_pb2_grpc
from shared.rpc.chunking import BYTES_PER_MEMORY, byte_ranges
from shared.rpc.codec import f32_from_bytes, ids_from_bytes

# About the most bytes of one import upsert call (ids, strengths, payloads): well under the
# default 64 MiB gRPC message limit, and large enough that payload-free batches are bounded
# by their item count (100k memories are 1.2 MB).
MAX_BATCH_BYTES = 16 * 1024 * 1024
# Told the memories received and, once known, the total expected (an estimate) / the slots.
ExportProgress = Callable[[int, int], None]
# Upserts one batch: (ids, strengths, payloads or None) -> distinct ids written.
Upsert = Callable[[np.ndarray, np.ndarray, list[bytes] | None], Awaitable[int]]


class ExportStreamError(RuntimeError):
    """The coordinator's export stream broke its own format (INTERNAL: a server bug)."""


@dataclass
class ExportSummary:
    """What an export wrote.

    Attributes:
        path: the file.
        memories: memories written.
        payloads: bytes of payloads written (0: the store has none; no payload arrays).
        file_bytes: the file's size, bytes.
        slots: the store's slot count.
        slot_map_epoch: the slot map the export started with.
    """

    path: str
    memories: int
    payloads: int
    file_bytes: int
    slots: int
    slot_map_epoch: int

    def to_doc(self) -> dict[str, Any]:
        """As a JSON-able dict (``--json``)."""
        return dict(vars(self))


async def export_to_file(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    path: str | os.PathLike[str],
    timeout_s: float | None,
    progress: ExportProgress | None = None,
    table: str = "",
) -> ExportSummary:
    """Stream the store into ``path`` (created or replaced only when the export completed).

    Args:
        stub: the coordinator.
        path: the ``.npz`` to write; its directory must exist.
        timeout_s: deadline of the whole stream, seconds; None: none.
        progress: called after each chunk with (memories so far, memories expected).
        table: the table exported, as on the wire ("": the default one).

    Raises:
        grpc.aio.AioRpcError: the stream failed (e.g. UNAVAILABLE: a slot has no live
            primary; PERMISSION_DENIED: the token's role may not export).
        ExportStreamError: the stream did not start with a header.
        OSError: the file cannot be written.
    """
    writer = await asyncio.to_thread(ExportWriter, path)
    try:
        call = stub.ExportMemories(
            coordinator_pb2.ExportMemoriesRequest(table=table), timeout=timeout_s
        )
        header: coordinator_pb2.ExportHeader | None = None
        async for msg in call:
            if msg.WhichOneof("part") == "header":
                header = msg.header
                continue
            if header is None:
                raise ExportStreamError("the export stream did not start with a header")
            await _write_chunk(writer, msg.memories)
            if progress is not None:
                progress(writer.memories, max(int(header.memories), writer.memories))
        if header is None:
            raise ExportStreamError("the export stream ended without a header")
        size = await asyncio.to_thread(writer.finish)
    except BaseException:
        await asyncio.to_thread(writer.abort)
        raise
    return ExportSummary(
        str(path), writer.memories, writer.payload_bytes, size, header.slots, header.slot_map_epoch
    )


async def _write_chunk(writer: ExportWriter, chunk: coordinator_pb2.MemoryChunk) -> None:
    """Decode one chunk and append it to the file (in a thread: it writes to disk)."""
    ids = ids_from_bytes(chunk.ids)
    strengths = f32_from_bytes(chunk.strengths, "strengths")
    if len(ids) != len(strengths) or len(chunk.payload_ids) != len(chunk.payloads):
        raise ExportStreamError(
            f"an export chunk holds {len(ids)} ids, {len(strengths)} strengths, "
            f"{len(chunk.payload_ids)} payload ids and {len(chunk.payloads)} payloads"
        )
    payloads = dict(zip(chunk.payload_ids, chunk.payloads, strict=True))
    await asyncio.to_thread(writer.add, ids, strengths, payloads)


async def load_export(path: str | os.PathLike[str], max_payload_bytes: int) -> ExportData:
    """Read and check an export file in a thread (``read_export``).

    Raises:
        MemoryFileError: unreadable, or a bad array (names the file and the array).
    """
    return await asyncio.to_thread(read_export, path, max_payload_bytes)


def batch_bounds(data: ExportData, batch: int, max_bytes: int) -> list[tuple[int, int]]:
    """Cut the file's memories into [start, stop) batches for upsert calls.

    At most ``batch`` memories and, payloads counted (12 bytes a memory plus its payload),
    about ``max_bytes`` each (a single memory larger than that goes alone), so one upsert
    message stays well under the gRPC message limit whatever the payloads.
    """
    n = len(data.ids)
    sizes = np.full(n, BYTES_PER_MEMORY, np.int64)
    if data.offsets is not None:
        sizes = sizes + np.diff(data.offsets.astype(np.int64)).astype(np.int64)
    return byte_ranges(sizes, max_bytes, batch)


async def upsert_export(
    data: ExportData,
    upsert: Upsert,
    batch: int = IMPORT_BATCH,
    progress: Callable[[int], None] | None = None,
    max_bytes: int = MAX_BATCH_BYTES,
) -> int:
    """Upsert a checked export in batches (``batch_bounds``); return distinct ids written.

    A failure part-way leaves the batches before it written: importing the same file again
    completes it (an upsert overwrites).

    Args:
        data: the file's memories.
        upsert: sends one batch.
        batch: most memories per call, >= 1.
        progress: called with each batch's size once it is acknowledged.
        max_bytes: about the most bytes per call, payloads counted.
    """
    written = 0
    for start, end in batch_bounds(data, batch, max_bytes):
        written += await upsert(
            data.ids[start:end], data.strengths[start:end], data.payloads(start, end)
        )
        if progress is not None:
            progress(end - start)
    return written


def forget_doc(reply: coordinator_pb2.ForgetWorkerResponse, name: str) -> dict[str, Any]:
    """A ``ForgetWorker`` reply as a dict (``Client.forget_worker``)."""
    return {
        "worker": name,
        "forgotten": reply.forgotten,
        "lost_slots": list(reply.lost_slots),
        "lost_memories": reply.lost_memories if reply.memories_known else None,
        "slots_kept": reply.slots_kept,
    }
