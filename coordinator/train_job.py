"""The ``train`` job, synchronous parameter server (DESIGN.md, "Training").

Each step the coordinator streams the current parameters to every worker of the job, each
worker returns the gradient of the mean loss over its shard's mini-batch, and the coordinator
averages them weighted by sample count and steps the optimizer. With equal shards this equals
single-process training on the concatenated global batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.aggregation import ParameterServer, weighted_average
from coordinator.jobs import JobFailed, JobRecord, JobStore
from coordinator.membership import WorkerRecord
from shared.codec import ChunkAssembler, tensors_to_chunks
from shared.config import CoordinatorConfig, TrainJobSpec
from shared.logging import get_logger
from shared.metrics import Metrics
from shared.proto import worker_pb2, worker_pb2_grpc
from shared.training.data import load_dataset, steps_per_epoch
from shared.worker_clients import WorkerClients

log = get_logger("coordinator.train_job")


@dataclass
class _Member:
    """One worker's seat in a job."""

    record: WorkerRecord
    stub: worker_pb2_grpc.WorkerStub
    shard_index: int
    params_version: int = -1  # the version this worker holds
    samples: int = 0
    steps: int = 0


@dataclass
class StepOutcome:
    samples: int
    loss_sum: float
    correct: int
    grads: dict[str, np.ndarray] = field(repr=False)


