"""The workers of one training job: who computes which data shard, joins and failures.

A job has a fixed number of data shards (``spec.workers``); each step every shard is computed
by one live member. A member that fails or misses the step deadline leaves the job and its
shards are recomputed by the survivors in the same step, so the step still averages the full
global batch. A returning or new worker is admitted in the background (StartTraining) and
takes shards from the next step on, receiving the current parameters with its first step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from coordinator.jobs import JobFailed
from coordinator.membership import WorkerRecord
from shared.logging import get_logger
from shared.proto import worker_pb2, worker_pb2_grpc
from shared.rpc import error_message
from shared.rpc.codec import read_header_and_tensors, tensors_to_chunks
from shared.rpc.peers import WorkerClients

log = get_logger("coordinator.train_members")


@dataclass
class Member:
    """One worker's seat in a job."""

    name: str
    stub: worker_pb2_grpc.WorkerStub
    params_version: int = -1  # the parameter version this worker holds
    samples: int = 0
    steps: int = 0


@dataclass(frozen=True)
class StepOrder:
    """What every shard of one step is computed from.

    Attributes:
        step: the global step, from 0.
        epoch: its epoch, from 0.
        step_in_epoch: its step within the epoch, from 0.
        version: the parameter server's version of ``tensors``.
        tensors: parameters and buffers by state_dict name (float32 parameters, buffers in
            their dtype), sent to a worker that does not hold ``version``.
        buffer_names: the names in ``tensors`` that are buffers (their answers too).
        loss_scale: the fp16 loss scale the workers multiply the loss by (1.0: none).
    """

    step: int
    epoch: int
    step_in_epoch: int
    version: int
    tensors: dict[str, np.ndarray] = field(repr=False)
    buffer_names: frozenset[str] = frozenset()
    loss_scale: float = 1.0


@dataclass
class ShardResult:
    """One shard's answer to a step: what its rows contributed.

    Attributes:
        samples: rows of the step (0 when the shard ran out this epoch).
        loss_sum: the loss summed over those rows.
        correct: rows predicted right.
        grads: parameter name -> gradient of the mean loss, float32 of the parameter's shape,
            unscaled.
        buffers: buffer name -> the worker's buffer after the step (e.g. BatchNorm running
            statistics), in the buffer's dtype.
        finite: every gradient element is finite.
    """

    samples: int
    loss_sum: float
    correct: int
    grads: dict[str, np.ndarray] = field(repr=False)
    buffers: dict[str, np.ndarray] = field(repr=False, default_factory=dict)
    finite: bool = True


