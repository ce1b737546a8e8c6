"""The training rows a worker holds for one job, and how it gets them from the coordinator.

For a built-in data set (``digits``, ``synthetic``) the worker makes the whole set itself and
a shard is a slice of it. For a file data set (``data: {path}``) the worker never opens the
path, which names a file in the coordinator's data roots: for each shard it is given it asks
the coordinator for the shard's header (``FetchShard`` with ``header_only``), fetches the rows
its shard cache lacks (``worker.training.shard_cache``: on disk, kept across jobs by the data
set's content and the row range) and memory-maps them. Rows are held as the data set stores
them (any numeric dtype) and converted to the task's dtypes a batch at a time
(``shared.training.tasks.task_arrays``), so a shard larger than the worker's memory trains.
Batch indices stay global (``shared.training.data.batch_indices``); a piece's ``start`` maps
them to its rows.

Shapes: R rows, ``*S`` one stored row's shape.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import numpy as np
from grpc import aio

from shared.config import FileData, TrainJobSpec
from shared.logging import get_logger
from shared.metrics import Metrics
from shared.proto import coordinator_pb2, coordinator_pb2_grpc
from shared.training.data import DataError, Dataset, load_dataset, shard_bounds
from shared.training.data_files import MappedArray
from shared.training.tasks import task_arrays
from worker.training.shard_cache import Layout, Piece, ShardCache

log = get_logger(__name__)
Shard = tuple[int, int]  # (shard_index, shard_count)


class ShardMissing(LookupError):
    """The rows of a shard are not held here yet (FAILED_PRECONDITION: fetch them first)."""


class ShardFetchError(Exception):
    """The coordinator did not deliver a shard; ``code`` is FetchShard's gRPC status."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        """Name the failure and FetchShard's status ``code``."""
        super().__init__(message)
        self.code = code


class Rows(Protocol):
    """Global training rows [start, stop) and their arrays in the task's dtypes."""

    start: int
    stop: int

    @property
    def x(self) -> np.ndarray:
        """[R, ...] the inputs."""
        ...

    @property
    def y(self) -> np.ndarray:
        """[R, ...] the targets."""
        ...


@dataclass(frozen=True)
class ShardRows:
    """Global training rows [start, stop) of one shard, in memory.

    Attributes:
        x: [R, *S] the inputs, as stored or in the task's dtypes.
        y: [R, ...] the targets (None: tokens whose targets are ``x`` shifted by one).
    """

    start: int
    stop: int
    x: np.ndarray
    y: np.ndarray


@dataclass
class _Held:
    """Rows [start, stop) held here: arrays by name (``x``, maybe ``y``), in memory or mapped."""

    start: int
    stop: int
    arrays: dict[str, Any]
    piece: Piece | None = None  # the cache entry they are mapped from (pinned)


@dataclass
class _Counts:
    fetched_bytes: int = 0
    cached_rows: int = 0


