"""The calls of one training step and their bookkeeping: retries, backups, drops, rejections.

``StepRun`` launches one ComputeGradients call per piece (``StepMembers.piece_step``) and
waits under the step's ``StepPolicy``: a failed member's pieces are relaunched elsewhere; in
``backup`` mode each piece still missing at the deadline gets one copy on an idle member that
has not tried it, the first answer wins; in ``drop`` mode the step goes on at the deadline
once ``min_fraction`` of its samples arrived; a non-finite answer is rejected (recomputed
elsewhere in ``backup`` mode). Cancelled calls leave their member's parameters unknown.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from coordinator.jobs.jobs import JobFailed
from coordinator.training.step_types import (
    Member,
    Piece,
    ShardResult,
    StepOrder,
    StepOutcome,
    StepPolicy,
)
from shared.logging import get_logger

log = get_logger(__name__)


class StepMembers(Protocol):
    """What a step needs of the job's members (``train_members.Members``)."""

    job_id: str
    history: dict[str, Member]

    def assign(self, pieces: list[Piece]) -> list[tuple[Piece, Member]]:
        """Each piece's first member."""
        ...

    def spare(self, avoid: set[str], idle_only: bool, busy: set[str]) -> Member | None:
        """A member for another copy of a piece."""
        ...

    async def piece_step(self, m: Member, piece: Piece, order: StepOrder) -> ShardResult:
        """One call computing ``piece`` on ``m``."""
        ...

    def fail(self, member: Member, piece: int, exc: BaseException) -> None:
        """Remove a member whose call failed."""
        ...


class StepRun:
    """The calls of one step and their bookkeeping (``Members.step``)."""

    def __init__(
        self, members: StepMembers, order: StepOrder, pieces: list[Piece], policy: StepPolicy
    ) -> None:
        """Nothing runs until ``run``.

        Args:
            members: the job's members.
            order: what every piece is computed from.
            pieces: the step's pieces (each computed once, unless backed up or relaunched).
            policy: the step's straggler mode, deadline (seconds) and rejection rule.
        """
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
        """Start one call computing ``piece`` on ``member``."""
        task = asyncio.create_task(self.m.piece_step(member, piece, self.order))
        self.calls[task] = (piece, member)
        self.launched[task] = asyncio.get_running_loop().time()
        self.tried[piece.index].add(member.name)

    def running(self, index: int) -> bool:
        """Whether a call computing piece ``index`` is running."""
        return any(p.index == index for p, _ in self.calls.values())

    def busy(self) -> set[str]:
        """The members with a call running."""
        return {m.name for _, m in self.calls.values()}

    async def run(self) -> StepOutcome:
        """Run the step's calls to its outcome (``Members.step`` documents the rules).

        Raises:
            JobFailed: every member failed, or a worker refused the job (FAILED).
        """
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
