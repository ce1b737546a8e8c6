"""The workers of one training job: joins, failures, exclusion, and one call per piece.

A job has a fixed number of data shards (``spec.workers``); each step's global batch (every
shard's rows of the step) is cut into pieces (``coordinator.training.step_plan``), each computed by
one live member in one ComputeGradients call (``Members.piece_step``: parameters or their
compressed delta out, gradients back, telemetry). ``coordinator.training.step_run`` runs a step's
calls: a member that fails leaves the job and its pieces are recomputed by the others in the
same step, so the step still averages the full global batch. A returning or new worker is
admitted in the background (StartTraining) and takes pieces from the next step on,
receiving the current parameters with its first call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import numpy as np
from grpc import aio

from coordinator.jobs.jobs import JobFailed
from coordinator.placement.membership import WorkerRecord
from coordinator.training.step_run import StepRun
from coordinator.training.step_types import (
    GradientCall,
    Member,
    Piece,
    ShardResult,
    StepOrder,
    StepOutcome,
    StepPolicy,
)
from shared.logging import get_logger
from shared.proto import worker_pb2
from shared.rpc import error_message
from shared.rpc.chunk_wire import serialized_chunk_messages
from shared.rpc.codec import (
    CodecError,
    f32_from_bytes,
    f32_to_bytes,
    read_header_and_tensors,
    rows_to_bytes,
)
from shared.rpc.peers import WorkerClients
from shared.training.compression import Compressor, downlink_compressor
from shared.training.error_feedback import DeltaSender

log = get_logger(__name__)

__all__ = [
    "Member",
    "Members",
    "Piece",
    "ShardResult",
    "StepOrder",
    "StepOutcome",
    "StepPolicy",
    "read_gradients",
]


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
        self.excluded: set[str] = set()  # live members sitting out (health, probation)
        # The spec's compression of parameters (as deltas) and gradients; None: float32.
        self.compressor: Compressor | None = None
        self.failures = 0
        # The last step's serialized parameter messages, shared by its calls (uncompressed).
        self._sent: tuple[StepOrder, list[bytes]] | None = None

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
        member.gradients = gradient_call(self._clients.channel(w.name, w.address))
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

    def active(self) -> list[Member]:
        """Live members not excluded, by name; every live one when all are excluded."""
        members = [self.live[n] for n in sorted(self.live) if n not in self.excluded]
        return members or [self.live[n] for n in sorted(self.live)]

    def assign(self, pieces: list[Piece]) -> list[tuple[Piece, Member]]:
        """Give each piece its sized-for member if active, else spread round-robin by name.

        Raises:
            JobFailed: no live member is left (FAILED).
        """
        if not self.live:
            raise JobFailed("every worker of the job failed")
        members = self.active()
        by_name = {m.name: m for m in members}
        plan = []
        for i, p in enumerate(pieces):
            owner = by_name.get(p.member) if p.member is not None else None
            plan.append((p, owner or members[i % len(members)]))
        return plan

    def fail(self, member: Member, piece: int, exc: BaseException) -> None:
        """Remove a member whose step failed; its pieces go to the survivors."""
        if self.live.pop(member.name, None) is not None:
            self.failures += 1
            log.warning(
                "train_member_failed",
                job_id=self.job_id,
                worker=member.name,
                piece=piece,
                error=error_message(exc),
            )

    async def step(
        self, order: StepOrder, pieces: list[Piece], policy: StepPolicy | None = None
    ) -> StepOutcome:
        """Compute the pieces of one step under ``policy``; see ``StepPolicy``.

        A failed member leaves the job and its pieces are recomputed by the others (every
        mode). ``backup``: at the deadline each missing piece is also launched on a member
        that has finished; the first answer wins and the other call is cancelled. ``drop``:
        at the deadline, once ``min_fraction`` of the step's samples arrived, the calls still
        running are cancelled and their pieces left out. A rejected (non-finite) answer is
        recomputed elsewhere in ``backup`` mode and left out otherwise.

        Raises:
            JobFailed: every member failed, or a worker refused the job (FAILED).
        """
        return await StepRun(self, order, pieces, policy or StepPolicy()).run()

    def spare(self, avoid: set[str], idle_only: bool, busy: set[str]) -> Member | None:
        """An active member not in ``avoid`` for another copy of a piece: idle ones first.

        Args:
            avoid: members that must not take it (already computing or refused it).
            idle_only: only members with no call running (``busy``) qualify.
            busy: members with a call running in this step.
        """
        candidates = [m for m in self.active() if m.name not in avoid]
        if idle_only:
            candidates = [m for m in candidates if m.name not in busy]
        candidates.sort(key=lambda m: (m.name in busy, m.name))
        return candidates[0] if candidates else None

    async def piece_step(self, m: Member, piece: Piece, order: StepOrder) -> ShardResult:
        """One ComputeGradients call: ``piece``'s rows on member ``m``, with telemetry.

        With compression the parameters go as a delta against what ``m`` holds (in full
        the first time, and after any call whose outcome is unknown) and the gradients come
        back in the compressed wire form, decoded here.

        Raises:
            CompressionError: a malformed compressed answer (the member fails).
            RuntimeError: the worker kept asking for parameters.
        """
        t0 = time.perf_counter()
        bytes_up = bytes_down = 0
        for include in (m.params_version != order.version, True):
            header = worker_pb2.StepHeader(
                job_id=self.job_id,
                step=order.step,
                epoch=order.epoch,
                step_in_epoch=order.step_in_epoch,
                params_version=order.version,
                params_included=include,
                shard_index=max(piece.shard, 0),
                shard_count=self.shards,
                loss_scale=order.loss_scale,
                explicit_rows=True,
                rows=rows_to_bytes(piece.rows),
                inner_rows=piece.inner_rows,
                inner_steps=_inner_steps(order),
                weights=b"" if piece.weights is None else f32_to_bytes(piece.weights),
            )
            # the parameters first: a compressed send marks the header as a delta
            params = self._param_messages(m, order, header) if include else []
            requests = [worker_pb2.GradientRequest(header=header).SerializeToString(), *params]
            bytes_up += sum(len(r) for r in requests)
            m.params_version = -1  # unknown until the call answers
            assert m.gradients is not None, "a member gets its call in _join"
            call = m.gradients(_aiter(requests), timeout=self._step_timeout_s)
            counted = _Counted(call)
            result, tensors_in = await read_gradients(counted, order.tensors)
            bytes_down += counted.bytes
            if result.need_params:
                m.sender = None  # the worker holds no usable base: send in full
                continue
            m.params_version = order.version
            buffers = {n: a for n, a in tensors_in.items() if n in order.buffer_names}
            grads = {n: a for n, a in tensors_in.items() if n not in order.buffer_names}
            if self.compressor is not None and not result.nonfinite:
                shapes = {
                    n: a.shape for n, a in order.tensors.items() if n not in order.buffer_names
                }
                grads = self.compressor.decode(grads, shapes)
            return ShardResult(
                result.samples,
                result.loss_sum,
                result.correct,
                grads,
                buffers,
                finite=not result.nonfinite,
                worker=m.name,
                wall_s=time.perf_counter() - t0,
                compute_s=result.compute_s,
                bytes_to_worker=bytes_up,
                bytes_from_worker=bytes_down,
                losses=_losses(piece, result),
            )
        raise RuntimeError(f"worker {m.name} kept asking for parameters")

    def _outgoing(
        self, m: Member, order: StepOrder, header: worker_pb2.StepHeader
    ) -> dict[str, np.ndarray]:
        """The tensors a step sends ``m``: values, or with compression a parameter delta."""
        if self.compressor is None:
            return order.tensors
        if m.params_version < 0 or m.sender is None:
            m.sender = DeltaSender(downlink_compressor(self.compressor))  # first send: full
        header.params_delta = True
        header.base_version = max(m.params_version, 0)
        params = {n: a for n, a in order.tensors.items() if n not in order.buffer_names}
        buffers = {n: a for n, a in order.tensors.items() if n in order.buffer_names}
        return {**m.sender.send(params), **buffers}

    def _param_messages(
        self, m: Member, order: StepOrder, header: worker_pb2.StepHeader
    ) -> list[bytes]:
        """The serialized chunk messages of the tensors a step sends ``m`` (``_outgoing``).

        Without compression every member gets the same values, so the step's messages are
        written once, straight to their wire form (``serialized_chunk_messages``), and sent
        to each (a step's calls only read them).
        """
        if self.compressor is None and self._sent is not None and self._sent[0] is order:
            return self._sent[1]
        tensors = self._outgoing(m, order, header)
        messages = list(serialized_chunk_messages(tensors.items(), self._chunk_bytes, _PARAM))
        if self.compressor is None:
            self._sent = (order, messages)
        return messages

    async def stop(self) -> None:
        """Cancel joins in progress and tell every member the job ended (errors ignored)."""
        for task in list(self._joining.values()):
            task.cancel()
        req = worker_pb2.StopTrainingRequest(job_id=self.job_id)
        await asyncio.gather(
            *(m.stub.StopTraining(req, timeout=5.0) for m in self.history.values()),
            return_exceptions=True,
        )

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per worker: samples (count) and steps it contributed, seconds it computed."""
        return {
            n: {"samples": m.samples, "steps": m.steps, "compute_s": round(m.compute_s, 6)}
            for n, m in sorted(self.history.items())
        }


def reply_budget(tensors: dict[str, np.ndarray]) -> int:
    """The most bytes a ComputeGradients reply may carry for a model's tensors.

    12 bytes per element (top-k's int64 index and float32 value, the widest wire form of
    ``shared/training/compression.py``) plus 64 per tensor (0-d scales).
    """
    return sum(12 * int(a.size) + 64 for a in tensors.values())


async def read_gradients(
    call: Any, tensors: dict[str, np.ndarray] | None = None
) -> tuple[worker_pb2.StepResult, dict[str, np.ndarray]]:
    """Read a ComputeGradients response stream: the StepResult, then gradient and buffer chunks.

    Args:
        call: the response stream.
        tensors: the parameters and buffers sent (name -> array): each tensor of the reply
            must be one of them with its shape (or a compressed part of one), and all
            together within ``reply_budget``, checked before their bytes are kept; None: any.

    Raises:
        CodecError: a tensor not of the model or of another shape (INVALID_ARGUMENT).
        BudgetExceeded: the reply's tensors exceed the budget (RESOURCE_EXHAUSTED).
        RuntimeError: no StepResult came.
    """
    expected = None if tensors is None else {n: tuple(a.shape) for n, a in tensors.items()}
    budget = None if tensors is None else reply_budget(tensors)
    result, grads = await read_header_and_tensors(call, "result", "grad", expected, budget)
    if result is None:
        raise RuntimeError("worker closed the gradient stream without a result")
    return result, grads


def _losses(piece: Piece, result: worker_pb2.StepResult) -> np.ndarray | None:
    """The per-sample losses of a prioritized piece's answer; None for a uniform piece.

    Raises:
        CodecError: not one float32 per row of the piece (the member fails).
    """
    if piece.weights is None:
        return None
    losses = f32_from_bytes(result.losses, "losses")
    if len(losses) != len(piece.rows):
        raise CodecError(f"losses: {len(losses)} values for {len(piece.rows)} rows")
    return losses


def _inner_steps(order: StepOrder) -> worker_pb2.InnerSteps | None:
    """The header's ``inner_steps`` of a step (diloco); None: the field stays unset."""
    inner = order.inner_steps
    return None if inner is None else worker_pb2.InnerSteps(first=inner.first, total=inner.total)


_COMPUTE_GRADIENTS = "/neuroshard.v1.Worker/ComputeGradients"
_PARAM = worker_pb2.GradientRequest.DESCRIPTOR.fields_by_name["param"].number


def gradient_call(channel: aio.Channel) -> GradientCall:
    """ComputeGradients on ``channel``, taking serialized requests, answering their sizes.

    The step's parameter messages are serialized once and sent as they are to every member;
    each reply comes with its size on the wire (``ShardResult.bytes_from_worker``), read
    from the bytes received, since ``ByteSize`` of a parsed chunk costs as much as
    serializing it again.
    """
    return channel.stream_stream(
        _COMPUTE_GRADIENTS, request_serializer=_serialized, response_deserializer=_sized_reply
    )


def _serialized(data: bytes) -> bytes:
    return data


def _sized_reply(data: bytes) -> tuple[worker_pb2.GradientResponse, int]:
    return worker_pb2.GradientResponse.FromString(data), len(data)


async def _aiter(items: Sequence[bytes]) -> AsyncIterator[bytes]:
    for item in items:
        yield item


class _Counted:
    """An async iterator over a ``gradient_call`` reply: its messages, their bytes counted."""

    def __init__(self, call: Any) -> None:
        self._it = call.__aiter__()
        self.bytes = 0

    def __aiter__(self) -> _Counted:
        return self

    async def __anext__(self) -> worker_pb2.GradientResponse:
        msg: worker_pb2.GradientResponse
        msg, size = await self._it.__anext__()
        self.bytes += size
        return msg
