"""A small bounded ring of cluster events for people to read (the dashboard's event log).

Fed at the points that already log them: workers joining, dying and draining, replicas
promoted, copies made, jobs submitted, started and ended. Nothing reads it back to decide
anything; it only tells.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any


class EventLog:
    """The last ``capacity`` events, oldest first, each with a sequence number and a time."""

    def __init__(self, capacity: int = 200, clock: Callable[[], float] = time.time) -> None:
        """An empty ring.

        Args:
            capacity: events kept; older ones are forgotten.
            clock: wall-clock seconds (injected by tests).
        """
        self._ring: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._seq = itertools.count(1)
        self._clock = clock

    def add(self, kind: str, message: str, **fields: Any) -> None:
        """Record one event.

        Args:
            kind: a snake_case name, e.g. ``worker_dead``, ``job_started``.
            message: one line for people, e.g. ``worker-1 died``.
            **fields: JSON-serializable details (worker, job_id, slots, ...).
        """
        self._ring.append(
            {"seq": next(self._seq), "time": self._clock(), "kind": kind, "message": message}
            | fields
        )

    @property
    def capacity(self) -> int:
        """Events kept at most."""
        return self._ring.maxlen or 0

    @property
    def last_seq(self) -> int:
        """The sequence number of the newest event (0 before any): grows on every ``add``."""
        return int(self._ring[-1]["seq"]) if self._ring else 0

    def recent(self, n: int = 50) -> list[dict[str, Any]]:
        """The last ``n`` events, newest first."""
        return list(itertools.islice(reversed(self._ring), n))
