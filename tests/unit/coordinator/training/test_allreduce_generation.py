"""An allreduce generation's liveness rule (``Generation``) against scripted fake ranks.

No network: each rank's RunAllreduce call is a ``ScriptedCall`` that answers ``loaded``, then
what its script says once it gets its rendezvous (rank 0: its store's port first), and
nothing more: a rank that neither joins nor ends stays silent, as a stopped process would.
``timeout_s`` is short and ``LIVENESS_SLACK_S`` 0, so ``liveness_s`` is 0.2 s; every
generation is bounded by ``RUN_BOUND_S``, so a broken rule fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from coordinator.placement.membership import WorkerRecord
from coordinator.training import allreduce_generation
from coordinator.training.allreduce_generation import Generation, GenerationPlan
from shared.proto import worker_pb2

TIMEOUT_S = 0.1
RUN_BOUND_S = 10.0

JOINED = worker_pb2.AllreduceEvent(joined=True)


def ended(step: int, reason: str = "", done: bool = False) -> worker_pb2.AllreduceEvent:
    return worker_pb2.AllreduceEvent(
        ended=worker_pb2.AllreduceEnded(held_step=step, done=done, reason=reason)
    )


class ScriptedCall:
    """A RunAllreduce call: ``loaded`` at once, ``after_rendezvous`` once told it.

    A float among the events is a pause, seconds, before the next one.
    """

    def __init__(self, after_rendezvous: list[Any]) -> None:
        self._events: asyncio.Queue[Any] = asyncio.Queue()
        self._events.put_nowait(worker_pb2.AllreduceEvent(loaded=True))
        self._after = after_rendezvous
        self.cancelled = False

    async def write(self, msg: worker_pb2.AllreduceInput) -> None:
        if msg.HasField("rendezvous"):
            for event in self._after:
                self._events.put_nowait(event)

    async def read(self) -> Any:
        event = await self._events.get()
        while isinstance(event, float):
            await asyncio.sleep(event)
            event = await self._events.get()
        if event is None:
            raise asyncio.CancelledError  # as grpc.aio's read of a cancelled call
        if event is grpc.aio.EOF:
            self._events.put_nowait(grpc.aio.EOF)
        return event

    def cancel(self) -> bool:
        self.cancelled = True
        self._events.put_nowait(None)
        return True


class ScriptedClients:
    """``WorkerClients`` whose stubs open the scripted calls, by worker name."""

    def __init__(self, calls: dict[str, ScriptedCall]) -> None:
        self.calls = calls

    def stub(self, name: str, address: str) -> Any:
        call = self.calls[name]

        class Stub:
            def RunAllreduce(self) -> ScriptedCall:  # noqa: N802 (the RPC's name)
                return call

        return Stub()


def _generation(calls: dict[str, ScriptedCall]) -> Generation:
    ranks = [WorkerRecord(name, f"127.0.0.1:{5000 + i}", "cpu") for i, name in enumerate(calls)]
    plan = GenerationPlan(0, ranks, "{}", b"", 10, TIMEOUT_S, 5.0)

    async def on_event(name: str, event: worker_pb2.AllreduceEvent) -> None:
        pass

    return Generation(
        "job", plan, ScriptedClients(calls), 1024, on_event, lambda _: True, lambda: False
    )  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def no_slack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allreduce_generation, "LIVENESS_SLACK_S", 0.0)


async def test_a_rank_silent_after_another_ended_is_given_up_on() -> None:
    # Arrange: rank 0 opens its store and joins, then hangs; rank 1 joins and its collective
    # times out (it ends with a reason).
    port = worker_pb2.AllreduceEvent(store_port=4000)
    calls = {
        "w0": ScriptedCall([port, JOINED]),
        "w1": ScriptedCall([JOINED, ended(3, "DistBackendError: timed out"), grpc.aio.EOF]),
    }
    gen = _generation(calls)

    # Act
    t0 = time.monotonic()
    async with asyncio.timeout(RUN_BOUND_S):
        outcome = await gen.run()

    # Assert: w1 holds its step; w0 failed for not ending in time, and its call was cancelled.
    assert gen.liveness_s == pytest.approx(2 * TIMEOUT_S)
    assert outcome.held == {"w1": 3}
    assert set(outcome.failed) == {"w0"}
    assert outcome.failed["w0"] == (
        "RuntimeError: w0 was silent for 0.2 s (2 x collective_timeout_s 0.1 s + 0 s) "
        "after w1 ended"
    )
    assert calls["w0"].cancelled
    assert time.monotonic() - t0 < 3.0  # liveness_s, plus the follow loop's 1 s tick


async def test_ranks_that_never_join_are_given_up_on() -> None:
    # Arrange: rank 0 opens its store; then neither rank joins nor ends (both stalled).
    calls = {
        "w0": ScriptedCall([worker_pb2.AllreduceEvent(store_port=4000)]),
        "w1": ScriptedCall([]),
    }
    gen = _generation(calls)

    # Act
    async with asyncio.timeout(RUN_BOUND_S):
        outcome = await gen.run()

    # Assert: both failed for not joining within liveness_s of the rendezvous.
    assert outcome.held == {}
    assert set(outcome.failed) == {"w0", "w1"}
    assert all("did not join the group within 0.2 s" in why for why in outcome.failed.values())
    assert calls["w0"].cancelled and calls["w1"].cancelled


async def test_a_rank_still_streaming_after_another_ended_is_not_given_up_on() -> None:
    # Arrange: w1 ends at once; w0 (rank 0) streams its final state's chunks for 2.5 s,
    # 12 x liveness_s, before it ends.
    chunk = worker_pb2.AllreduceEvent(state=worker_pb2.AllreduceState(step=20, data=b"x"))
    streaming = [0.1, chunk] * 25 + [ended(20, done=True), grpc.aio.EOF]
    calls = {
        "w0": ScriptedCall([worker_pb2.AllreduceEvent(store_port=4000), JOINED, *streaming]),
        "w1": ScriptedCall([JOINED, ended(20, done=True), grpc.aio.EOF]),
    }

    # Act
    async with asyncio.timeout(RUN_BOUND_S):
        outcome = await _generation(calls).run()

    # Assert: silence, not the time since w1 ended, is what counts.
    assert outcome.held == {"w0": 20, "w1": 20} and outcome.failed == {}


async def test_ranks_that_join_and_end_together_are_not_given_up_on() -> None:
    # Arrange: a generation whose ranks join and end (done) as a healthy one does.
    port = worker_pb2.AllreduceEvent(store_port=4000)
    calls = {
        "w0": ScriptedCall([port, JOINED, ended(20, done=True), grpc.aio.EOF]),
        "w1": ScriptedCall([JOINED, ended(20, done=True), grpc.aio.EOF]),
    }

    # Act
    async with asyncio.timeout(RUN_BOUND_S):
        outcome = await _generation(calls).run()

    # Assert
    assert outcome.held == {"w0": 20, "w1": 20} and outcome.failed == {}
    assert outcome.done
