"""The training sets of running train jobs, served to their workers row range by row range.

Served by the FetchShard RPC, so that no worker needs the coordinator's files.

A ``TrainJob`` opens its data set once (``open_source``: a file set stays memory-mapped,
``shared.training.file_sets``; a built-in set is made in memory) and registers it here for
as long as it runs. A worker of the job first asks for a shard's header (its ``data_key``,
the arrays' dtypes and row shapes), then for the rows of the shard its cache lacks
(``worker.training.shard_cache``); the rows are read from the mapped files a block at a
time, in the dtypes they are stored in, and never held whole.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coordinator.datasets.content_hashes import ContentHashes
from coordinator.jobs.jobs import JobFailed
from shared.config import BuiltinData, CoordinatorConfig, FileData, TrainJobSpec
from shared.security.confinement import PathRefused, with_resolved_paths
from shared.training.data import DataError, TrainSource, load_dataset, shard_bounds
from shared.training.file_sets import FileSet, open_file_set


class ShardNotServed(KeyError):
    """No running train job with that id, or it has no file data set (NOT_FOUND)."""


class NotJobMember(PermissionError):
    """The asking worker is not part of the job (PERMISSION_DENIED)."""


class BadShard(ValueError):
    """A shard index or count that is not the job's, or rows outside it (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class ArrayLayout:
    """One array of a training row as stored: its name, dtype and one row's shape."""

    name: str
    dtype: str
    row_shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardRows:
    """Training rows [rows_start, rows_stop) of one shard [start, stop), and how to read them.

    Attributes:
        data_key: names the training rows' content (``FileSet.data_key``).
        arrays: the arrays of a row as stored (``x``, and ``y`` when the set has one).
        blocks: yields (array name, first row relative to rows_start, [b, *row_shape]) as
            stored, array by array; each call reads its block from the mapped files.
    """

    n_train: int
    input_shape: tuple[int, ...]
    num_classes: int
    start: int
    stop: int
    rows_start: int
    rows_stop: int
    data_key: str
    task: str
    arrays: tuple[ArrayLayout, ...]
    blocks: Callable[[int], Iterator[tuple[str, int, np.ndarray]]]


def open_source(
    data: BuiltinData | FileData,
    spec: TrainJobSpec,
    hashes: ContentHashes,
    max_compressed_bytes: int,
) -> TrainSource:
    """A job's data set: a file set mapped and hashed, or a built-in set made in memory.

    Blocking (a file set's values are checked and its content hashed): call it in a thread.

    Args:
        data: the spec's ``data``, its path confined to the data roots.
        spec: the job (task, vocab_size, seed, test_fraction).
        hashes: the coordinator's content hashes, by file version.
        max_compressed_bytes: ``max_compressed_array_bytes``.

    Raises:
        DataError: the data set cannot be opened, or its layout or values do not fit the
            task (names the array and the first bad row).
        OSError: a file cannot be read.
    """
    if isinstance(data, BuiltinData):
        return load_dataset(data, spec.seed, spec.test_fraction, spec.task, spec.vocab_size)
    path = Path(data.path)
    fs = open_file_set(
        path, spec.task, spec.vocab_size, spec.seed, spec.test_fraction, max_compressed_bytes
    )
    fs.set_content_hash(hashes.get(path))
    return fs


async def open_job_source(
    spec: TrainJobSpec, cfg: CoordinatorConfig, hashes: ContentHashes
) -> TrainSource:
    """A running job's data set (``open_source`` in a thread), its path confined again.

    The path was confined at admission; it is resolved again here because a symlink under
    the data roots may have changed since.

    Args:
        spec: the job.
        cfg: the coordinator's config (``data_roots``, ``max_compressed_array_bytes``).
        hashes: the coordinator's content hashes, by file version.

    Raises:
        JobFailed: the path now resolves outside the data roots, or the data set cannot be
            opened or does not fit the task (``data.path: ...``); the job FAILS.
        OSError: a file cannot be read.
    """
    try:
        data = with_resolved_paths(spec, cfg.dataset_roots()).data
    except PathRefused as exc:
        raise JobFailed(str(exc)) from None
    try:
        return await asyncio.to_thread(
            open_source, data, spec, hashes, cfg.max_compressed_array_bytes
        )
    except DataError as exc:
        raise JobFailed(f"data.path: {exc}") from None


