"""The workers of one training job: who computes which data shard, joins and failures.

A job has a fixed number of data shards (``spec.workers``); each step every shard is computed
by one live member. A member that fails or misses the step deadline leaves the job and its
shards are recomputed by the survivors in the same step, so the step still averages the full
global batch. A returning or new worker is admitted in the background (StartTraining) and
takes shards from the next step on, receiving the current parameters with its first step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
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
from shared.training.compression import Compressor, downlink_compressor
from shared.training.error_feedback import DeltaSender

log = get_logger("coordinator.train_members")


@dataclass
class Member:
    """One worker's seat in a job."""

    name: str
    stub: worker_pb2_grpc.WorkerStub
    params_version: int = -1  # the parameter version this worker holds
    sender: DeltaSender | None = None  # compression: what this worker holds, as deltas
    samples: int = 0
    steps: int = 0
    compute_s: float = 0.0  # seconds of forward/backward it reported for this job


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


@dataclass(frozen=True)
class Piece:
    """Rows of one step that one ComputeGradients call computes.

    With ``batch_policy: fixed`` a step has one piece per shard (its rows of the step); with
    ``proportional`` one piece per active member, slices of the step's global batch sized
    by the members' measured samples/s.

    Attributes:
        index: the piece's place in the step, from 0.
        rows: [R] int64 global training rows (R >= 0).
        shard: the shard all the rows belong to, or -1 when they span shards.
        member: the member the piece was sized for (proportional), None: round-robin.
        inner_rows: diloco: ``rows`` cut into the local steps' batches, these many rows
            each (summing to R); empty for sync.
    """

    index: int
    rows: np.ndarray = field(repr=False)
    shard: int = -1
    member: str | None = None
    inner_rows: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepPolicy:
    """How one step treats late and bad answers (``spec.straggler`` and precision).

    Attributes:
        mode: ``wait``, ``backup`` or ``drop`` (``StragglerSpec.mode``).
        deadline_s: seconds after the step's start when ``backup`` launches copies of the
            missing pieces and ``drop`` goes on without them.
        min_fraction: ``drop``: the share of the step's samples that must have arrived.
        reject_nonfinite: a piece whose gradient is not finite is rejected (False with fp16,
            where it means a loss-scale overflow and the step is skipped instead).
    """

    mode: str = "wait"
    deadline_s: float = float("inf")
    min_fraction: float = 1.0
    reject_nonfinite: bool = True


@dataclass
class ShardResult:
    """One piece's answer to a step: what its rows contributed, and how the call went.

    Attributes:
        samples: rows of the step (0 when the shard ran out this epoch).
        loss_sum: the loss summed over those rows.
        correct: rows predicted right.
        grads: parameter name -> gradient of the mean loss, float32 of the parameter's shape,
            unscaled.
        buffers: buffer name -> the worker's buffer after the step (e.g. BatchNorm running
            statistics), in the buffer's dtype.
        finite: every gradient element is finite.
        worker: the member that computed it.
        wall_s: seconds of the call as the coordinator saw it (transfer, queueing, compute).
        compute_s: seconds of forward and backward on the worker.
        bytes_to_worker: bytes sent to the worker (header and parameters).
        bytes_from_worker: bytes received from it (result, gradients, buffers).
    """

    samples: int
    loss_sum: float
    correct: int
    grads: dict[str, np.ndarray] = field(repr=False)
    buffers: dict[str, np.ndarray] = field(repr=False, default_factory=dict)
    finite: bool = True
    worker: str = ""
    wall_s: float = 0.0
    compute_s: float = 0.0
    bytes_to_worker: int = 0
    bytes_from_worker: int = 0


