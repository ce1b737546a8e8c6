"""Forget a dead worker that will never return (``neuroshard forget-worker``).

While a slot's only trusted copies are on dead workers, the rebalancer keeps the slot with
them (``slot_map.plan(keep_lost=True)``): the slot is unavailable until one comes back with
its data dir, rather than restarted empty. An operator who knows a worker is gone for good
forgets it: the coordinator stops trusting every copy it held and drops it from the registry
(memory and SQLite), and the next rebalance re-creates empty, on live workers, each slot of
which it held the last trusted copy. Its slots with another trusted copy (on a live worker,
or on another dead worker that may still return) keep that copy.

What is lost is counted from the worker's last heartbeat to this coordinator process, which
reports the memories of each slot it held (``WorkerRecord.slot_memories``): writes after that
heartbeat are not counted, and after a coordinator restart with no heartbeat since, the count
is unknown.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass

from coordinator.events import EventLog
from coordinator.persistence import StateStore
from coordinator.placement.membership import Membership, WorkerState
from coordinator.placement.rebalance import Rebalancer
from coordinator.placement.slot_map import SlotMap
from shared.logging import get_logger

log = get_logger(__name__)


class WorkerUnknown(KeyError):
    """No worker of that name is registered (NOT_FOUND)."""

    def __str__(self) -> str:
        """The message itself, not KeyError's quoted repr of it."""
        return str(self.args[0])


class WorkerNotDead(RuntimeError):
    """The worker is ALIVE or DRAINING: it still serves its slots (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class ForgetReport:
    """What forgetting a worker loses (or lost).

    Attributes:
        worker: the worker's name.
        lost_slots: slots of which it held the last trusted copy, ascending: re-created
            empty on live workers.
        lost_memories: their memories as its last heartbeat reported them; None when it sent
            no heartbeat to this coordinator process (unknown).
        slots_kept: its slots that keep another trusted copy.
        forgotten: the worker was forgotten (False: a dry run, nothing changed).
    """

    worker: str
    lost_slots: list[int]
    lost_memories: int | None
    slots_kept: int
    forgotten: bool


def sole_copies(
    current: SlotMap, untrusted: Mapping[str, Set[int]], name: str
) -> tuple[list[int], int]:
    """Split the slots where ``name`` holds a trusted copy by whether another one exists.

    Args:
        current: the published slot map.
        untrusted: worker -> slots whose copy there is not data (``SlotTrust.untrusted``).
        name: the worker to forget.

    Returns:
        (slots whose only trusted copy is ``name``'s, ascending; how many of its slots keep
        a trusted copy on another worker, live or dead).
    """
    lost: list[int] = []
    kept = 0
    for s, (p, r) in enumerate(zip(current.primary, current.replica, strict=True)):
        if name not in (p, r) or s in untrusted.get(name, ()):
            continue
        others = [h for h in (p, r) if h and h != name and s not in untrusted.get(h, ())]
        if others:
            kept += 1
        else:
            lost.append(s)
    return lost, kept


def count_lost(slot_memories: Mapping[int, int] | None, slots: list[int]) -> int | None:
    """Memories of ``slots`` by a worker's last per-slot report; None when it sent none."""
    if slot_memories is None:
        return None
    return sum(slot_memories.get(s, 0) for s in slots)


def forget_worker(
    name: str,
    confirm: bool,
    membership: Membership,
    rebalancer: Rebalancer,
    state: StateStore,
    events: EventLog | None = None,
) -> ForgetReport:
    """Report what forgetting DEAD worker ``name`` loses; with ``confirm``, forget it.

    Forgetting distrusts every copy it held (saved with the slot map), drops it from the
    registry and the coordinator's database, and triggers a rebalance that re-creates its
    sole copies empty on live workers (asynchronously: ``neuroshard status`` shows the
    under-replicated slots return to 0). Synchronous code: no other coroutine runs between
    the count and the change.

    Args:
        name: the worker's name.
        confirm: False for a dry run (nothing changes).
        membership: the registry.
        rebalancer: owner of the slot map and the trust of copies.
        state: the coordinator's database.
        events: where the forgetting is told to people (the dashboard), if anywhere.

    Raises:
        WorkerUnknown: no worker of that name (NOT_FOUND).
        WorkerNotDead: it is ALIVE or DRAINING (FAILED_PRECONDITION).
    """
    rec = membership.get(name)
    if rec is None:
        raise WorkerUnknown(f"no worker named {name!r}")
    if rec.state is not WorkerState.DEAD:
        raise WorkerNotDead(
            f"worker {name!r} is {rec.state.value}: only a DEAD worker can be forgotten "
            "(stop it first, or drain it to hand its slots over)"
        )
    lost, kept = sole_copies(rebalancer.current, rebalancer.trust.untrusted, name)
    report = ForgetReport(name, lost, count_lost(rec.slot_memories, lost), kept, confirm)
    if not confirm:
        return report
    rebalancer.trust.unverified.discard(name)
    membership.remove(name)
    state.delete_worker(name)
    rebalancer.distrust(name)  # saves the trust with the map, then re-plans
    lost_memories = "unknown" if report.lost_memories is None else report.lost_memories
    log.warning(
        "worker_forgotten",
        worker=name,
        lost_slots=len(lost),
        lost_memories=lost_memories,
        slots_kept=kept,
    )
    if events is not None:
        events.add(
            "worker_forgotten",
            f"{name} forgotten: {len(lost)} slots re-created empty ({lost_memories} memories)",
            worker=name,
            slots=len(lost),
        )
    return report
