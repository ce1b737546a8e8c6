"""Training RPCs of the ``neuroshard.v1.Worker`` service.

Each RPC decodes its request, calls the training sessions (``TrainingSessions``) and encodes
the answer; domain errors map to status codes through one table, ``_ERRORS``
(``shared.rpc.status_table``).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
from grpc import aio

from shared.config import ConfigError
from shared.proto import worker_pb2
from shared.rpc.codec import (
    CodecError,
    f32_from_bytes,
    f32_to_bytes,
    read_header_and_tensors,
    rows_from_bytes,
    tensors_to_messages,
)
from shared.rpc.status_table import BadRequest, Status, StatusTable
from shared.training.data import DataError
from shared.training.entry_points import EntryPointRefused
from shared.training.models import ModelError
from worker.training.diloco import InnerSteps
from worker.training.shards import ShardFetchError, ShardMissing
from worker.training.trainer import DeviceUnavailable, TrainerError
from worker.training.training_sessions import (
    BadParams,
    StepInput,
    TrainingSessions,
    UnknownTrainingJob,
)

__all__ = ["TrainingServicer"]

# Domain errors of the training RPCs and the status each maps to.
_ERRORS = StatusTable(
    [
        (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),
        (CodecError, grpc.StatusCode.INVALID_ARGUMENT),
        (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
        (DataError, grpc.StatusCode.INVALID_ARGUMENT),
        (ModelError, grpc.StatusCode.INVALID_ARGUMENT),
        (BadParams, grpc.StatusCode.INVALID_ARGUMENT),
        (EntryPointRefused, grpc.StatusCode.PERMISSION_DENIED),
        (DeviceUnavailable, grpc.StatusCode.FAILED_PRECONDITION),
        (UnknownTrainingJob, grpc.StatusCode.FAILED_PRECONDITION),
        (ShardMissing, grpc.StatusCode.FAILED_PRECONDITION),
        (TrainerError, grpc.StatusCode.FAILED_PRECONDITION),
        # FetchShard's own status (NOT_FOUND, PERMISSION_DENIED, UNAVAILABLE, ...).
        (ShardFetchError, lambda e: Status(e.code)),
        # The Trainer's and TrainData's own checks: a row outside the training split,
        # inner_rows that do not split the rows, a shard index out of range.
        (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    ]
)


def _step_input(header: worker_pb2.StepHeader, params: dict[str, Any]) -> StepInput:
    """A step header and the tensors that came with it, as ``TrainingSessions.step`` takes.

    Raises:
        BadRequest: a loss_scale negative or not finite, no explicit rows, or weights not
            one finite value >= 0 per row (INVALID_ARGUMENT).
        CodecError: ``rows`` is not int64 little-endian bytes, or ``weights`` not float32
            ones (INVALID_ARGUMENT).
    """
    if not (math.isfinite(header.loss_scale) and header.loss_scale >= 0):
        raise BadRequest(f"loss_scale: must be finite and >= 0, got {header.loss_scale}")
    if not header.explicit_rows:
        # The worker no longer chooses a step's rows itself: the coordinator names them.
        raise BadRequest("explicit_rows: must be true, with the step's rows in rows")
    rows = rows_from_bytes(header.rows)
    weights = _weights(header, len(rows))
    return StepInput(
        job_id=header.job_id,
        epoch=header.epoch,
        step_in_epoch=header.step_in_epoch,
        params_version=header.params_version,
        params=params if header.params_included else None,
        params_delta=header.params_delta,
        base_version=header.base_version,
        rows=rows,
        inner_rows=tuple(header.inner_rows),
        loss_scale=header.loss_scale or 1.0,
        inner_steps=_inner_steps(header),
        weights=weights,
    )


def _weights(header: worker_pb2.StepHeader, n_rows: int) -> np.ndarray | None:
    """The header's importance weights [R] float32 (prioritized sampling); None when empty.

    Raises:
        BadRequest: not one finite value >= 0 per row (INVALID_ARGUMENT).
        CodecError: not float32 little-endian bytes (INVALID_ARGUMENT).
    """
    if not header.weights:
        return None
    weights = f32_from_bytes(header.weights, "weights")
    if len(weights) != n_rows:
        raise BadRequest(f"weights: {len(weights)} values for {n_rows} rows")
    if not bool(np.isfinite(weights).all()) or bool((weights < 0).any()):
        raise BadRequest("weights: every importance weight must be finite and >= 0")
    return weights


def _inner_steps(header: worker_pb2.StepHeader) -> InnerSteps | None:
    """The header's ``inner_steps`` (diloco: run local steps); None when it is unset."""
    if not header.HasField("inner_steps"):
        return None
    return InnerSteps(header.inner_steps.first, header.inner_steps.total)


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
        async with _ERRORS.mapped(context):
            if request.shard_count < 1 or request.shard_index >= request.shard_count:
                raise BadRequest(
                    f"shard_index {request.shard_index} is not below shard_count "
                    f"{request.shard_count}"
                )
            await self._sessions.start(
                request.job_id, request.spec_json, request.shard_index, request.shard_count
            )
        return worker_pb2.StartTrainingResponse()

    async def ComputeGradients(
        self,
        request_iterator: AsyncIterator[worker_pb2.GradientRequest],
        context: aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[worker_pb2.GradientResponse]:
        """Compute the gradients of the header's rows (diloco: a pseudo-gradient).

        Receives a step header naming the rows (and the parameters and buffers when
        included); streams back the step result, one float32 gradient per parameter (of the
        mean loss over the rows, unscaled by the header's ``loss_scale``; in the compressed
        wire form when the job compresses) and the model's buffers after the step's forward
        passes (``TrainingSessions.step``). With importance weights in the header
        (prioritized sampling) the loss is their weighted mean and the result carries the
        rows' per-sample losses. A shard of the rows not held here is fetched from the
        coordinator first. Answers ``need_params`` alone when the worker holds no
        usable parameters of the header's version.

        Raises:
            FAILED_PRECONDITION: unknown job, or a shard not held here.
            INVALID_ARGUMENT: malformed stream, rows, weights or parameters,
                ``explicit_rows`` not set, a loss_scale that is negative or not finite, a
                row outside the training split, or a malformed shard from the coordinator.
            FetchShard's status: fetching the shard failed.
        """
        async with _ERRORS.mapped(context):
            header, params = await read_header_and_tensors(request_iterator, "header", "param")
            if header is None:
                raise CodecError("the stream has no StepHeader")
            res = await self._sessions.step(_step_input(header, params))
        if res is None:
            yield worker_pb2.GradientResponse(result=worker_pb2.StepResult(need_params=True))
            return
        yield worker_pb2.GradientResponse(
            result=worker_pb2.StepResult(
                samples=res.samples,
                loss_sum=res.loss_sum,
                correct=res.correct,
                nonfinite=not res.finite,
                compute_s=res.compute_s,
                losses=f32_to_bytes(res.losses) if res.losses is not None else b"",
            )
        )
        tensors = [*res.grads.items(), *res.buffers.items()]
        for msg in tensors_to_messages(
            tensors, self._chunk_bytes, worker_pb2.GradientResponse, "grad"
        ):
            yield msg

    async def StopTraining(
        self, request: worker_pb2.StopTrainingRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.StopTrainingResponse:
        """Forget a job's trainer (idempotent)."""
        self._sessions.stop(request.job_id)
        return worker_pb2.StopTrainingResponse()
