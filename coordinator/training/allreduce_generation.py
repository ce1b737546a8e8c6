"""One generation of an ``allreduce`` job: the rendezvous and the calls to its ranks.

The coordinator is the rendezvous. It opens ``RunAllreduce`` on every rank, which starts (or
reuses) the job's child process there, and waits until all have loaded; then it tells rank 0
to make the generation's store, which answers with its port, and gives every other rank rank
0's ``host:port``, so no address is configured anywhere and nobody waits on a store while a
peer is still importing torch. Each generation has a fresh secret, sent to its ranks in
their headers, that seals the store's keys against anyone else who reaches its port. While
the ranks train, their events (progress, rank 0's states, each rank's end) reach
``on_event``; a rank whose call breaks, or whose worker the coordinator declares DEAD, has
failed. The generation is over when every call has ended or failed: the survivors say which
step their replica holds.

Liveness: every wait of a live rank's child (the store, each collective) gives up after the
job's ``collective_timeout_s``, T, and the rank then ends; a rank that stays silent much
longer is stuck (a hung or stopped process) and would hold the generation, and the job, open
forever. So each rank must report ``joined`` (in the group, holding rank 0's state) within
``liveness_s`` = 2 T + 10 s of the rendezvous, and may not stay silent for ``liveness_s``
once a rank has ended or failed (it may still stream, e.g. rank 0's final state). A rank
that misses either has failed: its call is cancelled (its worker kills the child) and the
generation is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from coordinator.jobs.jobs import JobFailed
from coordinator.placement.membership import WorkerRecord
from shared.logging import get_logger
from shared.proto import worker_pb2
from shared.rpc import error_message
from shared.rpc.peers import WorkerClients

log = get_logger(__name__)

# A worker that answers these refused the job itself: retrying elsewhere cannot help.
_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)

# A rank must join the group, or end once another rank has ended, within this many
# collective timeouts plus LIVENESS_SLACK_S: one timeout for its own wait to give up, one
# for what follows (tearing the group down, a state broadcast, a step's compute).
LIVENESS_TIMEOUTS = 2
LIVENESS_SLACK_S = 10.0  # process start-up and scheduling on a loaded machine, seconds


@dataclass
class GenerationPlan:
    """Who trains in a generation and from what.

    Attributes:
        number: the generation, from 0.
        ranks: the members in rank order; rank 0 holds (or is sent) the newest state.
        spec_json: the job spec with ``device`` resolved.
        state: torch.save bytes sent to rank 0 (b"": rank 0 holds the newest state).
        checkpoint_every: steps between the states rank 0 sends.
        timeout_s: rendezvous and collective deadline, seconds.
        start_timeout_s: how long a worker may take to start its child and answer, seconds.
        held_before: worker name -> the step its child holds now (survivors).
        stop_at_step: > 0: the ranks end the generation at this step (a paced job's granted
            epochs, a prioritized window's end), rank 0 sending its full state there; 0: at
            the job's end.
        window: sampling prioritized: (first step, rows [K] int64 bytes, weights [K] float32
            bytes), little-endian, sent to every rank; None: uniform.
        send_start_state: rank 0 sends its full state before its first step.
    """

    number: int
    ranks: list[WorkerRecord]
    spec_json: str
    state: bytes
    checkpoint_every: int
    timeout_s: float
    start_timeout_s: float
    held_before: dict[str, int] = field(default_factory=dict)
    stop_at_step: int = 0
    window: tuple[int, bytes, bytes] | None = None
    send_start_state: bool = False


@dataclass
class GenerationOutcome:
    """How a generation ended.

    Attributes:
        held: worker name -> the step its replica holds (the ranks that ended cleanly).
        failed: worker name -> why its call failed.
        done: a rank reported that training finished.
        reasons: the ranks' reasons for ending, when not done.
        losses: sampling prioritized: worker name -> (the step its losses start at, its
            unweighted per-sample losses, float32 little-endian bytes) of the ranks that ended.
    """

    held: dict[str, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    done: bool = False
    reasons: list[str] = field(default_factory=list)
    losses: dict[str, tuple[int, bytes]] = field(default_factory=dict)


EventHandler = Callable[[str, worker_pb2.AllreduceEvent], Awaitable[None]]


class Generation:
    """Runs one generation; ``run`` returns its outcome."""

    def __init__(
        self,
        job_id: str,
        plan: GenerationPlan,
        clients: WorkerClients,
        chunk_bytes: int,
        on_event: EventHandler,
        is_alive: Callable[[str], bool],
        want_rescale: Callable[[], bool],
    ) -> None:
        """Prepare the generation; nothing is called before ``run``.

        Args:
            job_id: the job.
            plan: ranks, spec and state.
            clients: channels to the workers.
            chunk_bytes: size of the state chunks sent to rank 0, bytes.
            on_event: called with (worker name, event) for progress and state events.
            is_alive: whether the coordinator still holds a worker ALIVE.
            want_rescale: true when the job should end this generation to take in more
                workers (checked about once a second).
        """
        self.job_id, self.plan = job_id, plan
        self._clients, self._chunk_bytes = clients, chunk_bytes
        self._on_event, self._is_alive, self._want_rescale = on_event, is_alive, want_rescale
        self._calls: dict[str, Any] = {}
        # Shared by this generation's ranks only (over the coordinator's channels, mutual TLS
        # when TLS is on): it seals the keys of the generation's rendezvous store, so a peer
        # that reaches the store cannot read or forge them (worker/allreduce/rendezvous_store.py).
        self._secret = secrets.token_hex(32)
        self.outcome = GenerationOutcome()
        self._joined: set[str] = set()
        self._first_end: tuple[str, float] | None = None  # (worker, time.monotonic())
        self._heard: dict[str, float] = {}  # worker -> time.monotonic() of its last event

    @property
    def liveness_s(self) -> float:
        """How long a rank may stay silent at the two points it must answer, seconds.

        Within this of the rendezvous it joins the group; once a rank has ended, it may not
        be silent for this long (``LIVENESS_TIMEOUTS`` x ``timeout_s`` + ``LIVENESS_SLACK_S``).
        """
        return LIVENESS_TIMEOUTS * self.plan.timeout_s + LIVENESS_SLACK_S

    async def run(self) -> GenerationOutcome:
        """Load every rank, rendezvous, then follow every rank until all have ended or failed.

        A rank that cannot load (its call fails before the rendezvous) ends the generation
        before it begins: the others' calls are dropped, their children keep their state
        (``held`` says which step, from ``plan.held_before``). A rank that misses a liveness
        deadline (``liveness_s``) fails: its call is cancelled, so the generation always ends.

        Raises:
            JobFailed: a worker refused the job (INVALID_ARGUMENT, PERMISSION_DENIED).
        """
        try:
            if await self._load_all() and (port := await self._rendezvous_rank0()) is not None:
                host = self.plan.ranks[0].address.rpartition(":")[0]
                for w in self.plan.ranks[1:]:
                    await self._send(w.name, worker_pb2.AllreduceInput(rendezvous=f"{host}:{port}"))
                await self._follow()
        finally:
            for call in self._calls.values():
                call.cancel()
        return self.outcome

    async def _load_all(self) -> bool:
        """Open every rank's call and wait until each has its training process (True)."""
        for rank, w in enumerate(self.plan.ranks):
            await self._open(w, rank, self.plan.state if rank == 0 else b"")
        results = await asyncio.gather(
            *(self._until_loaded(w.name) for w in self.plan.ranks), return_exceptions=True
        )
        for w, r in zip(self.plan.ranks, results, strict=True):
            if isinstance(r, JobFailed):
                raise r
            if isinstance(r, BaseException):
                self._fail(w.name, r)
        if self.outcome.failed:
            for w in self.plan.ranks:
                if w.name not in self.outcome.failed:
                    self.outcome.held[w.name] = self.plan.held_before.get(w.name, 0)
            return False
        return True

    async def _until_loaded(self, name: str) -> None:
        call = self._calls[name]
        try:
            async with asyncio.timeout(self.plan.start_timeout_s):
                event = await call.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _REFUSALS:
                raise JobFailed(f"worker {name} refused the job: {error_message(exc)}") from None
            raise
        if event is grpc.aio.EOF or not event.loaded:
            raise RuntimeError("the worker did not load the job's training process")

    async def _rendezvous_rank0(self) -> int | None:
        """Tell rank 0 to open the store; return its port (None: rank 0 failed)."""
        w = self.plan.ranks[0]
        call = self._calls[w.name]
        try:
            await call.write(worker_pb2.AllreduceInput(rendezvous=""))
            async with asyncio.timeout(self.plan.timeout_s):
                while True:
                    event = await call.read()
                    if event is grpc.aio.EOF:
                        raise RuntimeError("rank 0 ended its call before the rendezvous")
                    if event.HasField("ended"):
                        self._ended(w.name, event.ended)
                        raise RuntimeError(f"rank 0 ended at once: {event.ended.reason}")
                    if event.HasField("store_port"):
                        return int(event.store_port)
                    await self._on_event(w.name, event)
        except (grpc.aio.AioRpcError, TimeoutError, RuntimeError) as exc:
            self._fail(w.name, exc)
        for other in self.plan.ranks[1:]:
            self.outcome.held[other.name] = self.plan.held_before.get(other.name, 0)
        return None

    async def _open(self, w: WorkerRecord, rank: int, state: bytes) -> None:
        stub = self._clients.stub(w.name, w.address)
        call = stub.RunAllreduce()
        self._calls[w.name] = call
        header = worker_pb2.AllreduceHeader(
            job_id=self.job_id,
            spec_json=self.plan.spec_json,
            generation=self.plan.number,
            rank=rank,
            world_size=len(self.plan.ranks),
            state_follows=bool(state),
            checkpoint_every_steps=self.plan.checkpoint_every,
            timeout_s=self.plan.timeout_s,
            rendezvous_secret=self._secret,
            stop_at_step=self.plan.stop_at_step,
            send_start_state=self.plan.send_start_state,
        )
        if self.plan.window is not None:
            first, rows, weights = self.plan.window
            header.window_first_step, header.window_rows = first, rows
            header.window_weights = weights
        await self._send(w.name, worker_pb2.AllreduceInput(header=header))
        for i in range(0, len(state), self._chunk_bytes):
            await self._send(
                w.name, worker_pb2.AllreduceInput(state=state[i : i + self._chunk_bytes])
            )
        if state:
            await self._send(w.name, worker_pb2.AllreduceInput(state_done=True))

    async def _send(self, name: str, msg: worker_pb2.AllreduceInput) -> None:
        """Write to a rank's call; a broken call shows when it is read."""
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self._calls[name].write(msg)

    async def _follow(self) -> None:
        tasks = {
            asyncio.create_task(self._read(name, call)): name for name, call in self._calls.items()
        }
        rescaling = False
        join_by = time.monotonic() + self.liveness_s
        while tasks:
            done, _ = await asyncio.wait(tasks, timeout=1.0)
            for t in done:
                tasks.pop(t)
                t.result()  # JobFailed propagates
            for name in [n for n in self._calls if not self._is_alive(n)]:
                self._give_up(name, "the coordinator declared the worker DEAD")
            self._check_liveness(time.monotonic(), join_by)
            if not rescaling and self._want_rescale():
                rescaling = True
                log.info("allreduce_rescale", job_id=self.job_id, generation=self.plan.number)
                for name in self._calls:
                    await self._send(name, worker_pb2.AllreduceInput(stop=True))

    def _check_liveness(self, now: float, join_by: float) -> None:
        """Give up on the ranks not joined by ``join_by``, or silent too long after an end.

        Args:
            now: time.monotonic(), seconds.
            join_by: when every rank should have joined (rendezvous + ``liveness_s``).
        """
        bound = (
            f"{self.liveness_s:g} s ({LIVENESS_TIMEOUTS} x collective_timeout_s "
            f"{self.plan.timeout_s:g} s + {LIVENESS_SLACK_S:g} s)"
        )
        for name in self._calls:
            if name not in self._joined and now >= join_by:
                self._give_up(
                    name, f"{name} did not join the group within {bound} of the rendezvous"
                )
            elif self._first_end is not None:
                first, ended_at = self._first_end
                if now >= max(ended_at, self._heard.get(name, 0.0)) + self.liveness_s:
                    self._give_up(name, f"{name} was silent for {bound} after {first} ended")

    def _give_up(self, name: str, why: str) -> None:
        """Fail a rank that is still running and cancel its call (its worker kills the child)."""
        if name in self.outcome.held or name in self.outcome.failed:
            return
        self._fail(name, RuntimeError(why))
        self._calls[name].cancel()

    async def _read(self, name: str, call: Any) -> None:
        try:
            while True:
                event = await call.read()
                if event is grpc.aio.EOF:
                    if name not in self.outcome.held:
                        self._fail(name, RuntimeError("the call ended without an end event"))
                    return
                self._heard[name] = time.monotonic()
                if event.HasField("ended"):
                    self._ended(name, event.ended)
                elif event.HasField("joined"):
                    self._joined.add(name)
                else:
                    await self._on_event(name, event)
        except asyncio.CancelledError:
            if name not in self.outcome.held:
                self._fail(name, RuntimeError("cancelled"))
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _REFUSALS:
                raise JobFailed(f"worker {name} refused the job: {error_message(exc)}") from None
            self._fail(name, exc)

    def _ended(self, name: str, ended: worker_pb2.AllreduceEnded) -> None:
        self._first_end = self._first_end or (name, time.monotonic())
        self.outcome.held[name] = int(ended.held_step)
        self.outcome.done |= ended.done
        if self.plan.window is not None:
            self.outcome.losses[name] = (int(ended.losses_from_step), ended.losses)
        if not ended.done and ended.reason:
            self.outcome.reasons.append(f"{name}: {ended.reason}")

    def _fail(self, name: str, exc: BaseException) -> None:
        if name in self.outcome.failed or name in self.outcome.held:
            return
        self._first_end = self._first_end or (name, time.monotonic())
        self.outcome.failed[name] = error_message(exc)
        log.warning(
            "allreduce_member_failed",
            job_id=self.job_id,
            generation=self.plan.number,
            worker=name,
            error=self.outcome.failed[name],
        )
