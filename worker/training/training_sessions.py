"""The training jobs this worker takes part in: one ``Trainer`` per job id.

A file data set's rows come from the coordinator (``worker.training.shards.ShardFetcher``): the
shard given at StartTraining is fetched before the trainer is built, and a shard handed over later
(a dead worker's) is fetched before its first step here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from shared.config import ConfigError, FileData, TrainJobSpec, job_spec_from_json
from shared.training.data import DataError, steps_per_epoch
from shared.training.models import check_model_entry, param_shapes
from worker.training.compressed_link import CompressedLink
from worker.training.shards import Shard, ShardFetcher, ShardRows, TrainData
from worker.training.trainer import GradResult, Trainer


class UnknownTrainingJob(KeyError):
    """No training session for that job id (FAILED_PRECONDITION: call StartTraining first)."""


class TrainingSessions:
    """Trainers by job id. Torch work runs on one dedicated thread, off the event loop."""

    def __init__(
        self,
        torch_threads: int,
        allowed_models: Mapping[str, str] | None = None,
        name: str = "",
        fetcher: ShardFetcher | None = None,
    ) -> None:
        """Start with no job; torch work gets its own thread.

        Args:
            torch_threads: ``torch.set_num_threads`` of the torch thread (process-wide).
            allowed_models: the model entry points a job may name.
            name: this worker's name, for messages.
            fetcher: gets file data sets' shards from the coordinator (None: file data sets
                are refused).
        """
        self._fetcher = fetcher
        self._fetching: dict[tuple[str, Shard], asyncio.Future[tuple[TrainData, ShardRows]]] = {}
        self._torch_threads = torch_threads
        self._allowed_models = dict(allowed_models or {})
        self._daemon = f"worker {name}".strip()
        self._trainers: dict[str, Trainer] = {}
        self._links: dict[str, CompressedLink] = {}
        # One thread: torch's intra-op pool (torch_threads) does the parallel work.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
        self._executor.submit(torch.set_num_threads, torch_threads)

    async def start(self, job_id: str, spec_json: str, shard_index: int, shard_count: int) -> int:
        """Load data and model for a job; return this shard's sample count.

        Raises:
            ConfigError: the spec is invalid or not a train spec (INVALID_ARGUMENT).
            EntryPointRefused: the spec names a model entry this worker's ``allowed_models``
                does not list (PERMISSION_DENIED); nothing is imported or loaded.
            ModelError: the entry's args do not fit its signature (INVALID_ARGUMENT).
            DeviceUnavailable: the job trains on cuda and this worker has none
                (FAILED_PRECONDITION).
            DataError: the data set cannot be made, or the fetched shard is malformed
                (INVALID_ARGUMENT).
            ShardFetchError: the coordinator did not deliver the shard (its status).
        """
        spec = job_spec_from_json(spec_json)
        if not isinstance(spec, TrainJobSpec):
            raise ConfigError(f"kind: expected 'train', got {spec.kind!r}")
        check_model_entry(spec, self._allowed_models, self._daemon)
        data = None  # a built-in data set is made on the torch thread by the Trainer
        if isinstance(spec.data, FileData):
            data, _rows = await self._fetch(job_id, (shard_index, shard_count))
        loop = asyncio.get_running_loop()
        trainer = await loop.run_in_executor(
            self._executor,
            Trainer,
            spec,
            shard_index,
            shard_count,
            self._torch_threads,
            self._allowed_models,
            self._daemon,
            data,
        )
        self._trainers[job_id] = trainer
        if spec.compression.name != "none":
            self._links[job_id] = CompressedLink(spec, param_shapes(trainer.model))
        return int(trainer.train_samples)

    def link(self, job_id: str) -> CompressedLink | None:
        """The job's compressed link (held parameters, gradient residual); None: ``none``."""
        return self._links.get(job_id)

    def get(self, job_id: str) -> Trainer:
        """The trainer of a job. Raises: UnknownTrainingJob (FAILED_PRECONDITION)."""
        try:
            return self._trainers[job_id]
        except KeyError:
            raise UnknownTrainingJob(f"no training session for job {job_id!r}") from None

    async def _fetch(self, job_id: str, shard: Shard) -> tuple[TrainData, ShardRows]:
        """Fetch ``shard`` from the coordinator: a ``TrainData`` holding it, and its rows.

        Concurrent asks for the same shard share one fetch.
        """
        if self._fetcher is None:
            raise DataError("data.path: this worker has no coordinator to fetch shards from")
        key = (job_id, shard)
        pending = self._fetching.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._fetcher.fetch(job_id, shard))
            self._fetching[key] = pending
            pending.add_done_callback(lambda _f: self._fetching.pop(key, None))
        return await asyncio.shield(pending)

    async def compute(
        self,
        job_id: str,
        trainer: Trainer,
        epoch: int,
        step_in_epoch: int,
        shard: tuple[int, int],
        loss_scale: float = 1.0,
        rows: np.ndarray | None = None,
        inner_rows: Sequence[int] = (),
    ) -> GradResult:
        """Gradients of one step on the torch thread (``Trainer.compute_gradients``).

        With ``strategy: diloco`` and ``rows`` the answer is the pseudo-gradient of local
        steps on them instead (``Trainer.local_steps``): ``inner_rows`` cuts the rows into
        the inner batches (empty: one batch), the first being inner step ``step_in_epoch``
        of ``epoch``.

        The shard's rows are fetched first when they are not held here (a shard handed over
        from another worker). ``loss_scale``: the coordinator's fp16 loss scale (1.0: none).
        ``rows``: [R] int64 global rows to compute on instead of the shard's rows of the step
        (the coordinator's piece of the step); the shards holding them are fetched as needed.

        Raises:
            ShardFetchError, DataError: as :meth:`start`.
            ValueError: a row outside the training split (INVALID_ARGUMENT).
        """
        needed = [shard] if rows is None else trainer.data.shards_of(rows, shard[1])
        for s in needed:
            if not trainer.data.has(s):
                _data, got = await self._fetch(job_id, s)
                await asyncio.to_thread(trainer.data.add, s, got)  # checks the rows
        loop = asyncio.get_running_loop()

        def work() -> GradResult:
            trainer.set_shard(*shard)
            spec = trainer.spec
            if rows is not None and spec.strategy == "diloco":
                per_epoch = steps_per_epoch(
                    trainer.n_train, spec.workers, spec.batch_size, spec.grad_accum_steps
                )
                first = epoch * per_epoch + step_in_epoch
                return trainer.local_steps(rows, list(inner_rows) or [len(rows)], first)
            if rows is not None:
                return trainer.compute_rows(rows, loss_scale)
            return trainer.compute_gradients(epoch, step_in_epoch, loss_scale)

        return await loop.run_in_executor(self._executor, work)

    async def set_params(
        self, trainer: Trainer, params: dict[str, np.ndarray], version: int
    ) -> None:
        """Load parameters and buffers (name -> array) of ``version`` on the torch thread."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, trainer.set_params, params, version)

    def stop(self, job_id: str) -> None:
        """Forget a job's trainer and compressed link (idempotent)."""
        self._trainers.pop(job_id, None)
        self._links.pop(job_id, None)

    def close(self) -> None:
        """Drop every trainer, cancel shard fetches and stop the torch thread."""
        for pending in list(self._fetching.values()):
            pending.cancel()
        self._trainers.clear()
        self._links.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
