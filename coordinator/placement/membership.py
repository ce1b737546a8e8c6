"""Worker membership: registration, heartbeats and failure detection.

A worker is ALIVE while its heartbeats arrive; one silent for ``heartbeat_timeout_s`` is DEAD,
and ALIVE again when it registers anew. A DEAD worker is held down before it may register
again: for ``holddown_base_s`` after its first death, twice as long after each death within
``holddown_max_s`` of its last admission and after each failed readmission check, at most
``holddown_max_s``; one that stayed ALIVE ``holddown_max_s`` starts again from the base. A
worker whose own heartbeats reach the coordinator while nobody reaches it (an asymmetric
partition) would otherwise rejoin and die again at every failed copy, each time a new map
epoch (route-flap damping, RFC 2439; SWIM's suspicion and Consul's quarantine of flapping
members do the same). Plain domain code: no gRPC, a clock injected for tests.
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
        holddown_s: the length of its last hold-down, seconds; 0 before its first death.
        readmit_at: ``clock()`` seconds before which it is not admitted again while DEAD.
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
    holddown_s: float = 0.0
    readmit_at: float = 0.0


class Membership:
    """The registry of workers, keyed by name."""

    def __init__(
        self,
        heartbeat_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        holddown_base_s: float = 0.0,
        holddown_max_s: float = 0.0,
    ) -> None:
        """An empty registry.

        Args:
            heartbeat_timeout_s: seconds without a heartbeat after which ``sweep`` declares a
                worker DEAD.
            clock: monotonic seconds (injected by tests).
            holddown_base_s: first hold-down of a DEAD worker, seconds (module docstring).
            holddown_max_s: longest hold-down, seconds, and how long a worker must stay
                ALIVE for its next hold-down to start from the base again; 0: none.
        """
        self._timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._holddown_max_s = holddown_max_s
        self._holddown_base_s = min(holddown_base_s, holddown_max_s)
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
                self._declare_dead(rec, now)
                dead.append(rec)
        return dead

    def remove(self, name: str) -> WorkerRecord | None:
        """Forget a worker entirely (``coordinator/forget.py``); return its record, or None."""
        return self._workers.pop(name, None)

    def excuse_silence(self) -> None:
        """Count every live worker as heard from now: the coordinator itself was paused.

        Heartbeats that arrived while this process did not run are no evidence against a
        worker (``FailureDetector.run``).
        """
        now = self._clock()
        for rec in self._workers.values():
            if rec.state is not WorkerState.DEAD:
                rec.last_heartbeat = max(rec.last_heartbeat, now)

    def mark_dead(self, name: str) -> bool:
        """Declare a worker DEAD at once (e.g. its RPCs fail); True if it was not already."""
        rec = self._workers.get(name)
        if rec is None or rec.state is WorkerState.DEAD:
            return False
        self._declare_dead(rec, self._clock())
        return True

    def _declare_dead(self, rec: WorkerRecord, now: float) -> None:
        """Mark ``rec`` DEAD and hold it down: longer when it died soon after its admission."""
        rec.state = WorkerState.DEAD
        flapping = rec.holddown_s > 0 and now - rec.registered_at < self._holddown_max_s
        self._hold_down(rec, now, double=flapping)

    def _hold_down(self, rec: WorkerRecord, now: float, double: bool) -> float:
        """Start a hold-down of ``rec``: twice the last one if ``double``, else the base."""
        length = min(2 * rec.holddown_s, self._holddown_max_s) if double else 0.0
        rec.holddown_s = max(length, self._holddown_base_s)
        rec.readmit_at = now + rec.holddown_s
        return rec.holddown_s

    def readmit_wait_s(self, name: str) -> float:
        """Seconds before DEAD worker ``name`` may be admitted again; 0 when it may.

        Also 0 for a worker that is not DEAD, or unknown.
        """
        rec = self._workers.get(name)
        if rec is None or rec.state is not WorkerState.DEAD:
            return 0.0
        return max(0.0, rec.readmit_at - self._clock())

    def readmit_refused(self, name: str) -> float:
        """A DEAD worker failed its readmission check: double its hold-down; return it, s.

        Returns 0 when ``name`` is unknown or not DEAD.
        """
        rec = self._workers.get(name)
        if rec is None or rec.state is not WorkerState.DEAD:
            return 0.0
        return self._hold_down(rec, self._clock(), double=rec.holddown_s > 0)

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