class Members:
    """Live members of a job and their shard assignment."""

    def __init__(
        self,
        job_id: str,
        spec_json: str,
        shards: int,
        clients: WorkerClients,
        alive: Callable[[], list[WorkerRecord]],
        rpc_timeout_s: float,
        step_timeout_s: float,
        chunk_bytes: int,
    ) -> None:
        """No members until ``start``.

        Args:
            job_id: the job.
            spec_json: its spec, sent to each worker in StartTraining.
            shards: the job's shard count (``spec.workers``).
            clients: channels to the workers.
            alive: the ALIVE workers now, to replace failed members.
            rpc_timeout_s: deadline of control calls, seconds.
            step_timeout_s: deadline of one ComputeGradients call, seconds.
            chunk_bytes: tensors larger than this are streamed in chunks, bytes.
        """
        self.job_id, self.spec_json, self.shards = job_id, spec_json, shards
        self._clients, self._alive = clients, alive
        self._rpc_timeout_s, self._step_timeout_s = rpc_timeout_s, step_timeout_s
        self._chunk_bytes = chunk_bytes
        self.live: dict[str, Member] = {}
        self.history: dict[str, Member] = {}  # every member ever, for the result
        self._joining: dict[str, asyncio.Task[BaseException | None]] = {}
        self.invited: set[str] = set()  # every worker asked to train: may fetch shards
        self.failures = 0

    async def start(self, workers: list[WorkerRecord]) -> None:
        """StartTraining on the initial workers.

        Raises:
            JobFailed: a worker refused the spec or its data (INVALID_ARGUMENT), or none
                could start.
        """
        order = sorted(w.name for w in workers)  # the shard each will get (see ``assign``)
        errors = await asyncio.gather(
            *(self._join(w, order.index(w.name) % self.shards) for w in workers)
        )
        for w, exc in zip(workers, errors, strict=True):
            if (
                exc is not None
                and getattr(exc, "code", lambda: None)() is grpc.StatusCode.INVALID_ARGUMENT
            ):
                raise JobFailed(f"worker {w.name} refused the job: {error_message(exc)}")
        if not self.live:
            raise JobFailed(
                "no worker could start training: "
                f"{error_message(next(e for e in errors if e is not None))}"
            )

    async def _join(self, w: WorkerRecord, shard: int | None = None) -> BaseException | None:
        """StartTraining on one worker, naming the shard it will likely compute first.

        The worker fetches that shard's rows of a file data set then. ``shard`` None: its
        place by name among the live members.
        """
        if shard is None:
            shard = sorted([*self.live, w.name]).index(w.name) % self.shards
        stub = self._clients.stub(w.name, w.address)
        self.invited.add(w.name)  # before StartTraining: the worker fetches its shard in it
        try:
            await stub.StartTraining(
                worker_pb2.StartTrainingRequest(
                    job_id=self.job_id,
                    spec_json=self.spec_json,
                    shard_index=shard,
                    shard_count=self.shards,
                ),
                timeout=self._rpc_timeout_s,
            )
        except Exception as exc:
            log.warning(
                "train_join_failed", job_id=self.job_id, worker=w.name, error=error_message(exc)
            )
            return exc
        member = self.history.get(w.name) or Member(w.name, stub)
        member.stub, member.params_version = stub, -1
        self.live[w.name] = self.history[w.name] = member
        log.info("train_member_joined", job_id=self.job_id, worker=w.name)
        return None

    def admit(self) -> None:
        """Start admitting live workers not in the job while it has fewer than ``shards``."""
        if len(self.live) >= self.shards:
            return
        for w in self._alive():
            if len(self.live) + len(self._joining) >= self.shards:
                return
            if w.name not in self.live and w.name not in self._joining:
                task = asyncio.create_task(self._join(w))
                self._joining[w.name] = task
                task.add_done_callback(self._joined_callback(w.name))

    def _joined_callback(self, name: str) -> Callable[[asyncio.Task[BaseException | None]], None]:
        def done(_task: asyncio.Task[BaseException | None]) -> None:
            self._joining.pop(name, None)

        return done

    def assign(self, shards: list[int]) -> list[tuple[int, Member]]:
        """Spread shards over live members round-robin (stable by name)."""
        if not self.live:
            raise JobFailed("every worker of the job failed")
        members = [self.live[n] for n in sorted(self.live)]
        return [(s, members[i % len(members)]) for i, s in enumerate(shards)]

    def fail(self, member: Member, shard: int, exc: BaseException) -> None:
        """Remove a member whose step failed; its shards go to the survivors."""
        if self.live.pop(member.name, None) is not None:
            self.failures += 1
            log.warning(
                "train_member_failed",
                job_id=self.job_id,
                worker=member.name,
                shard=shard,
                error=error_message(exc),
            )

    async def step(self, order: StepOrder) -> dict[int, ShardResult]:
        """Compute every shard of one step, re-assigning the shards of failed members."""
        results: dict[int, ShardResult] = {}
        pending = list(range(self.shards))
        while pending:
            plan = self.assign(pending)
            replies = await asyncio.gather(
                *(self._shard_step(m, s, order) for s, m in plan),
                return_exceptions=True,
            )
            for (s, m), r in zip(plan, replies, strict=True):
                if isinstance(r, JobFailed):
                    raise r
                if isinstance(r, BaseException):
                    self.fail(m, s, r)
                else:
                    results[s] = r
            pending = [s for s in pending if s not in results]
        for m in self.live.values():
            m.steps += 1
        return results

    async def _shard_step(self, m: Member, shard: int, order: StepOrder) -> ShardResult:
        for include in (m.params_version != order.version, True):
            header = worker_pb2.StepHeader(
                job_id=self.job_id,
                step=order.step,
                epoch=order.epoch,
                step_in_epoch=order.step_in_epoch,
                params_version=order.version,
                params_included=include,
                shard_index=shard,
                shard_count=self.shards,
                loss_scale=order.loss_scale,
            )
            call = m.stub.ComputeGradients(
                self._requests(header, order.tensors if include else None),
                timeout=self._step_timeout_s,
            )
            result, tensors = await read_gradients(call)
            if result.need_params:
                continue
            m.params_version = order.version
            m.samples += result.samples
            grads = {n: a for n, a in tensors.items() if n not in order.buffer_names}
            buffers = {n: a for n, a in tensors.items() if n in order.buffer_names}
            return ShardResult(
                result.samples,
                result.loss_sum,
                result.correct,
                grads,
                buffers,
                finite=not result.nonfinite,
            )
        raise RuntimeError(f"worker {m.name} kept asking for parameters")

    async def _requests(
        self, header: worker_pb2.StepHeader, params: dict[str, np.ndarray] | None
    ) -> AsyncIterator[worker_pb2.GradientRequest]:
        yield worker_pb2.GradientRequest(header=header)
        if params is not None:
            for chunk in tensors_to_chunks(params.items(), self._chunk_bytes):
                yield worker_pb2.GradientRequest(param=chunk)

    async def stop(self) -> None:
        """Cancel joins in progress and tell every member the job ended (errors ignored)."""
        for task in list(self._joining.values()):
            task.cancel()
        req = worker_pb2.StopTrainingRequest(job_id=self.job_id)
        await asyncio.gather(
            *(m.stub.StopTraining(req, timeout=5.0) for m in self.history.values()),
            return_exceptions=True,
        )

    def summary(self) -> dict[str, dict[str, int]]:
        """Per worker: samples (count) and steps it contributed."""
        return {
            n: {"samples": m.samples, "steps": m.steps} for n, m in sorted(self.history.items())
        }


async def read_gradients(call: Any) -> tuple[worker_pb2.StepResult, dict[str, np.ndarray]]:
    """Read a ComputeGradients response stream: the StepResult, then gradient and buffer chunks."""
    result, grads = await read_header_and_tensors(call, "result", "grad")
    if result is None:
        raise RuntimeError("worker closed the gradient stream without a result")
    return result, grads
