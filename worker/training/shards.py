"""The training rows a worker holds for one job, shard by shard, and how it gets them.

For a built-in data set (``digits``, ``synthetic``) the worker makes the whole set itself and
a shard is a slice of it. For a file data set (``data: {path}``) the worker never opens the
path, which names a file in the coordinator's data roots: it fetches the rows of each shard
it is given from the coordinator (``FetchShard``), then keeps them until the job ends, so a
shard handed over from a dead worker costs one fetch. Batch indices stay global
(``shared.training.data.batch_indices``); a shard's ``start`` maps them to its rows.

Shapes: R rows of a shard, ``*S`` the input shape of one sample.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
import numpy as np
from grpc import aio

from shared.config import FileData, TrainJobSpec
from shared.logging import get_logger
from shared.proto import coordinator_pb2, coordinator_pb2_grpc
from shared.rpc.codec import ChunkAssembler, CodecError
from shared.training.data import DataError, Dataset, load_dataset, shard_bounds

log = get_logger(__name__)
_X_DTYPES = (np.dtype(np.float32), np.dtype(np.int64))  # the loader's (tokens made int64)
_Y_DTYPES = (np.dtype(np.int64), np.dtype(np.float32))
Shard = tuple[int, int]  # (shard_index, shard_count)


class ShardMissing(LookupError):
    """The rows of a shard are not held here yet (FAILED_PRECONDITION: fetch them first)."""


class ShardFetchError(Exception):
    """The coordinator did not deliver a shard; ``code`` is FetchShard's gRPC status."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        """Name the failure and FetchShard's status ``code``."""
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ShardRows:
    """Global training rows [start, stop) of one shard.

    Attributes:
        x: [R, *S] the inputs (float32, or int64 tokens), R = stop - start.
        y: [R, ...] the targets as the task defines them (``shared.training.tasks``).
    """

    start: int
    stop: int
    x: np.ndarray
    y: np.ndarray


class TrainData:
    """What a worker knows of a job's training set: its sizes and the shards held here."""

    def __init__(
        self,
        n_train: int,
        input_shape: tuple[int, ...],
        num_classes: int,
        full: Dataset | None = None,
    ) -> None:
        """Describe a training set and the shards held so far.

        Args:
            n_train: training rows of the whole set (all shards).
            input_shape: ``S``, the shape of one sample.
            num_classes: the model's output width (classes, regression targets, vocabulary).
            full: the whole split data set when it was made here (built-in sets); then every
                shard is held.
        """
        self.n_train, self.input_shape, self.num_classes = n_train, input_shape, num_classes
        self._full = full
        self._shards: dict[Shard, ShardRows] = {}

    @classmethod
    def local(cls, spec: TrainJobSpec) -> TrainData:
        """Make a built-in data set here.

        Raises:
            DataError: the spec names a file: a worker does not open the coordinator's paths
                (INVALID_ARGUMENT).
        """
        if isinstance(spec.data, FileData):
            raise DataError(
                "data.path: a worker does not open data files; it fetches its shards' rows "
                "from the coordinator"
            )
        ds = load_dataset(spec.data, spec.seed, spec.test_fraction, spec.task, spec.vocab_size)
        return cls(len(ds.y_train), ds.input_shape, ds.num_classes, full=ds)

    def has(self, shard: Shard) -> bool:
        """Whether the rows of ``shard`` are held here."""
        return self._full is not None or shard in self._shards

    def rows(self, shard: Shard) -> ShardRows:
        """The rows of one shard.

        Raises:
            ShardMissing: not held here (FAILED_PRECONDITION).
            ValueError: a shard outside [0, shard_count) (INVALID_ARGUMENT).
        """
        start, stop = shard_bounds(self.n_train, *shard)
        if self._full is not None:
            ds = self._full
            return ShardRows(start, stop, ds.x_train[start:stop], ds.y_train[start:stop])
        try:
            return self._shards[shard]
        except KeyError:
            raise ShardMissing(f"shard {shard[0]} of {shard[1]} is not held here") from None

    def shards_of(self, rows: np.ndarray, shard_count: int) -> list[Shard]:
        """The shards of ``shard_count`` that hold some of ``rows`` (global row indices).

        Raises:
            ValueError: a row outside [0, n_train) (INVALID_ARGUMENT).
        """
        self._check_rows(rows)
        starts = [shard_bounds(self.n_train, s, shard_count)[0] for s in range(shard_count)]
        held = np.searchsorted(np.asarray(starts), rows, side="right") - 1
        return [(int(s), shard_count) for s in np.unique(held)]

    def gather(self, rows: np.ndarray, shard_count: int) -> tuple[np.ndarray, np.ndarray]:
        """The samples and labels of global ``rows``, in their order.

        Args:
            rows: [R] int64 global training row indices.
            shard_count: the job's shard count, to find the shards that hold them.

        Returns:
            x: [R, *S]; y: [R, ...], in the dtypes of the held shards.

        Raises:
            ValueError: a row outside [0, n_train) (INVALID_ARGUMENT).
            ShardMissing: a shard holding some of the rows is not held here
                (FAILED_PRECONDITION).
        """
        if self._full is not None:
            self._check_rows(rows)
            return self._full.x_train[rows], self._full.y_train[rows]
        shards = self.shards_of(rows, shard_count)
        first = self.rows(shards[0]) if shards else None
        x_dtype = first.x.dtype if first is not None else np.dtype(np.float32)
        y_dtype = first.y.dtype if first is not None else np.dtype(np.int64)
        y_tail = first.y.shape[1:] if first is not None else ()
        x = np.empty((len(rows), *self.input_shape), x_dtype)
        y = np.empty((len(rows), *y_tail), y_dtype)
        for shard in shards:
            part = self.rows(shard)
            mask = (rows >= part.start) & (rows < part.stop)
            x[mask] = part.x[rows[mask] - part.start]
            y[mask] = part.y[rows[mask] - part.start]
        return x, y

    def _check_rows(self, rows: np.ndarray) -> None:
        """Raises: ValueError: a row outside [0, n_train) (INVALID_ARGUMENT)."""
        if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= self.n_train):
            raise ValueError(f"rows: indices must be in [0, {self.n_train})")

    def add(self, shard: Shard, rows: ShardRows) -> None:
        """Keep fetched rows of ``shard``.

        Raises:
            DataError: the rows are not that shard's of this data set (INVALID_ARGUMENT).
        """
        start, stop = shard_bounds(self.n_train, *shard)
        n = stop - start
        if (rows.start, rows.stop) != (start, stop):
            raise DataError(
                f"shard {shard[0]} of {shard[1]}: got rows [{rows.start}, {rows.stop}), "
                f"expected [{start}, {stop})"
            )
        if rows.x.dtype not in _X_DTYPES or rows.x.shape != (n, *self.input_shape):
            raise DataError(
                f"shard {shard[0]}: x must be float32 or int64 {[n, *self.input_shape]}, got "
                f"{rows.x.dtype} {list(rows.x.shape)}"
            )
        if rows.y.dtype not in _Y_DTYPES or rows.y.shape[:1] != (n,):
            raise DataError(
                f"shard {shard[0]}: y must be int64 or float32 [{n}, ...], got "
                f"{rows.y.dtype} {list(rows.y.shape)}"
            )
        # Labels and tokens index the model's outputs; regression targets are checked finite
        # where the set is loaded.
        if n and rows.y.dtype == np.int64:
            if rows.y.min() < 0 or rows.y.max() >= self.num_classes:
                raise DataError(
                    f"shard {shard[0]}: labels or tokens outside [0, {self.num_classes})"
                )
        self._shards[shard] = rows


