"""Training RPCs of the ``neuroshard.v1.Worker`` service.

Each RPC validates, delegates to the training sessions, and maps their errors to status codes.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc import aio

from shared.config import ConfigError
from shared.proto import worker_pb2
from shared.rpc.codec import (
    CodecError,
    read_header_and_tensors,
    rows_from_bytes,
    tensors_to_chunks,
)
from shared.training.data import DataError
from shared.training.entry_points import EntryPointRefused
from shared.training.models import ModelError
from worker.training.compressed_link import StaleBase
from worker.training.shards import ShardFetchError, ShardMissing
from worker.training.trainer import DeviceUnavailable
from worker.training.training_sessions import TrainingSessions, UnknownTrainingJob

__all__ = ["TrainingServicer"]


class TrainingServicer:
    """The training RPCs, served through ``WorkerServicer``."""

    def __init__(self, sessions: TrainingSessions, chunk_bytes: int) -> None:
        """Build the training RPCs over this worker's sessions.

        Args:
            sessions: this worker's training jobs.
            chunk_bytes: target size of one gradient chunk message, bytes.
        """
        self._sessions = sessions
        self._chunk_bytes = chunk_bytes

    async def StartTraining(
        self, request: worker_pb2.StartTrainingRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.StartTrainingResponse:
        """Load this worker's shard and build the model.

        A file data set's shard is fetched from the coordinator.

        Raises:
            INVALID_ARGUMENT: bad spec, shard index out of range, or unreadable data.
            PERMISSION_DENIED: the model's entry is not in this worker's ``allowed_models``.
            FAILED_PRECONDITION: the job trains on cuda and this worker has no CUDA device.
            FetchShard's status: fetching the shard failed (NOT_FOUND, PERMISSION_DENIED,
                UNAVAILABLE, ...).
        """
        if request.shard_count < 1 or request.shard_index >= request.shard_count:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"shard_index {request.shard_index} is not below shard_count {request.shard_count}",
            )
        try:
            await self._sessions.start(
                request.job_id, request.spec_json, request.shard_index, request.shard_count
            )
        except (ConfigError, DataError, ModelError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EntryPointRefused as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except DeviceUnavailable as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ShardFetchError as exc:
            await context.abort(exc.code, str(exc))
        return worker_pb2.StartTrainingResponse()

    async def ComputeGradients(
        self,
        request_iterator: AsyncIterator[worker_pb2.GradientRequest],
        context: aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[worker_pb2.GradientResponse]:
        """Compute one step's gradients on this worker's shard (diloco: a pseudo-gradient).

        Receives a step header (and the parameters and buffers when included); streams back
        the step result, one float32 gradient per parameter (of the mean loss over the step's
        rows, unscaled by the header's ``loss_scale``) and the model's buffers after the
        step's forward passes. A shard not held here is fetched from the coordinator first.

        Raises:
            FAILED_PRECONDITION: unknown job, or a shard not held here.
            INVALID_ARGUMENT: malformed stream or parameters, a loss_scale that is negative or
                not finite, or a malformed shard from the coordinator.
            FetchShard's status: fetching the shard failed.
        """
        try:
            header, params = await read_header_and_tensors(request_iterator, "header", "param")
            if header is None:
                raise CodecError("the stream has no StepHeader")
            if not (math.isfinite(header.loss_scale) and header.loss_scale >= 0):
                raise CodecError(f"loss_scale: must be finite and >= 0, got {header.loss_scale}")
        except CodecError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        try:
            trainer = self._sessions.get(header.job_id)
        except UnknownTrainingJob as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc.args[0]))
            return
        link = self._sessions.link(header.job_id)
        if header.params_included:
            if header.params_delta and link is None:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "params_delta: the job's spec has no compression",
                )
                return
            try:
                if header.params_delta and link is not None:
                    params = link.receive(params, header.params_version, header.base_version)
                await self._sessions.set_params(trainer, params, header.params_version)
            except StaleBase:
                yield worker_pb2.GradientResponse(result=worker_pb2.StepResult(need_params=True))
                return
            except ValueError as exc:  # names or shapes that are not the model's, bad wire
                if link is not None:
                    link.forget()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"param: {exc}")
                return
        elif trainer.params_version != header.params_version:
            yield worker_pb2.GradientResponse(result=worker_pb2.StepResult(need_params=True))
            return
        rows = None
        if header.explicit_rows:
            try:
                rows = rows_from_bytes(header.rows)
            except CodecError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                return
        try:
            res = await self._sessions.compute(
                header.job_id,
                trainer,
                header.epoch,
                header.step_in_epoch,
                (header.shard_index, header.shard_count),
                header.loss_scale or 1.0,
                rows,
                list(header.inner_rows),
            )
        except ShardFetchError as exc:
            await context.abort(exc.code, str(exc))
            return
        except (DataError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        except ShardMissing as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            return
        yield worker_pb2.GradientResponse(
            result=worker_pb2.StepResult(
                samples=res.samples,
                loss_sum=res.loss_sum,
                correct=res.correct,
                nonfinite=not res.finite,
                compute_s=res.compute_s,
            )
        )
        grads = res.grads
        if link is not None and res.finite:  # non-finite ones go raw: the coordinator rejects
            grads = link.send(grads)
        tensors = [*grads.items(), *res.buffers.items()]
        for chunk in tensors_to_chunks(tensors, self._chunk_bytes):
            yield worker_pb2.GradientResponse(grad=chunk)

    async def StopTraining(
        self, request: worker_pb2.StopTrainingRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.StopTrainingResponse:
        """Forget a job's trainer (idempotent)."""
        self._sessions.stop(request.job_id)
        return worker_pb2.StopTrainingResponse()
