"""One sync training step's straggler logic (``Members.step``) against scripted fake workers.

No network: ``ScriptedMembers`` replaces the ComputeGradients call (``piece_step``) with a
script per member (answer, answer after an event, raise, answer non-finite, hang until
cancelled), so each test says what every worker does and asserts on the step's outcome.
Deadlines are short (``DEADLINE_S``); every step is bounded by ``STEP_BOUND_S`` so a broken
step fails instead of hanging.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

import numpy as np
import pytest

from coordinator.jobs.jobs import JobFailed
from coordinator.training.train_members import (
    Member,
    Members,
    Piece,
    ShardResult,
    StepOrder,
    StepOutcome,
    StepPolicy,
)

DEADLINE_S = 0.05
STEP_BOUND_S = 5.0
VERSION = 7
ROWS_PER_PIECE = 4

# What one member does with one piece: returns whether its gradient is finite, or raises.
Script = Callable[[Piece], Awaitable[bool]]


def answer(delay_s: float = 0.0, finite: bool = True) -> Script:
    async def script(_piece: Piece) -> bool:
        await asyncio.sleep(delay_s)
        return finite

    return script


def answer_after(event: asyncio.Event) -> Script:
    async def script(_piece: Piece) -> bool:
        await event.wait()
        return True

    return script


def fail() -> Script:
    async def script(piece: Piece) -> bool:
        raise RuntimeError(f"worker died on piece {piece.index}")

    return script


def hang() -> Script:
    async def script(_piece: Piece) -> bool:
        await asyncio.Event().wait()  # never set: only a cancellation ends it
        raise AssertionError("unreachable")

    return script


def on_start(action: Callable[[], None], script: Script) -> Script:
    """Run ``action`` (e.g. set an event) as the call starts, then ``script``."""

    async def wrapped(piece: Piece) -> bool:
        action()
        return await script(piece)

    return wrapped


def by_piece(scripts: Mapping[int, Script]) -> Script:
    async def script(piece: Piece) -> bool:
        return await scripts[piece.index](piece)

    return script


def then(first: Script, action: Callable[[], None]) -> Script:
    """Run ``first``, then ``action`` (e.g. set an event) before answering."""

    async def script(piece: Piece) -> bool:
        finite = await first(piece)
        action()
        return finite

    return script


class ScriptedMembers(Members):
    """Members whose ComputeGradients call is a script per member name.

    Unlike the real ``piece_step`` the fake sets ``params_version`` only when it answers, so
    a -1 after a cancelled call is the step's own doing.
    """

    def __init__(self, scripts: Mapping[str, Script]) -> None:
        super().__init__(
            "job-1",
            "{}",
            shards=len(scripts),
            clients=None,  # type: ignore[arg-type]
            alive=list,
            rpc_timeout_s=1.0,
            step_timeout_s=1.0,
            chunk_bytes=1 << 20,
        )
        self.scripts = dict(scripts)
        for name in scripts:
            member = Member(name, stub=None, params_version=VERSION)  # type: ignore[arg-type]
            self.live[name] = self.history[name] = member
        self.calls: list[tuple[str, int]] = []
        self.cancelled: list[tuple[str, int]] = []

    async def piece_step(self, m: Member, piece: Piece, order: StepOrder) -> ShardResult:
        self.calls.append((m.name, piece.index))
        try:
            finite = await self.scripts[m.name](piece)
        except asyncio.CancelledError:
            self.cancelled.append((m.name, piece.index))
            raise
        m.params_version = order.version
        samples = len(piece.rows)
        grads = {"w": np.full(2, float(piece.index) if finite else np.nan, np.float32)}
        return ShardResult(samples, 0.5 * samples, samples, grads, finite=finite, worker=m.name)

    def callers(self, piece: int) -> list[str]:
        return [name for name, index in self.calls if index == piece]


def order() -> StepOrder:
    return StepOrder(0, 0, 0, VERSION, {"w": np.zeros(2, np.float32)})


def pieces(n: int) -> list[Piece]:
    return [
        Piece(i, np.arange(i * ROWS_PER_PIECE, (i + 1) * ROWS_PER_PIECE, dtype=np.int64), i)
        for i in range(n)
    ]


async def run_step(
    members: Members, n_pieces: int, policy: StepPolicy | None = None
) -> StepOutcome:
    return await asyncio.wait_for(members.step(order(), pieces(n_pieces), policy), STEP_BOUND_S)


def workers(outcome: StepOutcome) -> dict[int, str]:
    return {i: r.worker for i, r in outcome.results.items()}


# --- any mode ------------------------------------------------------------------------------


async def test_wait_mode_gets_every_piece_from_its_member() -> None:
    members = ScriptedMembers({"a": answer(0.03), "b": answer(0.01), "c": answer(0.02)})

    outcome = await run_step(members, 3, StepPolicy("wait", deadline_s=DEADLINE_S))

    assert workers(outcome) == {0: "a", 1: "b", 2: "c"}
    assert [r.samples for r in outcome.results.values()] == [ROWS_PER_PIECE] * 3
    assert (outcome.dropped, outcome.rejected, outcome.late, outcome.backups) == ([], [], {}, 0)
    assert members.cancelled == []
    assert all(m.params_version == VERSION for m in members.live.values())


async def test_a_failing_members_piece_is_recomputed_by_another() -> None:
    members = ScriptedMembers({"a": fail(), "b": answer(), "c": answer()})

    outcome = await run_step(members, 3)

    assert sorted(outcome.results) == [0, 1, 2]
    assert outcome.results[0].worker in {"b", "c"}
    assert members.callers(0) == ["a", outcome.results[0].worker]
    assert members.failures == 1
    assert sorted(members.live) == ["b", "c"]
    assert "a" in members.history
    assert outcome.dropped == []


async def test_every_member_failing_fails_the_job() -> None:
    members = ScriptedMembers({"a": fail(), "b": fail()})

    with pytest.raises(JobFailed, match="every worker of the job failed"):
        await run_step(members, 2)

    assert members.live == {}
    assert members.failures == 2


async def test_excluded_members_get_no_pieces_even_to_replace_a_failed_one() -> None:
    members = ScriptedMembers({"a": fail(), "b": answer(), "c": answer()})
    members.excluded = {"b"}

    outcome = await run_step(members, 3)

    assert "b" not in {name for name, _ in members.calls}
    assert workers(outcome) == {0: "c", 1: "c", 2: "c"}


async def test_every_live_member_excluded_still_computes() -> None:
    members = ScriptedMembers({"a": answer(), "b": answer()})
    members.excluded = {"a", "b"}

    outcome = await run_step(members, 2)

    assert workers(outcome) == {0: "a", 1: "b"}


async def test_steps_count_once_per_step_a_member_contributed_to() -> None:
    members = ScriptedMembers(
        {"a": answer(), "b": answer(), "c": by_piece({2: answer(finite=False)})}
    )

    for _ in range(2):
        await run_step(members, 5)  # a: pieces 0 and 3, b: 1 and 4, c: 2 (rejected)

    assert {n: m.steps for n, m in members.history.items()} == {"a": 2, "b": 2, "c": 0}


# --- non-finite answers ----------------------------------------------------------------------


async def test_wait_mode_leaves_a_non_finite_piece_out() -> None:
    members = ScriptedMembers({"a": answer(finite=False), "b": answer()})

    outcome = await run_step(members, 2)

    assert outcome.rejected == [("a", 0, "non-finite gradient")]
    assert sorted(outcome.results) == [1]
    assert outcome.dropped == []
    assert members.callers(0) == ["a"]


async def test_backup_mode_recomputes_a_non_finite_piece_elsewhere() -> None:
    members = ScriptedMembers({"a": answer(finite=False), "b": answer()})

    outcome = await run_step(members, 2, StepPolicy("backup", deadline_s=DEADLINE_S))

    assert outcome.rejected == [("a", 0, "non-finite gradient")]
    assert workers(outcome) == {0: "b", 1: "b"}
    assert outcome.results[0].finite
    assert outcome.dropped == []


async def test_non_finite_is_kept_when_not_rejected() -> None:
    members = ScriptedMembers({"a": answer(finite=False), "b": answer()})

    outcome = await run_step(members, 2, StepPolicy(reject_nonfinite=False))

    assert outcome.rejected == []
    assert workers(outcome) == {0: "a", 1: "b"}
    assert not outcome.results[0].finite
    assert np.isnan(outcome.results[0].grads["w"]).all()


# --- backup ----------------------------------------------------------------------------------


async def test_backup_copy_answers_a_hung_piece_and_the_hung_call_is_cancelled() -> None:
    members = ScriptedMembers({"a": hang(), "b": answer()})

    outcome = await run_step(members, 2, StepPolicy("backup", deadline_s=DEADLINE_S))

    assert workers(outcome) == {0: "b", 1: "b"}
    assert outcome.backups == 1
    assert members.cancelled == [("a", 0)]
    assert members.live["a"].params_version == -1
    assert members.live["b"].params_version == VERSION
    assert list(outcome.late) == ["a"]
    assert outcome.late["a"] > 0
    assert outcome.dropped == []
    assert members.failures == 0


async def test_backup_never_goes_to_a_member_that_tried_the_piece() -> None:
    # a refuses piece 0 at once, so b computes it too; at the deadline a is the only idle
    # member: it has tried piece 0, so only piece 1 (hung on b) gets a copy, on a.
    released = asyncio.Event()
    members = ScriptedMembers(
        {
            "a": by_piece({0: answer(finite=False), 1: then(answer(), released.set)}),
            "b": by_piece({0: answer_after(released), 1: hang()}),
        }
    )

    outcome = await run_step(members, 2, StepPolicy("backup", deadline_s=DEADLINE_S))

    assert members.callers(0) == ["a", "b"]
    assert members.callers(1) == ["b", "a"]
    assert workers(outcome) == {0: "b", 1: "a"}
    assert outcome.backups == 1
    assert outcome.rejected == [("a", 0, "non-finite gradient")]
    assert members.cancelled == [("b", 1)]
    assert list(outcome.late) == ["b"]


async def test_backup_launches_at_most_one_copy_per_piece() -> None:
    # a hangs on piece 0 and its copy on b waits for c; c turns idle past the deadline (a
    # re-check of the missing pieces) and must not get a second copy of piece 0.
    released = asyncio.Event()
    members = ScriptedMembers(
        {
            "a": hang(),
            "b": by_piece({0: answer_after(released), 1: answer()}),
            "c": then(answer(2 * DEADLINE_S), released.set),
        }
    )

    outcome = await run_step(members, 3, StepPolicy("backup", deadline_s=DEADLINE_S))

    assert members.callers(0) == ["a", "b"]
    assert outcome.backups == 1
    assert workers(outcome) == {0: "b", 1: "b", 2: "c"}
    assert members.cancelled == [("a", 0)]


async def test_a_cancelled_backup_copy_is_late_by_its_own_seconds_only() -> None:
    # The copy starts at the deadline and loses at once: its seconds are not the step's.
    deadline_s = 0.2
    copy_started = asyncio.Event()
    members = ScriptedMembers(
        {
            "a": answer_after(copy_started),
            "b": by_piece({0: on_start(copy_started.set, hang()), 1: answer()}),
        }
    )

    outcome = await run_step(members, 2, StepPolicy("backup", deadline_s=deadline_s))

    assert workers(outcome) == {0: "a", 1: "b"}
    assert members.cancelled == [("b", 0)]
    assert members.live["b"].params_version == -1
    assert members.live["a"].params_version == VERSION
    assert list(outcome.late) == ["b"]
    assert outcome.late["b"] < deadline_s


# --- drop ------------------------------------------------------------------------------------


async def test_drop_goes_on_without_a_hung_piece_once_enough_arrived() -> None:
    members = ScriptedMembers({"a": answer(), "b": answer(), "c": hang()})

    outcome = await run_step(
        members, 3, StepPolicy("drop", deadline_s=DEADLINE_S, min_fraction=0.5)
    )

    assert sorted(outcome.results) == [0, 1]
    assert outcome.dropped == [2]
    assert members.cancelled == [("c", 2)]
    assert members.live["c"].params_version == -1
    assert list(outcome.late) == ["c"]
    assert outcome.backups == 0


async def test_drop_with_min_fraction_one_waits_for_every_piece() -> None:
    members = ScriptedMembers({"a": answer(), "b": answer(), "c": answer(4 * DEADLINE_S)})

    outcome = await run_step(
        members, 3, StepPolicy("drop", deadline_s=DEADLINE_S, min_fraction=1.0)
    )

    assert workers(outcome) == {0: "a", 1: "b", 2: "c"}
    assert outcome.dropped == []
    assert outcome.late == {}
    assert members.cancelled == []


async def test_drop_short_of_min_fraction_goes_on_at_the_next_answer_that_suffices() -> None:
    # At the deadline 1 of 3 pieces arrived (< 0.6); b's answer later makes 2 of 3.
    members = ScriptedMembers({"a": answer(), "b": answer(3 * DEADLINE_S), "c": hang()})

    outcome = await run_step(
        members, 3, StepPolicy("drop", deadline_s=DEADLINE_S, min_fraction=0.6)
    )

    assert workers(outcome) == {0: "a", 1: "b"}
    assert outcome.dropped == [2]
    assert members.cancelled == [("c", 2)]
    assert list(outcome.late) == ["c"]