class ShardFetcher:
    """Fetches shards' rows from the coordinator over this worker's coordinator channel.

    The channel carries this worker's TLS and worker token.
    """

    def __init__(
        self, stub: coordinator_pb2_grpc.CoordinatorStub, worker: str, timeout_s: float
    ) -> None:
        """Fetch over ``stub`` as worker ``worker``.

        Args:
            stub: the coordinator's stub.
            worker: this worker's name (the coordinator checks it is part of the job).
            timeout_s: deadline of one fetch, seconds.
        """
        self._stub, self._worker, self._timeout_s = stub, worker, timeout_s

    async def fetch(self, job_id: str, shard: Shard) -> tuple[TrainData, ShardRows]:
        """Fetch one shard: the data set's sizes (a ``TrainData`` holding it) and its rows.

        The arrays are assembled and checked in a thread.

        Raises:
            ShardFetchError: FetchShard failed (its status: NOT_FOUND, PERMISSION_DENIED,
                UNAVAILABLE, ...).
            DataError: the reply is malformed or not the shard asked for (INVALID_ARGUMENT).
        """
        t0 = time.perf_counter()
        request = coordinator_pb2.FetchShardRequest(
            job_id=job_id, shard_index=shard[0], shard_count=shard[1], worker=self._worker
        )
        header: coordinator_pb2.ShardHeader | None = None
        assembler = ChunkAssembler()
        try:
            async for msg in self._stub.FetchShard(request, timeout=self._timeout_s):
                if msg.HasField("header"):
                    header = msg.header
                else:
                    assembler.add(msg.rows)
        except aio.AioRpcError as exc:
            raise ShardFetchError(
                f"FetchShard of job {job_id} shard {shard[0]}: {exc.details()}", exc.code()
            ) from None
        except CodecError as exc:
            raise DataError(f"FetchShard of job {job_id} shard {shard[0]}: {exc}") from None
        if header is None:
            raise DataError(f"FetchShard of job {job_id} shard {shard[0]}: no header")
        data, rows = await asyncio.to_thread(_decode, header, assembler, shard)
        log.info(
            "shard_fetched",
            job_id=job_id,
            shard=shard[0],
            shards=shard[1],
            rows=rows.stop - rows.start,
            bytes=rows.x.nbytes + rows.y.nbytes,
            seconds=round(time.perf_counter() - t0, 4),
        )
        return data, rows


def _decode(
    header: coordinator_pb2.ShardHeader, assembler: ChunkAssembler, shard: Shard
) -> tuple[TrainData, ShardRows]:
    try:
        arrays = assembler.result()
    except CodecError as exc:
        raise DataError(f"shard {shard[0]}: {exc}") from None
    if "x" not in arrays or "y" not in arrays:
        raise DataError(f"shard {shard[0]}: the reply lacks x or y")
    data = TrainData(header.n_train, tuple(header.input_shape), header.num_classes)
    rows = ShardRows(header.start, header.stop, arrays["x"], arrays["y"])
    data.add(shard, rows)
    return data, rows
