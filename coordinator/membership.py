"""Worker membership: registration, heartbeats and failure detection.

A worker is ALIVE while its heartbeats arrive; one silent for ``heartbeat_timeout_s`` is DEAD,
and ALIVE again when it registers or heartbeats anew. Plain domain code: no gRPC, a clock
injected for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum


class WorkerState(StrEnum):
    ALIVE = "ALIVE"
    DEAD = "DEAD"
    DRAINING = "DRAINING"


@dataclass
class WorkerRecord:
    """What the coordinator knows of one worker."""

    name: str
    address: str
    device: str
    state: WorkerState = WorkerState.ALIVE
    last_heartbeat: float = 0.0  # clock() seconds
    registered_at: float = 0.0
    memories: int = 0
    incarnation: int = 0  # bumped on every registration
    process_id: str = ""  # the worker process's random id; a new one means a restart
    extra: dict[str, object] = field(default_factory=dict)


class Membership:
    """The registry of workers, keyed by name."""

    def __init__(self, heartbeat_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self._timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._workers: dict[str, WorkerRecord] = {}

    def register(
        self, name: str, address: str, device: str, process_id: str = ""
    ) -> tuple[WorkerRecord, bool, bool]:
        """Add or refresh a worker.

        Returns:
            (record, changed, restarted): changed when its liveness or address changed;
            restarted when a known worker comes back as a new process (``process_id``).
        """
        now = self._clock()
        rec = self._workers.get(name)
        if rec is None:
            rec = WorkerRecord(
                name, address, device, last_heartbeat=now, registered_at=now, process_id=process_id
            )
            self._workers[name] = rec
            return rec, True, False
        restarted = rec.process_id != process_id
        rec.process_id = process_id
        changed = restarted or rec.state is not WorkerState.ALIVE or rec.address != address
        rec.address, rec.device, rec.state = address, device, WorkerState.ALIVE
        rec.last_heartbeat, rec.registered_at = now, now
        rec.incarnation += 1
        return rec, changed, restarted

    def heartbeat(self, name: str, memories: int, epoch: int = 0) -> WorkerRecord | None:
        """Record a heartbeat; None when the worker is unknown or DEAD (it must re-register)."""
        rec = self._workers.get(name)
        if rec is None or rec.state is WorkerState.DEAD:
            return None
        rec.last_heartbeat = self._clock()
        rec.memories = memories
        rec.extra["epoch"] = epoch
        return rec

    def sweep(self) -> list[WorkerRecord]:
        """Mark workers silent for longer than the timeout DEAD; return the newly dead."""
        now = self._clock()
        dead = []
        for rec in self._workers.values():
            if rec.state is not WorkerState.DEAD and now - rec.last_heartbeat > self._timeout_s:
                rec.state = WorkerState.DEAD
                dead.append(rec)
        return dead

    def mark_dead(self, name: str) -> bool:
        """Declare a worker DEAD at once (e.g. its RPCs fail); True if it was not already."""
        rec = self._workers.get(name)
        if rec is None or rec.state is WorkerState.DEAD:
            return False
        rec.state = WorkerState.DEAD
        return True

    def set_draining(self, name: str) -> bool:
        """Mark an ALIVE worker DRAINING (it serves until its slots are handed over); True
        if its state changed."""
        rec = self._workers.get(name)
        if rec is None or rec.state is not WorkerState.ALIVE:
            return False
        rec.state = WorkerState.DRAINING
        return True

    def draining(self) -> list[WorkerRecord]:
        """DRAINING workers, ordered by name."""
        return sorted(
            (w for w in self._workers.values() if w.state is WorkerState.DRAINING),
            key=lambda w: w.name,
        )

    def get(self, name: str) -> WorkerRecord | None:
        """The record of ``name``, or None."""
        return self._workers.get(name)

    def alive(self) -> list[WorkerRecord]:
        """ALIVE workers, ordered by name."""
        return sorted(
            (w for w in self._workers.values() if w.state is WorkerState.ALIVE),
            key=lambda w: w.name,
        )

    def all(self) -> list[WorkerRecord]:
        """Every known worker, ordered by name."""
        return sorted(self._workers.values(), key=lambda w: w.name)

    def heartbeat_age_s(self, rec: WorkerRecord) -> float:
        """Seconds since the worker's last heartbeat."""
        return max(0.0, self._clock() - rec.last_heartbeat)

    def counts(self) -> dict[str, int]:
        """Number of workers per state (every state present, zeros included)."""
        out = {s.value: 0 for s in WorkerState}
        for w in self._workers.values():
            out[w.state.value] += 1
        return out
