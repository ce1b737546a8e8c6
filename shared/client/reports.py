"""Reports of unreachable workers, from a client's router to the coordinator.

A part of a batch that a worker did not answer (UNAVAILABLE, DEADLINE_EXCEEDED) makes the
router report that worker; the coordinator probes it at once and fails it over if the probe
fails too, instead of waiting for its heartbeat timeout. Reports run in the background
(the retry does not wait for them), at most one per worker every ``REPORT_EVERY_S``, and a
report that fails changes nothing: the heartbeat timeout still catches a dead worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeAlias

from grpc import aio

# Tells the coordinator a worker could not be reached: (worker name, why)
Reporter: TypeAlias = Callable[[str, str], Awaitable[object]]

# The least time between two reports of one worker by one client, seconds
REPORT_EVERY_S = 0.25


class FailureReports:
    """Sends a router's reports of unreachable workers, rate-limited, in the background."""

    def __init__(self, report: Reporter | None) -> None:
        """Report with ``report``; None reports nothing."""
        self._report = report
        self._last: dict[str, float] = {}  # worker -> monotonic time of its last report
        self._tasks: set[asyncio.Task[None]] = set()

    def suspect(self, worker: str, reason: str) -> None:
        """Report ``worker`` unless it was reported less than ``REPORT_EVERY_S`` ago.

        Args:
            worker: the worker's name in the slot map.
            reason: the failed call's status, for the coordinator's log.
        """
        now = time.monotonic()
        if self._report is None or now - self._last.get(worker, -1e9) < REPORT_EVERY_S:
            return
        self._last[worker] = now
        report = self._report

        async def send() -> None:
            with contextlib.suppress(aio.AioRpcError):
                await report(worker, f"a client could not reach it: {reason}")

        task = asyncio.get_running_loop().create_task(send())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel(self) -> None:
        """Drop the reports still in flight (the client is closing)."""
        for task in list(self._tasks):
            task.cancel()