class TrainData:
    """What a worker knows of a job's training set: its sizes and the rows held here."""

    def __init__(
        self,
        n_train: int,
        input_shape: tuple[int, ...],
        num_classes: int,
        full: Dataset | None = None,
        task: str = "classification",
        data_key: str = "",
    ) -> None:
        """Describe a training set and the rows held so far.

        Args:
            n_train: training rows of the whole set (all shards).
            input_shape: the model's input shape of one sample.
            num_classes: the model's output width (classes, regression targets, vocabulary).
            full: the whole split data set when it was made here (built-in sets); then every
                shard is held.
            task: the job's task: how held rows are converted (``tasks.task_arrays``).
            data_key: the coordinator's name of the rows' content ("" for a built-in set).
        """
        self.n_train, self.input_shape, self.num_classes = n_train, input_shape, num_classes
        self.task, self.data_key = task, data_key
        self._full = full
        self._held: list[_Held] = []
        self._cache: ShardCache | None = None

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
        return cls(len(ds.y_train), ds.input_shape, ds.num_classes, full=ds, task=spec.task)

    def covers(self, start: int, stop: int) -> bool:
        """Whether every row of [start, stop) is held here."""
        if self._full is not None:
            return True
        at = start
        for h in sorted(self._held, key=lambda h: h.start):
            if h.start <= at < h.stop:
                at = h.stop
        return at >= stop

    def has(self, shard: Shard) -> bool:
        """Whether the rows of ``shard`` are held here."""
        return self.covers(*shard_bounds(self.n_train, *shard))

    def rows(self, shard: Shard) -> tuple[int, int]:
        """The global row range of one shard held here.

        Raises:
            ShardMissing: not held here (FAILED_PRECONDITION).
            ValueError: a shard outside [0, shard_count) (INVALID_ARGUMENT).
        """
        start, stop = shard_bounds(self.n_train, *shard)
        if not self.covers(start, stop):
            raise ShardMissing(f"shard {shard[0]} of {shard[1]} is not held here")
        return start, stop

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
        """The samples and targets of global ``rows``, in their order, in the task's dtypes.

        Only these rows are read (from memory or the mapped cache entries) and converted.

        Args:
            rows: [R] int64 global training row indices.
            shard_count: the job's shard count, to name a shard that is not held.

        Returns:
            x: [R, ...]; y: [R, ...] (``tasks.task_arrays``).

        Raises:
            ValueError: a row outside [0, n_train) (INVALID_ARGUMENT).
            ShardMissing: a shard holding some of the rows is not held here
                (FAILED_PRECONDITION).
            DataError: a label or token id outside [0, num_classes) (INVALID_ARGUMENT).
        """
        if self._full is not None:
            self._check_rows(rows)
            return self._full.x_train[rows], self._full.y_train[rows]
        for shard in self.shards_of(rows, shard_count):
            self.rows(shard)  # raises ShardMissing
        names = list(self._held[0].arrays) if self._held else ["x", "y"]
        parts: dict[str, np.ndarray] = {}
        filled = np.zeros(len(rows), bool)
        for h in self._held:
            mask = (rows >= h.start) & (rows < h.stop) & ~filled
            if not mask.any():
                continue
            local = (rows[mask] - h.start).astype(np.int64)
            for name in names:
                arr = h.arrays[name]
                got = arr.take(local) if isinstance(arr, MappedArray) else arr[local]
                if name not in parts:
                    parts[name] = np.empty((len(rows), *got.shape[1:]), got.dtype)
                parts[name][mask] = got
            filled |= mask
        x, y = task_arrays(self.task, parts["x"], parts.get("y"))
        self._check_targets(y)
        return x, y

    def _check_targets(self, y: np.ndarray) -> None:
        """Labels and tokens index the model's outputs: refuse ones outside [0, C)."""
        if len(y) and y.dtype == np.int64 and (y.min() < 0 or y.max() >= self.num_classes):
            raise DataError(f"y: labels or tokens outside [0, {self.num_classes})")

    def _check_rows(self, rows: np.ndarray) -> None:
        """Raises: ValueError: a row outside [0, n_train) (INVALID_ARGUMENT)."""
        if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= self.n_train):
            raise ValueError(f"rows: indices must be in [0, {self.n_train})")

    def add(self, shard: Shard, rows: ShardRows) -> None:
        """Keep the rows of ``shard`` given in memory.

        Raises:
            DataError: the rows are not that shard's (INVALID_ARGUMENT).
        """
        start, stop = shard_bounds(self.n_train, *shard)
        n = stop - start
        if (rows.start, rows.stop) != (start, stop):
            raise DataError(
                f"shard {shard[0]} of {shard[1]}: got rows [{rows.start}, {rows.stop}), "
                f"expected [{start}, {stop})"
            )
        arrays = {"x": rows.x} if rows.y is None else {"x": rows.x, "y": rows.y}
        for name, a in arrays.items():
            if len(a) != n:
                raise DataError(f"shard {shard[0]}: {name} must have {n} rows, got {len(a)}")
        self._held.append(_Held(start, stop, arrays))

    def add_pieces(self, cache: ShardCache, pieces: list[Piece]) -> None:
        """Hold cache entries (pinned until ``close``)."""
        self._cache = cache
        known = {h.piece.name for h in self._held if h.piece is not None}
        for p in cache.pin(p for p in pieces if p.name not in known):
            self._held.append(_Held(p.start, p.stop, dict(p.arrays), p))

    def merge(self, other: TrainData) -> None:
        """Hold the rows ``other`` holds too (a shard fetched for this job later)."""
        known = {id(h) for h in self._held}
        self._held.extend(h for h in other._held if id(h) not in known)
        self._cache = self._cache or other._cache
        other._held = []

    def close(self) -> None:
        """Release the cache entries held (the job ended); idempotent."""
        pieces = [h.piece for h in self._held if h.piece is not None]
        self._held = []
        if self._cache is not None and pieces:
            self._cache.unpin(pieces)


