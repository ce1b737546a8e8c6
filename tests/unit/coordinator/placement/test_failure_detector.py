"""coordinator/placement/failure_detector.py's sweep loop: silence declares a worker dead, except
the silence of a coordinator that was itself paused (issue 12, item 8: a test cluster's event
loop stalled under load for longer than the heartbeat timeout and every worker was declared
dead at once)."""

from __future__ import annotations

import asyncio
import time

from coordinator.placement.failure_detector import FailureDetector
from coordinator.placement.membership import Membership, WorkerState
from shared.metrics import Metrics
from tests.conftest import wait_until

TIMEOUT_S = 0.4  # short: the sweep loop runs on the real clock


def _detector(m: Membership, dead: list[int]) -> FailureDetector:
    return FailureDetector(
        m,
        rebalancer=None,  # type: ignore[arg-type]  # only failure reports use it
        clients=None,  # type: ignore[arg-type]
        metrics=Metrics(),
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=TIMEOUT_S,
        probe_timeout_s=1.0,
        on_dead=lambda: dead.append(1),
    )


async def test_a_silent_worker_is_declared_dead() -> None:
    # Arrange
    m, dead = Membership(TIMEOUT_S), []
    m.register("w0", "h:1", "cpu", "p0")
    task = asyncio.create_task(_detector(m, dead).run())

    # Act: no heartbeat while the loop keeps running.
    try:
        await wait_until(lambda: dead, timeout_s=5, what="w0 declared dead")
    finally:
        task.cancel()

    # Assert
    assert m.get("w0").state is WorkerState.DEAD


async def test_a_coordinator_pause_longer_than_the_timeout_declares_nobody_dead() -> None:
    # Arrange: a worker that heartbeats, and a sweep loop running.
    m, dead = Membership(TIMEOUT_S), []
    m.register("w0", "h:1", "cpu", "p0")
    task = asyncio.create_task(_detector(m, dead).run())
    await asyncio.sleep(0)  # the loop takes its first timestamp

    # Act: the whole process stops for 3 timeouts (the fault under test: a blocked event
    # loop, as a GC pause or CPU starvation makes it).
    before = m.get("w0").last_heartbeat
    time.sleep(3 * TIMEOUT_S)  # noqa: ASYNC251  (blocking on purpose: the pause itself)
    try:
        await wait_until(
            lambda: m.get("w0").last_heartbeat > before, timeout_s=5, what="silence excused"
        )
    finally:
        task.cancel()

    # Assert: the first sweep after the pause excused the silence instead of convicting.
    assert dead == []
    assert m.get("w0").state is WorkerState.ALIVE
