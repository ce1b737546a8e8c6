"""The ``neuroshard.v1.Coordinator`` service's data set RPCs.

PutDataset and ListDatasets (for people, ``neuroshard data put|ls``) and FetchShard (for the
workers of a train job).

Validation and mapping only; the work is in ``coordinator.datasets.dataset_store`` (uploads and
listing, blocking file I/O run in a thread) and ``coordinator.training.train_sets`` (the rows of
running jobs).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc import aio

from coordinator.cluster import Cluster
from coordinator.datasets.dataset_check import DatasetInvalid, DatasetTooLarge
from coordinator.datasets.dataset_store import (
    DatasetExists,
    DatasetNameError,
    DatasetNotOwned,
    StoredDataset,
    Upload,
    Uploader,
    UploadError,
    UploadLimit,
    list_datasets,
)
from coordinator.training.train_sets import BadShard, NotJobMember, ShardNotServed, row_bytes
from shared.logging import get_logger
from shared.proto import coordinator_pb2
from shared.rpc.codec import block_to_chunks
from shared.rpc.status_table import BadRequest, StatusTable
from shared.security.auth import current_principal

log = get_logger(__name__)

# Domain errors of the data set RPCs and the status each maps to.
_ERRORS = StatusTable(
    [
        (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),
        (DatasetNameError, grpc.StatusCode.INVALID_ARGUMENT),
        (DatasetInvalid, grpc.StatusCode.INVALID_ARGUMENT),
        (UploadError, grpc.StatusCode.INVALID_ARGUMENT),
        (DatasetTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (DatasetExists, grpc.StatusCode.ALREADY_EXISTS),
        (DatasetNotOwned, grpc.StatusCode.PERMISSION_DENIED),
        (UploadLimit, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (ShardNotServed, grpc.StatusCode.NOT_FOUND),
        (NotJobMember, grpc.StatusCode.PERMISSION_DENIED),
        (BadShard, grpc.StatusCode.INVALID_ARGUMENT),
    ]
)


def info_to_pb(stored: StoredDataset) -> coordinator_pb2.DatasetInfo:
    """A stored data set as its wire form."""
    return coordinator_pb2.DatasetInfo(
        name=stored.name,
        path=stored.path,
        bytes=stored.bytes,
        sha256=stored.sha256,
        kind=stored.kind,
        owner=stored.owner,
        arrays=[
            coordinator_pb2.DatasetArray(name=a.name, dtype=a.dtype, shape=list(a.shape))
            for a in stored.arrays
        ],
    )


class DataServicer:
    """PutDataset, ListDatasets and FetchShard, served through ``CoordinatorServicer``."""

    def __init__(self, cluster: Cluster) -> None:
        """Serve the data sets of ``cluster``'s data roots and the rows of its train jobs."""
        self._cluster = cluster

    async def PutDataset(
        self,
        request_iterator: AsyncIterator[coordinator_pb2.DatasetChunk],
        context: aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[coordinator_pb2.DatasetReply]:
        """Store a streamed .npz as NAME.npz in the first data root.

        Replies ``accepted`` to the header, then ``stored`` once the bytes are in place.
        Nothing is left in the data root when the upload is refused or cancelled. Under
        auth the caller's subject is recorded as the data set's owner.

        Raises:
            grpc.aio.AbortError: INVALID_ARGUMENT for no header first, a bad ``name``, a
                byte count other than declared, or not a valid data set (a corrupt archive
                included); RESOURCE_EXHAUSTED over ``max_dataset_bytes`` (names the cap and
                the size), with ``max_concurrent_uploads`` uploads in progress, or past
                ``max_data_root_bytes`` (each names its key); ALREADY_EXISTS when the name is
                taken and ``replace`` is false; PERMISSION_DENIED replacing a data set of
                another subject (only its owner or an admin may).
        """
        cfg = self._cluster.cfg
        principal = current_principal()
        uploader = (
            None if principal is None else Uploader(principal.subject, principal.role == "admin")
        )
        upload: Upload | None = None
        async with _ERRORS.mapped(context):
            try:
                async for msg in request_iterator:
                    if msg.HasField("header"):
                        if upload is not None:
                            raise UploadError("a second DatasetHeader in the stream")
                        h = msg.header
                        upload = await asyncio.to_thread(
                            Upload,
                            cfg.dataset_roots()[0],
                            h.name,
                            h.total_bytes,
                            cfg.max_dataset_bytes,
                            h.replace,
                            gate=self._cluster.uploads,
                            uploader=uploader,
                        )
                        yield coordinator_pb2.DatasetReply(
                            accepted=coordinator_pb2.DatasetAccepted()
                        )
                    elif upload is None:
                        raise UploadError("the stream must start with a DatasetHeader")
                    else:
                        await asyncio.to_thread(upload.write, msg.data)
                if upload is None:
                    raise UploadError("the stream must start with a DatasetHeader")
                stored = await asyncio.to_thread(upload.commit)
            finally:
                if upload is not None:
                    upload.discard()  # a cancelled or failed stream leaves nothing (no-op if kept)
        log.info(
            "dataset_stored",
            name=stored.name,
            bytes=stored.bytes,
            sha256=stored.sha256,
            kind=stored.kind,
            owner=stored.owner or None,
        )
        yield coordinator_pb2.DatasetReply(stored=info_to_pb(stored))

    async def ListDatasets(
        self, request: coordinator_pb2.ListDatasetsRequest, context: aio.ServicerContext[Any, Any]
    ) -> coordinator_pb2.ListDatasetsResponse:
        """The .npz and .npy files in the data roots (relative path, bytes, mtime, root, owner)."""
        entries = await asyncio.to_thread(list_datasets, self._cluster.cfg.dataset_roots())
        return coordinator_pb2.ListDatasetsResponse(
            datasets=[
                coordinator_pb2.DatasetEntry(
                    path=e.path,
                    bytes=e.bytes,
                    modified_at=e.modified_at,
                    root=e.root,
                    owner=e.owner,
                )
                for e in entries
            ]
        )

    async def FetchShard(
        self, request: coordinator_pb2.FetchShardRequest, context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[coordinator_pb2.ShardChunk]:
        """Stream training rows of one shard of a running train job to one of its workers.

        A ShardHeader (the shard's range, ``data_key``, the arrays' dtypes and row shapes);
        then, unless ``header_only``, TensorChunks of each array's rows [start, stop) (the
        whole shard when both are 0) as stored in the data set, read from the mapped files a
        block at a time in a thread (``coordinator.training.train_sets``).

        Raises:
            grpc.aio.AbortError: INVALID_ARGUMENT for no worker name, a shard that is not
                the job's, or rows outside the shard; PERMISSION_DENIED when the worker is
                not part of the job (under auth, the interceptor has already refused a
                worker token naming another worker in ``worker``); NOT_FOUND for no running
                train job with a file data set with that id.
        """
        async with _ERRORS.mapped(context):
            if not request.worker:
                raise BadRequest("worker: a name is required")
            rows = self._cluster.train_sets.shard(
                request.job_id,
                request.worker,
                request.shard_index,
                request.shard_count,
                request.start,
                request.stop,
            )
        count = 0 if request.header_only else rows.rows_stop - rows.rows_start
        log.info(
            "shard_served",
            job_id=request.job_id,
            worker=request.worker,
            shard=request.shard_index,
            rows=count,
        )
        yield coordinator_pb2.ShardChunk(
            header=coordinator_pb2.ShardHeader(
                n_train=rows.n_train,
                input_shape=list(rows.input_shape),
                num_classes=rows.num_classes,
                start=rows.start,
                stop=rows.stop,
                data_key=rows.data_key,
                arrays=[
                    coordinator_pb2.ShardArray(
                        name=a.name, dtype=a.dtype, row_shape=list(a.row_shape)
                    )
                    for a in rows.arrays
                ],
                rows_start=rows.rows_start,
                rows_stop=rows.rows_start + count,
                task=rows.task,
            )
        )
        if count == 0:
            return
        chunk_bytes = self._cluster.cfg.chunk_bytes
        layouts = {a.name: a for a in rows.arrays}
        blocks = rows.blocks(chunk_bytes)
        while (block := await asyncio.to_thread(next, blocks, None)) is not None:
            name, first, array = block
            layout = layouts[name]
            for chunk in block_to_chunks(
                name, array, (count, *layout.row_shape), first * row_bytes(layout), chunk_bytes
            ):
                yield coordinator_pb2.ShardChunk(rows=chunk)
