"""The training jobs this worker takes part in: one ``Trainer`` per job id.

A diloco job's calls run DiLoCo's inner loop (``worker.training.diloco.LocalSteps``, one per
job, kept with its inner optimizer).

A file data set's rows come from the coordinator (``worker.training.shards.ShardFetcher``): the
shard given at StartTraining is fetched before the trainer is built, and the shards holding a
step's rows that are not held here (a dead worker's) are fetched before the step.

One ComputeGradients call is one ``TrainingSessions.step``: load the parameters the call carries
(through the job's compressed link when it has one), or check that the held ones are of the
call's version, then compute the gradients of the call's rows on the torch thread and hand them
back in the link's wire form.

Shapes: R rows of one call.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from shared.config import ConfigError, FileData, TrainJobSpec, job_spec_from_json
from shared.training.data import DataError
from shared.training.models import check_model_entry, param_shapes
from worker.training.compressed_link import CompressedLink, StaleBase
from worker.training.diloco import InnerSteps, LocalSteps, legacy_inner_steps
from worker.training.shards import Rows, Shard, ShardFetcher, TrainData
from worker.training.trainer import GradResult, Trainer


class UnknownTrainingJob(KeyError):
    """No training session for that job id (FAILED_PRECONDITION: call StartTraining first)."""


class BadParams(ValueError):
    """A step's parameters do not fit the job (INVALID_ARGUMENT).

    Names or shapes that are not the model's, a malformed compressed wire form, or a delta
    for a job without compression; the message starts with the field at fault.
    """


@dataclass(frozen=True)
class StepInput:
    """One ComputeGradients call, decoded.

    Attributes:
        job_id: the job.
        epoch: the epoch of the step, from 0.
        step_in_epoch: the step within the epoch (diloco: the first inner step's).
        params_version: the coordinator's parameter version the step is computed at.
        params: name -> array of the parameters and buffers when the call carries them
            (float32, or the compressed link's wire form when ``params_delta``); None when
            the worker is to use the ones it holds.
        params_delta: ``params`` is a compressed delta against ``base_version``.
        base_version: the version the delta applies to.
        rows: [R] int64 global training rows to compute on.
        inner_rows: diloco: ``rows`` cut into the local steps' batches (empty: one batch).
        loss_scale: the coordinator's fp16 loss scale, > 0 (1.0: none).
        inner_steps: diloco: run local steps, these (None: gradients, or from a coordinator
            of the release before, ``legacy_inner_steps``).
        weights: prioritized sampling: [R] float32 importance weights aligned with ``rows``
            (the loss is mean_i(w_i * l_i) and the per-sample losses go back); None: all 1.
    """

    job_id: str
    epoch: int
    step_in_epoch: int
    params_version: int
    params: dict[str, np.ndarray] | None
    params_delta: bool
    base_version: int
    rows: np.ndarray
    inner_rows: tuple[int, ...] = ()
    loss_scale: float = 1.0
    inner_steps: InnerSteps | None = None
    weights: np.ndarray | None = None


class TrainingSessions:
    """Trainers by job id. Torch work runs on one dedicated thread, off the event loop."""

    def __init__(
        self,
        torch_threads: int,
        allowed_models: Mapping[str, str] | None = None,
        name: str = "",
        fetcher: ShardFetcher | None = None,
        allowed_losses: Mapping[str, str] | None = None,
    ) -> None:
        """Start with no job; torch work gets its own thread.

        Args:
            torch_threads: ``torch.set_num_threads`` of the torch thread (process-wide).
            allowed_models: the model entry points a job may name.
            name: this worker's name, for messages.
            fetcher: gets file data sets' shards from the coordinator (None: file data sets
                are refused).
            allowed_losses: the loss entry points a job may name.
        """
        self._fetcher = fetcher
        self._fetching: dict[tuple[str, Shard], asyncio.Future[tuple[TrainData, Rows]]] = {}
        self._torch_threads = torch_threads
        self._allowed_models = dict(allowed_models or {})
        self._allowed_losses = dict(allowed_losses or {})
        self._daemon = f"worker {name}".strip()
        self._trainers: dict[str, Trainer] = {}
        self._links: dict[str, CompressedLink] = {}
        self._local: dict[str, LocalSteps] = {}  # diloco: built at a job's first local steps
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
        check_model_entry(spec, self._allowed_models, self._daemon, self._allowed_losses)
        data = None  # a built-in data set is made on the torch thread by the Trainer
        if isinstance(spec.data, FileData):
            data, _rows = await self._fetch(job_id, (shard_index, shard_count))
            data.task = spec.task
        loop = asyncio.get_running_loop()
        try:
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
                self._allowed_losses,
            )
        except BaseException:
            if data is not None:
                data.close()
            raise
        old = self._trainers.pop(job_id, None)
        if old is not None:
            old.data.close()
        self._trainers[job_id] = trainer
        if spec.compression.name != "none":
            self._links[job_id] = CompressedLink(spec, param_shapes(trainer.model))
        return int(trainer.train_samples)

    def get(self, job_id: str) -> Trainer:
        """The trainer of a job. Raises: UnknownTrainingJob (FAILED_PRECONDITION)."""
        try:
            return self._trainers[job_id]
        except KeyError:
            raise UnknownTrainingJob(f"no training session for job {job_id!r}") from None

    async def step(self, call: StepInput) -> GradResult | None:
        """One ComputeGradients call: load the call's parameters, then compute its rows.

        Parameters that come as a delta go through the job's compressed link first; when the
        call carries none, the held ones must be of ``call.params_version``. With a
        compressed link the finite gradients are returned in its wire form (with error
        feedback: the residual advances); non-finite ones go raw, for the coordinator to
        reject.

        Returns:
            The step's result, or None when the worker holds no usable parameters (another
            version held, or a delta on a base it does not hold): the coordinator resends
            them in full (``need_params``).

        Raises:
            UnknownTrainingJob: no session for the job (FAILED_PRECONDITION).
            BadParams: the parameters do not fit the model or the job's link
                (INVALID_ARGUMENT); a compressed link's held copy is dropped.
            ShardFetchError, DataError, ValueError, ShardMissing: as :meth:`compute`.
        """
        trainer = self.get(call.job_id)
        link = self._links.get(call.job_id)
        if call.params is not None:
            if call.params_delta and link is None:
                raise BadParams("params_delta: the job's spec has no compression")
            try:
                params = call.params
                if link is not None and call.params_delta:
                    params = link.receive(params, call.params_version, call.base_version)
                await self.set_params(trainer, params, call.params_version)
            except StaleBase:
                return None
            except ValueError as exc:  # names or shapes that are not the model's, bad wire
                if link is not None:
                    link.forget()
                raise BadParams(f"param: {exc}") from None
        elif trainer.params_version != call.params_version:
            return None
        res = await self.compute(
            call.job_id,
            trainer,
            call.epoch,
            call.step_in_epoch,
            call.rows,
            call.loss_scale,
            call.inner_rows,
            call.inner_steps,
            call.weights,
        )
        if link is not None and res.finite:
            res = dataclasses.replace(res, grads=link.send(res.grads))
        return res

    async def _fetch(self, job_id: str, shard: Shard) -> tuple[TrainData, Rows]:
        """Fetch ``shard`` from the coordinator: a ``TrainData`` holding it, and its rows.

        Concurrent asks for the same shard share one fetch.
        """
        if self._fetcher is None:
            raise DataError("data.path: this worker has no coordinator to fetch shards from")
        key = (job_id, shard)
        pending = self._fetching.get(key)
        if pending is None:
            fut: asyncio.Future[tuple[TrainData, Rows]] = asyncio.ensure_future(
                self._fetcher.fetch(job_id, shard)
            )
            self._fetching[key] = pending = fut
            fut.add_done_callback(lambda _f: self._fetching.pop(key, None))
        return await asyncio.shield(pending)

    async def compute(
        self,
        job_id: str,
        trainer: Trainer,
        epoch: int,
        step_in_epoch: int,
        rows: np.ndarray,
        loss_scale: float = 1.0,
        inner_rows: Sequence[int] = (),
        inner_steps: InnerSteps | None = None,
        weights: np.ndarray | None = None,
    ) -> GradResult:
        """Gradients of the mean loss over ``rows`` on the torch thread (``compute_rows``).

        With ``inner_steps`` (diloco) the answer is the pseudo-gradient of local steps on the
        rows instead (``worker.training.diloco.LocalSteps``): ``inner_rows`` cuts the rows into
        the inner batches (empty: one batch). A coordinator of the release before sends no
        ``inner_steps``: a diloco job's are then computed from the spec, the first being inner
        step ``step_in_epoch`` of ``epoch`` (``legacy_inner_steps``).

        The shards holding the rows are fetched first when they are not held here (a shard
        handed over from another worker).

        Args:
            job_id: the job.
            trainer: the job's trainer.
            epoch: the epoch, from 0.
            step_in_epoch: the step within the epoch (diloco: the first inner step's).
            rows: [R] int64 global training rows (the coordinator's piece of the step).
            loss_scale: the coordinator's fp16 loss scale (1.0: none).
            inner_rows: diloco: the inner batches' row counts, summing to R.
            inner_steps: diloco: the call's first inner step and the job's inner steps.
            weights: prioritized sampling: [R] float32 importance weights; None: all 1.

        Raises:
            ShardFetchError, DataError: as :meth:`start`.
            ValueError: a row outside the training split, or ``inner_rows`` not summing to R
                (INVALID_ARGUMENT).
            ShardMissing: a shard of the rows could not be held here (FAILED_PRECONDITION).
        """
        for s in trainer.data.shards_of(rows, trainer.shard_count):
            if not trainer.data.has(s):
                got, _rows = await self._fetch(job_id, s)
                trainer.data.merge(got)
        loop = asyncio.get_running_loop()
        work = partial(trainer.compute_rows, rows, loss_scale, weights)
        inner = inner_steps or legacy_inner_steps(
            trainer.spec, trainer.n_train, epoch, step_in_epoch
        )
        if inner is not None:
            local = self._local_steps(job_id, trainer)
            work = partial(local.run, rows, list(inner_rows) or [len(rows)], inner, weights)
        return await loop.run_in_executor(self._executor, work)

    def _local_steps(self, job_id: str, trainer: Trainer) -> LocalSteps:
        """The job's DiLoCo inner loop on ``trainer`` (a new trainer gets a new one)."""
        local = self._local.get(job_id)
        if local is None or local.trainer is not trainer:
            local = self._local[job_id] = LocalSteps(trainer)
        return local

    async def set_params(
        self, trainer: Trainer, params: dict[str, np.ndarray], version: int
    ) -> None:
        """Load parameters and buffers (name -> array) of ``version`` on the torch thread."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, trainer.set_params, params, version)

    def stop(self, job_id: str) -> None:
        """Forget a job's trainer, compressed link and inner loop (idempotent).

        The shard cache entries its rows are mapped from are released.
        """
        trainer = self._trainers.pop(job_id, None)
        if trainer is not None:
            trainer.data.close()
        self._links.pop(job_id, None)
        self._local.pop(job_id, None)

    def close(self) -> None:
        """Drop every trainer, cancel shard fetches and stop the torch thread."""
        for pending in list(self._fetching.values()):
            pending.cancel()
        for trainer in self._trainers.values():
            trainer.data.close()
        self._trainers.clear()
        self._links.clear()
        self._local.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