@dataclass(frozen=True)
class _Served:
    source: TrainSource
    shards: int
    is_member: Callable[[str], bool]


class TrainSets:
    """Data sets of running train jobs by job id, and the content hashes of data sets."""

    def __init__(self) -> None:
        """No job served yet."""
        self._jobs: dict[str, _Served] = {}
        self.hashes = ContentHashes()

    def open(
        self, job_id: str, source: TrainSource, shards: int, is_member: Callable[[str], bool]
    ) -> None:
        """Serve a job's training rows in ``shards`` shards until :meth:`close`.

        Args:
            job_id: the job.
            source: its opened data set (only a ``FileSet``'s rows are fetched).
            shards: the job's shard count (``spec.workers``).
            is_member: whether a worker name is part of the job.
        """
        self._jobs[job_id] = _Served(source, shards, is_member)

    def close(self, job_id: str) -> None:
        """Stop serving a job's rows and drop the reference to its data set (idempotent)."""
        self._jobs.pop(job_id, None)

    def __contains__(self, job_id: str) -> bool:
        """True while ``job_id`` is a running train job with its data set here."""
        return job_id in self._jobs

    def shard(
        self,
        job_id: str,
        worker: str,
        shard_index: int,
        shard_count: int,
        start: int = 0,
        stop: int = 0,
    ) -> ShardRows:
        """Rows of one shard of a running job, for one of its workers.

        Args:
            job_id: the job.
            worker: the asking worker.
            shard_index: the shard, in [0, shard_count).
            shard_count: the job's shard count.
            start: first global training row wanted, within the shard.
            stop: end of the rows wanted (``start == stop == 0``: the whole shard).

        Raises:
            ShardNotServed: no running train job ``job_id`` with a file data set (NOT_FOUND).
            NotJobMember: ``worker`` is not part of the job (PERMISSION_DENIED).
            BadShard: ``shard_count`` is not the job's, ``shard_index`` is outside
                [0, shard_count), or [start, stop) is not within the shard
                (INVALID_ARGUMENT).
        """
        served = self._jobs.get(job_id)
        if served is None:
            raise ShardNotServed(f"no running train job {job_id!r}")
        if not served.is_member(worker):
            raise NotJobMember(f"worker {worker!r} is not part of job {job_id!r}")
        if shard_count != served.shards or not 0 <= shard_index < shard_count:
            raise BadShard(
                f"shard {shard_index} of {shard_count}: job {job_id!r} has {served.shards} shards"
            )
        fs = served.source
        if not isinstance(fs, FileSet):
            raise ShardNotServed(f"job {job_id!r} has no file data set to fetch rows from")
        lo, hi = shard_bounds(fs.n_train, shard_index, shard_count)
        if (start, stop) == (0, 0):
            start, stop = lo, hi
        if not lo <= start <= stop <= hi:
            raise BadShard(f"rows [{start}, {stop}) are not within shard [{lo}, {hi})")
        arrays = tuple(
            ArrayLayout(n, fs.arrays[n].dtype.name, fs.arrays[n].shape[1:]) for n in fs.streamed
        )
        a, b = start, stop
        return ShardRows(
            fs.n_train,
            fs.input_shape,
            fs.num_classes,
            lo,
            hi,
            start,
            stop,
            fs.data_key,
            fs.task,
            arrays,
            lambda block_bytes: fs.native_blocks(a, b, block_bytes),
        )


def row_bytes(layout: ArrayLayout) -> int:
    """Bytes of one row of an array as stored."""
    return math.prod(layout.row_shape) * np.dtype(layout.dtype).itemsize
