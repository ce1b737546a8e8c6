"""The training sets of running train jobs, served to their workers shard by shard.

Served by the FetchShard RPC, so that no worker needs the coordinator's files.

A ``TrainJob`` loads its data set once (the parameter server evaluates on its test rows) and
registers it here for as long as it runs; a worker of the job asks for the training rows of
the shard it was given, and again for another shard when a dead worker's shard is handed to
it. Rows are views of the loaded arrays: nothing is copied until they are sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shared.training.data import Dataset, shard_bounds


class ShardNotServed(KeyError):
    """No running train job with that id (NOT_FOUND)."""


class NotJobMember(PermissionError):
    """The asking worker is not part of the job (PERMISSION_DENIED)."""


class BadShard(ValueError):
    """A shard index or count that is not the job's (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class ShardRows:
    """The training rows [start, stop) of one shard and what a worker needs to train on them.

    Attributes:
        x: [stop - start, *input_shape] a view of the job's training inputs (float32, or
            int64 tokens).
        y: [stop - start, ...] the targets as the job's task defines them
            (``shared.training.tasks``); num_classes is the model's output width.
    """

    n_train: int
    input_shape: tuple[int, ...]
    num_classes: int
    start: int
    stop: int
    x: np.ndarray
    y: np.ndarray


@dataclass(frozen=True)
class _Served:
    dataset: Dataset
    shards: int
    is_member: Callable[[str], bool]


class TrainSets:
    """Data sets of running train jobs by job id."""

    def __init__(self) -> None:
        """No job served yet."""
        self._jobs: dict[str, _Served] = {}

    def open(
        self, job_id: str, dataset: Dataset, shards: int, is_member: Callable[[str], bool]
    ) -> None:
        """Serve a job's training rows in ``shards`` shards until :meth:`close`.

        Args:
            job_id: the job.
            dataset: its loaded, split data set.
            shards: the job's shard count (``spec.workers``).
            is_member: whether a worker name is part of the job.
        """
        self._jobs[job_id] = _Served(dataset, shards, is_member)

    def close(self, job_id: str) -> None:
        """Stop serving a job's rows and drop the reference to its data set (idempotent)."""
        self._jobs.pop(job_id, None)

    def __contains__(self, job_id: str) -> bool:
        """True while ``job_id`` is a running train job with its data set here."""
        return job_id in self._jobs

    def shard(self, job_id: str, worker: str, shard_index: int, shard_count: int) -> ShardRows:
        """The training rows of one shard of a running job, for one of its workers.

        Raises:
            ShardNotServed: no running train job ``job_id`` (NOT_FOUND).
            NotJobMember: ``worker`` is not part of the job (PERMISSION_DENIED).
            BadShard: ``shard_count`` is not the job's, or ``shard_index`` is outside
                [0, shard_count) (INVALID_ARGUMENT).
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
        ds = served.dataset
        n_train = len(ds.y_train)
        start, stop = shard_bounds(n_train, shard_index, shard_count)
        return ShardRows(
            n_train,
            ds.input_shape,
            ds.num_classes,
            start,
            stop,
            ds.x_train[start:stop],
            ds.y_train[start:stop],
        )