@dataclass
class StepOutcome:
    """What one step gathered.

    Attributes:
        results: piece index -> its accepted answer.
        rejected: (worker, piece index, reason) of answers refused (non-finite gradients).
        dropped: piece indices left out at the deadline (``drop``), rejected ones aside.
        backups: copies of pieces launched on other workers (``backup``).
        late: members whose call was cancelled when the step went on without them (drop,
            or another copy of the piece answered first), with the seconds that call had
            run (the longest, if several).
    """

    results: dict[int, ShardResult] = field(default_factory=dict)
    rejected: list[tuple[str, int, str]] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    backups: int = 0
    late: dict[str, float] = field(default_factory=dict)


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
        return await _StepRun(self, order, pieces, policy or StepPolicy()).run()

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
                rows=np.ascontiguousarray(piece.rows, dtype="<i8").tobytes(),
                inner_rows=piece.inner_rows,
            )
            tensors = self._outgoing(m, order, header) if include else None
            requests = list(self._requests(header, tensors))
            bytes_up += sum(r.ByteSize() for r in requests)
            m.params_version = -1  # unknown until the call answers
            call = m.stub.ComputeGradients(_aiter(requests), timeout=self._step_timeout_s)
            counted = _Counted(call)
            result, tensors_in = await read_gradients(counted)
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

    def _requests(
        self, header: worker_pb2.StepHeader, params: dict[str, np.ndarray] | None
    ) -> Iterator[worker_pb2.GradientRequest]:
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

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per worker: samples (count) and steps it contributed, seconds it computed."""
        return {
            n: {"samples": m.samples, "steps": m.steps, "compute_s": round(m.compute_s, 6)}
            for n, m in sorted(self.history.items())
        }


async def read_gradients(call: Any) -> tuple[worker_pb2.StepResult, dict[str, np.ndarray]]:
    """Read a ComputeGradients response stream: the StepResult, then gradient and buffer chunks."""
    result, grads = await read_header_and_tensors(call, "result", "grad")
    if result is None:
        raise RuntimeError("worker closed the gradient stream without a result")
    return result, grads


async def _aiter(items: Sequence[worker_pb2.GradientRequest]) -> AsyncIterator[Any]:
    for item in items:
        yield item


class _Counted:
    """An async iterator over a response stream that counts the bytes of its messages."""

    def __init__(self, call: Any) -> None:
        self._it = call.__aiter__()
        self.bytes = 0

    def __aiter__(self) -> _Counted:
        return self

    async def __anext__(self) -> Any:
        msg = await self._it.__anext__()
        self.bytes += msg.ByteSize()
        return msg


class _StepRun:
    """The calls of one step and their bookkeeping (``Members.step``)."""

    def __init__(
        self, members: Members, order: StepOrder, pieces: list[Piece], policy: StepPolicy
    ) -> None:
        self.m, self.order, self.pieces, self.policy = members, order, pieces, policy
        self.out = StepOutcome()
        self.calls: dict[asyncio.Task[ShardResult], tuple[Piece, Member]] = {}
        self.launched: dict[asyncio.Task[ShardResult], float] = {}  # loop time of each call
        self.stopping: list[asyncio.Task[ShardResult]] = []  # cancelled, not yet awaited
        self.tried: dict[int, set[str]] = {p.index: set() for p in pieces}
        self.settled: set[int] = set()
        self.backed_up: set[int] = set()
        self.expected = sum(len(p.rows) for p in pieces)
        self.arrived = 0
        self.t0 = 0.0

    def launch(self, piece: Piece, member: Member) -> None:
        task = asyncio.create_task(self.m.piece_step(member, piece, self.order))
        self.calls[task] = (piece, member)
        self.launched[task] = asyncio.get_running_loop().time()
        self.tried[piece.index].add(member.name)

    def running(self, index: int) -> bool:
        return any(p.index == index for p, _ in self.calls.values())

    def busy(self) -> set[str]:
        return {m.name for _, m in self.calls.values()}

    async def run(self) -> StepOutcome:
        loop = asyncio.get_running_loop()
        self.t0 = loop.time()
        deadline = self.t0 + self.policy.deadline_s
        for piece, member in self.m.assign(self.pieces):
            self.launch(piece, member)
        try:
            while len(self.settled) < len(self.pieces):
                self._relaunch_orphans()
                past = loop.time() >= deadline
                timeout = None if past or self.policy.mode == "wait" else deadline - loop.time()
                done, _ = await asyncio.wait(
                    self.calls, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    self._settle(task)
                if loop.time() >= deadline and len(self.settled) < len(self.pieces):
                    if self.policy.mode == "backup":
                        self._backups()
                    elif self.policy.mode == "drop" and self._enough():
                        break
        finally:
            await self._cancel_rest()
        for name in {r.worker for r in self.out.results.values()}:
            self.m.history[name].steps += 1  # steps it contributed to, once per step
        rejected = {i for _, i, _ in self.out.rejected}
        self.out.dropped = sorted({p.index for p in self.pieces} - set(self.out.results) - rejected)
        return self.out

    def _enough(self) -> bool:
        return self.arrived >= self.policy.min_fraction * self.expected

    def _relaunch_orphans(self) -> None:
        """Pieces with no answer and no call running (their member failed) go elsewhere."""
        for p in self.pieces:
            if p.index in self.settled or self.running(p.index):
                continue
            member = self.m.spare(set(), False, self.busy())
            if member is None:
                raise JobFailed("every worker of the job failed")
            self.launch(p, member)

    def _backups(self) -> None:
        """Launch one copy of each missing piece on an idle member (``backup`` mode)."""
        for p in self.pieces:
            if p.index in self.settled or p.index in self.backed_up:
                continue
            member = self.m.spare(self.tried[p.index], True, self.busy())
            if member is None:
                continue  # every idle member tried this piece; another piece may have one
            self.backed_up.add(p.index)
            self.out.backups += 1
            log.info("train_backup", job_id=self.m.job_id, piece=p.index, worker=member.name)
            self.launch(p, member)

    def _settle(self, task: asyncio.Task[ShardResult]) -> None:
        piece, member = self.calls.pop(task)
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, JobFailed):
            raise exc
        if exc is not None:
            self.m.fail(member, piece.index, exc)
            return
        r = task.result()
        member.compute_s += r.compute_s  # its work counts, also when a copy won
        if piece.index in self.settled:
            return
        if self.policy.reject_nonfinite and not r.finite:
            reason = "non-finite gradient"
            self.out.rejected.append((member.name, piece.index, reason))
            log.warning(
                "train_gradient_rejected",
                job_id=self.m.job_id,
                worker=member.name,
                piece=piece.index,
                reason=reason,
            )
            other = None
            if self.policy.mode == "backup":
                other = self.m.spare(self.tried[piece.index], False, self.busy())
            if other is not None:
                self.launch(piece, other)
            elif not self.running(piece.index):
                self.settled.add(piece.index)
            return
        self.out.results[piece.index] = r
        self.settled.add(piece.index)
        self.arrived += r.samples
        member.samples += r.samples  # accepted rows only (not a losing copy's or a rejected one's)
        for t in [t for t, (p, _m) in self.calls.items() if p.index == piece.index]:
            if self._stop(t):
                del self.calls[t]  # its member is idle for backups now
                self.stopping.append(t)

    def _stop(self, task: asyncio.Task[ShardResult]) -> bool:
        """Cancel a running call: its member's parameters are unknown, and it was late.

        Returns:
            False when the call had already ended (its answer is settled as usual).
        """
        if task.done() or not task.cancel():
            return False
        _piece, member = self.calls[task]
        member.params_version = -1
        ran_s = asyncio.get_running_loop().time() - self.launched[task]
        self.out.late[member.name] = max(self.out.late.get(member.name, 0.0), ran_s)
        return True

    async def _cancel_rest(self) -> None:
        """Cancel the calls still running; their members' parameters are then unknown."""
        for task in self.calls:
            self._stop(task)
        await asyncio.gather(*self.calls, *self.stopping, return_exceptions=True)
        self.calls.clear()
        self.stopping.clear()