@dataclass
class FetchedRows:
    """A fetched shard's rows, converted to the task's dtypes when first read.

    What an allreduce child loads whole (``worker.allreduce``); reading ``x`` or ``y``
    releases ``data``'s cache entries. The sync and diloco trainers read ``data`` instead.
    """

    data: TrainData
    start: int
    stop: int
    _xy: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self._xy is None:
            rows = np.arange(self.start, self.stop, dtype=np.int64)
            self._xy = self.data.gather(rows, 1) if len(rows) else _empty(self.data)
            self.data.close()  # read whole into memory: the cache entries are free again
        return self._xy

    @property
    def x(self) -> np.ndarray:
        """[R, ...] the inputs in the task's dtype (the whole range, in memory)."""
        return self._arrays()[0]

    @property
    def y(self) -> np.ndarray:
        """[R, ...] the targets in the task's dtype."""
        return self._arrays()[1]


def _empty(data: TrainData) -> tuple[np.ndarray, np.ndarray]:
    x_dtype = np.int64 if data.task == "language_model" else np.float32
    return np.empty((0, *data.input_shape), x_dtype), np.empty((0,), np.int64)


class ShardFetcher:
    """Fetches shards' rows from the coordinator into this worker's shard cache.

    The channel carries this worker's TLS and worker token.
    """

    def __init__(
        self,
        stub: coordinator_pb2_grpc.CoordinatorStub,
        worker: str,
        timeout_s: float,
        cache: ShardCache,
        metrics: Metrics | None = None,
    ) -> None:
        """Fetch over ``stub`` as worker ``worker`` into ``cache``.

        Args:
            stub: the coordinator's stub.
            worker: this worker's name (the coordinator checks it is part of the job).
            timeout_s: deadline of one FetchShard call, seconds.
            cache: where fetched rows are kept.
            metrics: counts ``neuroshard_shard_rows_total{source}`` and
                ``neuroshard_shard_fetched_bytes_total``; None: not counted.
        """
        self._stub, self._worker, self._timeout_s = stub, worker, timeout_s
        self.cache, self._metrics = cache, metrics
        self.counts = _Counts()

    async def fetch(self, job_id: str, shard: Shard) -> tuple[TrainData, FetchedRows]:
        """Hold one shard: fetch the rows the cache lacks, map the entries that cover it.

        Returns:
            A ``TrainData`` holding the shard (its entries pinned until ``close``), and its
            rows (read, converted, only when ``x`` or ``y`` is asked for).

        Raises:
            ShardFetchError: FetchShard failed (its status: NOT_FOUND, PERMISSION_DENIED,
                UNAVAILABLE, ...).
            DataError: the reply is malformed or not the rows asked for (INVALID_ARGUMENT).
        """
        t0 = time.perf_counter()
        header = await self._header(job_id, shard)
        # no key (a coordinator of the release before): rows are this fetch's own
        key = header.data_key or uuid.uuid4().hex
        layouts = [Layout(a.name, a.dtype, tuple(a.row_shape)) for a in header.arrays]
        data = TrainData(
            header.n_train,
            tuple(header.input_shape),
            header.num_classes,
            task=header.task or "classification",
            data_key=key,
        )
        start, stop = int(header.start), int(header.stop)
        if (start, stop) != shard_bounds(data.n_train, *shard):
            raise DataError(f"shard {shard[0]}: the coordinator sent rows [{start}, {stop})")
        # Pinned before anything is fetched: making room for the fetched rows must not
        # remove the entries counted as held.
        try:
            data.add_pieces(self.cache, self.cache.covering(key, start, stop))
            gaps = self.cache.missing(key, start, stop)
            fetched = 0
            for a, b in gaps:
                got, piece = await self._rows(job_id, shard, key, a, b, layouts)
                data.add_pieces(self.cache, [piece])
                fetched += got
            if not data.covers(start, stop):
                raise DataError(f"shard {shard[0]}: rows [{start}, {stop}) could not be held")
        except BaseException:
            data.close()
            raise
        cached = (stop - start) - sum(b - a for a, b in gaps)
        self.counts.fetched_bytes += fetched
        self.counts.cached_rows += cached
        if self._metrics is not None:
            self._metrics.shard_fetched_bytes.inc(fetched)
            self._metrics.shard_rows.labels("coordinator").inc(stop - start - cached)
            self._metrics.shard_rows.labels("cache").inc(cached)
        log.info(
            "shard_fetched",
            job_id=job_id,
            shard=shard[0],
            shards=shard[1],
            rows=stop - start,
            cached_rows=cached,
            bytes=fetched,
            seconds=round(time.perf_counter() - t0, 4),
        )
        return data, FetchedRows(data, start, stop)

    async def _header(self, job_id: str, shard: Shard) -> coordinator_pb2.ShardHeader:
        request = coordinator_pb2.FetchShardRequest(
            job_id=job_id,
            shard_index=shard[0],
            shard_count=shard[1],
            worker=self._worker,
            header_only=True,
        )
        header = None
        try:
            async for msg in self._stub.FetchShard(request, timeout=self._timeout_s):
                if msg.HasField("header"):
                    header = msg.header
        except aio.AioRpcError as exc:
            raise ShardFetchError(
                f"FetchShard of job {job_id} shard {shard[0]}: {exc.details()}", exc.code()
            ) from None
        if header is None:
            raise DataError(f"FetchShard of job {job_id} shard {shard[0]}: no header")
        return header

    async def _rows(
        self, job_id: str, shard: Shard, key: str, start: int, stop: int, layouts: list[Layout]
    ) -> tuple[int, Piece]:
        """Stream rows [start, stop) into a new cache entry; return the bytes and the entry."""
        request = coordinator_pb2.FetchShardRequest(
            job_id=job_id,
            shard_index=shard[0],
            shard_count=shard[1],
            worker=self._worker,
            start=start,
            stop=stop,
        )
        writer = await asyncio.to_thread(self.cache.writer, key, start, stop, layouts)
        received = 0
        try:
            async for msg in self._stub.FetchShard(request, timeout=self._timeout_s):
                if msg.HasField("header"):
                    h = msg.header
                    if (h.rows_start, h.rows_stop) != (start, stop):
                        raise DataError(
                            f"shard {shard[0]}: the reply is not rows [{start}, {stop})"
                        )
                    continue
                c = msg.rows
                await asyncio.to_thread(writer.write, c.name, c.offset, c.data)
                received += len(c.data)
            piece = await asyncio.to_thread(writer.commit)
        except aio.AioRpcError as exc:
            writer.abort()
            raise ShardFetchError(
                f"FetchShard of job {job_id} shard {shard[0]}: {exc.details()}", exc.code()
            ) from None
        except BaseException:
            writer.abort()
            raise
        return received, piece
