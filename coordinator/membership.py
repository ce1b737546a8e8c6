"""Worker membership: registration, heartbeats and failure detection.

A worker is ALIVE while its heartbeats arrive; one silent for ``heartbeat_timeout_s`` is DEAD,
and ALIVE again when it registers or heartbeats anew. Plain domain code: no gRPC, a clock
injected for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class WorkerState(StrEnum):
    """A worker's liveness as the coordinator sees it."""

    ALIVE = "ALIVE"
    DEAD = "DEAD"
    DRAINING = "DRAINING"


@dataclass
class WorkerRecord:
    """What the coordinator knows of one worker.

    Attributes:
        name: the worker's unique name (its identity across restarts).
        address: ``host:port`` its gRPC server listens on.
        device: where its memory kernels run, ``cpu`` or ``cuda[:N]``.
        train_device: where it trains models (torch), ``cpu`` or ``cuda[:N]``; a train job
            with ``device: auto`` trains on cuda only when every worker of the job has it.
        state: ALIVE, DEAD or DRAINING.
        last_heartbeat: ``clock()`` seconds of the last registration or heartbeat.
        registered_at: ``clock()`` seconds of the last registration.
        memories: memories it reported holding in its last heartbeat.
        incarnation: bumped on every registration of the name.
        process_id: the worker process's random id; a new one means a restart.
        slot_map_epoch: the slot-map epoch it last reported (heartbeat) or acknowledged
            (``ApplySlotMap``); 0 when unknown (just registered). The rebalancer re-sends the
            current map to live workers whose epoch differs.
        restored: loaded from the coordinator's saved registry and not yet heard from by this
            coordinator process; its copies count as unconfirmed until it registers or
            heartbeats (``Rebalancer._verify``).
        slot_memories: slot -> memories it held there (either role) at its last heartbeat,
            slots without a memory left out; None before its first heartbeat to this
            coordinator process (what forgetting it would lose is then unknown).
    """

    name: str
    address: str
    device: str
    train_device: str = "cpu"
    state: WorkerState = WorkerState.ALIVE
    last_heartbeat: float = 0.0
    registered_at: float = 0.0
    memories: int = 0
    incarnation: int = 0
    process_id: str = ""
    slot_map_epoch: int = 0
    restored: bool = False
    slot_memories: dict[int, int] | None = None


class Membership:
    """The registry of workers, keyed by name."""

    def __init__(
        self, heartbeat_timeout_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """An empty registry.

        Args:
            heartbeat_timeout_s: seconds without a heartbeat after which ``sweep`` declares a
                worker DEAD.
            clock: monotonic seconds (injected by tests).
        """
        self._timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._workers: dict[str, WorkerRecord] = {}

    def register(
        self, name: str, address: str, device: str, process_id: str = "", train_device: str = "cpu"
    ) -> tuple[WorkerRecord, bool, bool]:
        """Add or refresh a worker.

        Its slot-map epoch becomes unknown (0), and it is no longer ``restored``.

        Args:
            name: the worker's unique name.
            address: ``host:port`` of its gRPC server.
            device: its memory kernels' device, ``cpu`` or ``cuda[:N]``.
            process_id: the worker process's random id.
            train_device: its training device, ``cpu`` or ``cuda[:N]``.

        Returns:
            (record, changed, restarted): changed when its liveness or address changed;
            restarted when a known worker comes back as a new process (``process_id``).
        """
        now = self._clock()
        rec = self._workers.get(name)
        if rec is None:
            rec = WorkerRecord(
                name,
                address,
                device,
                train_device,
                last_heartbeat=now,
                registered_at=now,
                process_id=process_id,
            )
            self._workers[name] = rec
            return rec, True, False
        restarted = rec.process_id != process_id
        rec.process_id = process_id
        changed = restarted or rec.state is not WorkerState.ALIVE or rec.address != address
        rec.address, rec.device, rec.state = address, device, WorkerState.ALIVE
        rec.train_device = train_device
        rec.last_heartbeat, rec.registered_at = now, now
        rec.incarnation += 1
        rec.slot_map_epoch, rec.restored = 0, False
        return rec, changed, restarted

    def heartbeat(self, name: str, memories: int, epoch: int = 0) -> WorkerRecord | None:
        """Record a heartbeat; None when the worker is unknown or DEAD (it must re-register).

        Args:
            name: the worker's name.
            memories: memories it holds.
            epoch: the slot-map epoch it has applied.
        """
        rec = self._workers.get(name)
        if rec is None or rec.state is WorkerState.DEAD:
            return None
        rec.last_heartbeat = self._clock()
        rec.memories = memories
        rec.slot_map_epoch = epoch
        rec.restored = False  # the process that registered before is back
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

    def remove(self, name: str) -> WorkerRecord | None:
        """Forget a worker entirely (``coordinator/forget.py``); return its record, or None."""
        return self._workers.pop(name, None)

    def mark_dead(self, name: str) -> bool:
        """Declare a worker DEAD at once (e.g. its RPCs fail); True if it was not already."""
        rec = self._workers.get(name)
        if rec is None or rec.state is WorkerState.DEAD:
            return False
        rec.state = WorkerState.DEAD
        return True

    def set_draining(self, name: str) -> bool:
        """Mark an ALIVE worker DRAINING; True if its state changed.

        A draining worker serves until its slots are handed over.
        """
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
