"""The ``neuroshard.v1.Worker`` service, training RPCs: validate, delegate, map errors."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from grpc import aio

from shared.codec import CodecError, read_header_and_tensors, tensors_to_chunks
from shared.config import ConfigError
from shared.confinement import ImportNotAllowed
from shared.proto import worker_pb2, worker_pb2_grpc
from shared.rpc import error_message
from shared.training.data import DataError
from shared.worker_clients import WorkerClients
from worker.memory_node import MemoryNode
from worker.memory_servicer import MemoryRpcs
from worker.replication import ReplicationError
from worker.shards import ShardFetchError, ShardMissing
from worker.store import SlotSnapshot
from worker.training import TrainingSessions, UnknownTrainingJob
from worker.wire import slot_messages


class WorkerServicer(MemoryRpcs, worker_pb2_grpc.WorkerServicer):
    """The Worker service: training RPCs here, memory-store RPCs from ``MemoryRpcs``."""

    def __init__(
        self,
        sessions: TrainingSessions,
        chunk_bytes: int,
        peers: WorkerClients,
        rpc_timeout_s: float,
    ) -> None:
        self._sessions = sessions
        self._chunk_bytes = self.chunk_bytes = chunk_bytes
        self._peers = peers
        self._rpc_timeout_s = rpc_timeout_s
        self.node_or_none: MemoryNode | None = None

    async def forward(self, target: str, address: str, req: worker_pb2.ReplicateRequest) -> None:
        """Send one replicated op to a peer worker (raises grpc.aio.AioRpcError)."""
        await self._peers.stub(target, address).Replicate(req, timeout=self._rpc_timeout_s)

    async def send_slots(
        self, target: str, address: str, snaps: list[SlotSnapshot]
    ) -> tuple[int, int]:
        """Stream slot snapshots to a peer's ReceiveSlots; return (memories, bytes).

        Raises: ReplicationError: the peer refused or could not be reached (UNAVAILABLE).
        """
        msgs = [m for snap in snaps for m in slot_messages(snap, self._chunk_bytes)]

        async def stream() -> AsyncIterator[worker_pb2.SlotData]:
            for m in msgs:
                yield m

        stub = self._peers.stub(target, address)
        try:
            await stub.ReceiveSlots(stream(), timeout=self._rpc_timeout_s)
        except aio.AioRpcError as exc:
            raise ReplicationError(
                f"copying slots to {target} at {address} failed: {error_message(exc)}"
            ) from None
        return sum(len(s.ids) for s in snaps), sum(m.ByteSize() for m in msgs)

    async def StartTraining(
        self, request: worker_pb2.StartTrainingRequest, context: aio.ServicerContext
    ) -> worker_pb2.StartTrainingResponse:
        """Load this worker's shard and build the model.

        INVALID_ARGUMENT: bad spec, shard index out of range, or unreadable data.
        PERMISSION_DENIED: the model's module is not in this worker's ``allowed_imports``.
        A file data set's shard is fetched from the coordinator: when that fails, FetchShard's
        status (NOT_FOUND, PERMISSION_DENIED, UNAVAILABLE, ...).
        """
        if request.shard_count < 1 or request.shard_index >= request.shard_count:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"shard_index {request.shard_index} is not below shard_count {request.shard_count}",
            )
        try:
            n = await self._sessions.start(
                request.job_id, request.spec_json, request.shard_index, request.shard_count
            )
        except (ConfigError, DataError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ImportNotAllowed as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except ShardFetchError as exc:
            await context.abort(exc.code, str(exc))
        return worker_pb2.StartTrainingResponse(train_samples=n)

    async def ComputeGradients(
        self,
        request_iterator: AsyncIterator[worker_pb2.GradientRequest],
        context: aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.GradientResponse]:
        """Receive a step header (and parameters when included); stream back the step result
        and one float32 gradient per parameter (of the mean loss over the mini-batch).

        FAILED_PRECONDITION: unknown job. INVALID_ARGUMENT: malformed stream, or a malformed
        shard from the coordinator. A shard not held here is fetched from the coordinator
        first; when that fails, FetchShard's status.
        """
        try:
            header, params = await read_header_and_tensors(request_iterator, "header", "param")
            if header is None:
                raise CodecError("the stream has no StepHeader")
        except CodecError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        try:
            trainer = self._sessions.get(header.job_id)
        except UnknownTrainingJob as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc.args[0]))
            return
        if header.params_included:
            try:
                await self._sessions.set_params(trainer, params, header.params_version)
            except ValueError as exc:  # names or shapes that are not the model's
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"param: {exc}")
                return
        elif trainer.params_version != header.params_version:
            yield worker_pb2.GradientResponse(result=worker_pb2.StepResult(need_params=True))
            return
        try:
            res = await self._sessions.compute(
                header.job_id,
                trainer,
                header.epoch,
                header.step_in_epoch,
                (header.shard_index, header.shard_count),
            )
        except ShardFetchError as exc:
            await context.abort(exc.code, str(exc))
            return
        except DataError as exc:
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
                compute_s=res.compute_s,
            )
        )
        for chunk in tensors_to_chunks(res.grads.items(), self._chunk_bytes):
            yield worker_pb2.GradientResponse(grad=chunk)

    async def StopTraining(
        self, request: worker_pb2.StopTrainingRequest, context: aio.ServicerContext
    ) -> worker_pb2.StopTrainingResponse:
        """Forget a job's trainer (idempotent)."""
        self._sessions.stop(request.job_id)
        return worker_pb2.StopTrainingResponse()