class TrainJob:
    """Runs one train job to completion; ``run`` returns the result document."""

    def __init__(
        self,
        job: JobRecord,
        workers: list[WorkerRecord],
        cfg: CoordinatorConfig,
        clients: WorkerClients,
        jobs: JobStore,
        metrics: Metrics,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        assert isinstance(job.spec, TrainJobSpec)
        self.job, self.spec, self.cfg = job, job.spec, cfg
        self._jobs, self._metrics, self._clock = jobs, metrics, clock
        self.members = [
            _Member(w, clients.stub(w.name, w.address), i) for i, w in enumerate(workers)
        ]

    async def run(self) -> dict[str, Any]:
        """Train to the spec's epochs/steps and return the result.

        Raises:
            JobFailed: a worker refused or failed a step (the job becomes FAILED).
        """
        spec = self.spec
        dataset = await asyncio.to_thread(load_dataset, spec.data, spec.seed, spec.test_fraction)
        ps = await asyncio.to_thread(ParameterServer, spec, dataset)
        await self._start_workers()
        shards = len(self.members)
        per_epoch = steps_per_epoch(len(dataset.y_train), shards, spec.batch_size)
        total = spec.steps if spec.steps is not None else (spec.epochs or 1) * per_epoch
        t_start = self._clock()
        samples_total, test_loss, test_acc = 0, float("nan"), float("nan")
        try:
            for step in range(total):
                epoch, step_in_epoch = divmod(step, per_epoch)
                t0 = self._clock()
                outcome = await self._step(ps, step, epoch, step_in_epoch)
                await asyncio.to_thread(ps.step, outcome.grads)
                samples_total += outcome.samples
                self._metrics.train_steps.inc()
                self._metrics.step_seconds.labels("coordinator").observe(self._clock() - t0)
                last_of_epoch = step_in_epoch == per_epoch - 1 or step == total - 1
                if last_of_epoch:
                    test_loss, test_acc = await asyncio.to_thread(ps.evaluate)
                elapsed = max(self._clock() - t_start, 1e-9)
                await self._jobs.update(
                    self.job,
                    progress={
                        "step": step + 1,
                        "steps": total,
                        "epoch": epoch + 1,
                        "epochs": -(-total // per_epoch),
                        "loss": outcome.loss_sum / max(outcome.samples, 1),
                        "train_accuracy": outcome.correct / max(outcome.samples, 1),
                        "test_accuracy": test_acc,
                        "test_loss": test_loss,
                        "samples_per_s": samples_total / elapsed,
                    },
                )
        finally:
            await self._stop_workers()
        model_path = Path(self.cfg.data_dir) / "models" / f"{self.job.job_id}.pt"
        await asyncio.to_thread(_save_model, ps, model_path)
        elapsed = max(self._clock() - t_start, 1e-9)
        return {
            "test_accuracy": test_acc,
            "test_loss": test_loss,
            "steps": total,
            "epochs": -(-total // per_epoch),
            "samples": samples_total,
            "samples_per_s": samples_total / elapsed,
            "seconds": elapsed,
            "model_path": str(model_path.resolve()),
            "workers": {
                m.record.name: {"samples": m.samples, "steps": m.steps} for m in self.members
            },
        }

    async def _start_workers(self) -> None:
        n = len(self.members)
        calls = [
            m.stub.StartTraining(
                worker_pb2.StartTrainingRequest(
                    job_id=self.job.job_id,
                    spec_json=self.job.spec_json,
                    shard_index=m.shard_index,
                    shard_count=n,
                ),
                timeout=self.cfg.rpc_timeout_s,
            )
            for m in self.members
        ]
        replies = await asyncio.gather(*calls, return_exceptions=True)
        for m, reply in zip(self.members, replies, strict=True):
            if isinstance(reply, BaseException):
                raise JobFailed(
                    f"worker {m.record.name} could not start training: {_rpc_message(reply)}"
                )

    async def _stop_workers(self) -> None:
        req = worker_pb2.StopTrainingRequest(job_id=self.job.job_id)
        await asyncio.gather(
            *(m.stub.StopTraining(req, timeout=5.0) for m in self.members),
            return_exceptions=True,
        )

    async def _step(
        self, ps: ParameterServer, step: int, epoch: int, step_in_epoch: int
    ) -> StepOutcome:
        params = ps.params()
        replies = await asyncio.gather(
            *(
                self._worker_step(m, params, ps.version, step, epoch, step_in_epoch)
                for m in self.members
            ),
            return_exceptions=True,
        )
        outcomes: list[StepOutcome] = []
        for m, reply in zip(self.members, replies, strict=True):
            if isinstance(reply, BaseException):
                raise JobFailed(f"worker {m.record.name} failed step {step}: {_rpc_message(reply)}")
            outcomes.append(reply)
        counts = [o.samples for o in outcomes]
        if sum(counts) == 0:
            raise JobFailed(f"step {step}: no worker had samples")
        grads = weighted_average([o.grads for o in outcomes], counts)
        return StepOutcome(
            samples=sum(counts),
            loss_sum=sum(o.loss_sum for o in outcomes),
            correct=sum(o.correct for o in outcomes),
            grads=grads,
        )

    async def _worker_step(
        self,
        m: _Member,
        params: dict[str, np.ndarray],
        version: int,
        step: int,
        epoch: int,
        step_in_epoch: int,
    ) -> StepOutcome:
        for include in (m.params_version != version, True):
            header = worker_pb2.StepHeader(
                job_id=self.job.job_id,
                step=step,
                epoch=epoch,
                step_in_epoch=step_in_epoch,
                params_version=version,
                params_included=include,
                shard_index=m.shard_index,
                shard_count=len(self.members),
            )
            call = m.stub.ComputeGradients(
                self._requests(header, params if include else None),
                timeout=self.cfg.step_timeout_s,
            )
            result, grads = await _read_gradients(call)
            if result.need_params:
                continue
            m.params_version = version
            m.samples += result.samples
            m.steps += 1
            return StepOutcome(result.samples, result.loss_sum, result.correct, grads)
        raise JobFailed(f"worker {m.record.name} kept asking for parameters")

    async def _requests(
        self, header: worker_pb2.StepHeader, params: dict[str, np.ndarray] | None
    ) -> AsyncIterator[worker_pb2.GradientRequest]:
        yield worker_pb2.GradientRequest(header=header)
        if params is not None:
            for chunk in tensors_to_chunks(params.items(), self.cfg.chunk_bytes):
                yield worker_pb2.GradientRequest(param=chunk)


async def _read_gradients(call: Any) -> tuple[worker_pb2.StepResult, dict[str, np.ndarray]]:
    result: worker_pb2.StepResult | None = None
    assembler = ChunkAssembler()
    async for msg in call:
        if msg.HasField("result"):
            result = msg.result
        else:
            assembler.add(msg.grad)
    if result is None:
        raise JobFailed("worker closed the gradient stream without a result")
    return result, assembler.result()


def _save_model(ps: ParameterServer, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    ps.save(path)


def _rpc_message(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    code = getattr(exc, "code", None)
    if callable(details) and callable(code):
        return f"{code().name}: {details()}"
    return f"{type(exc).__name__}: {exc}"
