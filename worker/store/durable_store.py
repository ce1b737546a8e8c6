"""A worker's ``SlotStore`` with its one thread and its journal.

Every change of the store is applied, given its seqs and logged in one job of the store
thread. Store operations run on one dedicated thread, so they are applied in submission order and
never block the event loop. With a journal (``worker/store/journal.py``) each change (a primary's op
with its new seqs, a replica's applied forward, an imported or dropped slot) is appended in
the job that applies it, so log order is apply order; ``sync`` waits until a record is durable
(as the journal's fsync policy demands) before a write is acknowledged.

Shape letters: T slots an op touches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from shared.memory.tables import DEFAULT_TABLE
from shared.proto import worker_pb2
from worker.store.dedup import RecentRequests
from worker.store.journal import Journal
from worker.store.journal_format import Request, apply_op
from worker.store.store import SlotSnapshot, SlotStore
from worker.store.store_thread import StoreThread

__all__ = ["INLINE_WRITE_IDS", "DurableStore", "small_write"]

T = TypeVar("T")

# Keyed writes of at most this many ids (and a replica's forwards of them) are applied and
# logged on the event loop when the store thread is idle (``DurableStore.run_small``): a
# one-id upsert then costs no hand-off to the thread and back on the primary nor the replica.
INLINE_WRITE_IDS = 64


def small_write(op: str, request: Any) -> bool:
    """True for a keyed write light enough to run inline (``run_small``).

    Args:
        op: "upsert", "reinforce", "delete" (anything else, a decay: False).
        request: the op's request message; ``ids`` holds [N] uint64 little-endian.

    Returns:
        At most ``INLINE_WRITE_IDS`` ids and no payloads (whose size has no bound here).
    """
    if op not in ("upsert", "reinforce", "delete") or len(request.ids) > 8 * INLINE_WRITE_IDS:
        return False
    return op != "upsert" or not len(request.payloads)


class DurableStore:
    """A store, the thread that runs its operations, its journal and its recent request ids."""

    def __init__(
        self,
        store: SlotStore,
        journal: Journal | None = None,
        requests: list[Request] | None = None,
    ) -> None:
        """Start the store thread for a store and its journal.

        Args:
            store: the slot data (possibly reloaded from the journal).
            journal: logs every change; None keeps nothing on disk.
            requests: the request ids the journal replayed (with a store reloaded from it).
        """
        self.store = store
        self.journal = journal
        self.recent = RecentRequests()
        for rid, slots in requests or []:
            self.recent.record(rid, np.asarray(slots, np.int64))
        self._thread = StoreThread("store")
        # A change run inline (``run_small``) whose record made a snapshot due; and the
        # store-thread jobs queued to take it.
        self._snapshot_due = False
        self._background: set[asyncio.Future[None]] = set()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the store thread, after every job submitted before it."""
        return await self._thread.run(fn, *args)

    async def run_small(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a short ``fn(*args)`` now if the store thread is idle (``StoreThread.run_small``).

        ``fn`` may change the store and log it (a write of at most ``INLINE_WRITE_IDS`` ids):
        a snapshot its record makes due is not taken on the calling thread (it copies the
        whole store) but queued as the store thread's next job.
        """
        result = await self._thread.run_small(fn, *args)
        if self._snapshot_due:
            self._snapshot_due = False
            task = asyncio.ensure_future(self.run(self.settled))
            self._background.add(task)
            task.add_done_callback(_forget(self._background))
        return result

    async def sync(self, pos: int) -> None:
        """Wait until the journal holds everything up to ``pos`` (bytes) durably."""
        if self.journal is not None:
            await self.journal.sync(pos)

    async def sync_all(self) -> None:
        """Wait until everything logged so far is durable.

        An op applied by an earlier call is acknowledged only once its record is.
        """
        if self.journal is not None:
            await self.journal.sync(self.journal.written)

    def check_writable(self) -> None:
        """Refuse a change once the journal failed to write or fsync (it never recovers).

        Raises:
            StorageFailed: the journal failed (UNAVAILABLE).
        """
        if self.journal is not None:
            self.journal.check()

    def close(self) -> None:
        """Finish the running store job, then close the journal (fsync per its policy)."""
        self._thread.shutdown()
        if self.journal is not None:
            self.journal.close()

    def abandon(self) -> None:
        """Stop as ``kill -9`` would: no fsync, and queued store jobs dropped.

        The running store job finishes (a thread cannot be killed); the journal is abandoned.
        """
        self._thread.shutdown()
        if self.journal is not None:
            self.journal.abandon()

    # -- store thread -------------------------------------------------------------------------

    def commit(
        self,
        op: str,
        sub: Any,
        touched: np.ndarray,
        epoch: int,
        primary: str,
        applied: bool = True,
    ) -> tuple[np.ndarray, int]:
        """On the store thread, right after a primary applied an op: next seqs, log record.

        Args:
            op: the op's name ("upsert", "reinforce", "delete", "decay").
            sub: its request message.
            touched: [T] int64 distinct slots, ascending; each takes its next seq.
            epoch: the slot-map epoch the op was applied at.
            primary: this worker's name.
            applied: False when the op is applied after its record, in the same store job
                (it must not fail then): no snapshot may be taken before it is, so the caller
                calls ``settled`` once it is.

        Returns:
            ([T] uint64 the seq each slot took, the journal position to sync to).
        """
        seqs = self.store.bump_seq(touched)
        if self.journal is None or not len(touched):
            return seqs, 0
        req = worker_pb2.ReplicateRequest(
            primary=primary,
            epoch=epoch,
            slots=touched.tolist(),
            seqs=seqs.tolist(),
            **{op: sub},
        )
        pos = self.journal.log_op(req)
        if not applied:
            self.journal.kick(pos)
            return seqs, pos
        return seqs, self._logged(pos)

    def settled(self) -> None:
        """On the store thread, once an op committed with ``applied=False`` is applied."""
        if self.journal is not None:
            self.journal.maybe_snapshot(self.store, self.recent.entries)

    def apply_forward(self, req: worker_pb2.ReplicateRequest, slots: np.ndarray) -> int:
        """On the store thread: apply a primary's forward; return the journal position.

        The forward's slots take their next seq and its request id is recorded.

        Args:
            req: the forward, checked by ``check_forward``.
            slots: [T] int64 its slots.
        """
        op = req.WhichOneof("op")
        assert op is not None  # check_forward refused a forward without one
        self.check_writable()
        rid = apply_op(self.store, op, getattr(req, op), slots)
        self.store.bump_seq(slots)
        self.recent.record(rid, slots)
        return self._logged(self.journal.log_op(req)) if self.journal is not None else 0

    def drop(self, slots: np.ndarray) -> None:
        """On the store thread: drop the data of ``slots`` ([K] int64) and log it."""
        self.store.drop_slots(slots)
        if self.journal is not None:
            self._logged(self.journal.log_drop(slots))

    def export(self, slots: list[int], table: str | None = None) -> list[SlotSnapshot]:
        """On the store thread: copy out ``slots`` with the request ids each applied.

        Args:
            slots: the slots.
            table: None: every table's part of each slot (a whole-slot copy, the default
                table's part first, carrying the request ids); else only that table's.
        """
        if table is not None:
            return [self.store.export_slot(s, table) for s in slots]
        snaps = [part for s in slots for part in self.store.export_slot_parts(s)]
        requests = self.recent.of_slots([int(snap.slot) for snap in snaps])
        for snap in snaps:
            if snap.table == DEFAULT_TABLE:
                snap.requests = requests[int(snap.slot)]
        return snaps

    def import_slots(self, snaps: list[SlotSnapshot]) -> int:
        """On the store thread: install copied slots and log them; return the journal position.

        The parts of a slot replace everything held for it, in every table, its request ids
        included (those of its default table's part; a slot copied without one takes an
        empty default part).
        """
        pos = 0
        snaps = _whole_slots(snaps)
        self.store.import_slots(snaps)  # one merge for the whole batch of slots
        self.recent.replace_slots(
            {int(snap.slot): snap.requests for snap in snaps if snap.table == DEFAULT_TABLE}
        )
        if self.journal is not None:
            for snap in snaps:
                pos = self._logged(self.journal.log_import(snap))
        return pos

    def adopt_table(self, name: str, table_id: int) -> None:
        """On the store thread: adopt a table's incarnation id (``SlotStore.adopt_table``)."""
        if self.store.tables().get(name) == table_id:
            return
        self.store.adopt_table(name, table_id)
        if self.journal is not None:
            self._logged(self.journal.log_table(name, table_id))

    def drop_table(self, name: str) -> None:
        """On the store thread: forget a table the slot map no longer lists, logged."""
        self.store.drop_table(name)
        if self.journal is not None:
            self._logged(self.journal.log_drop_table(name))

    def _logged(self, pos: int) -> int:
        """After a journal append: start its fsync, snapshot if the log grew too long.

        The fsync starts here, on the store thread (or inline, ``run_small``), so it runs
        while the event loop forwards the write (``Journal.kick``); returns ``pos``.
        """
        if self.journal is not None:
            self.journal.kick(pos)
            if self._thread.inline:  # run_small: the snapshot is the thread's next job
                self._snapshot_due = self.journal.snapshot_due()
            else:
                self.journal.maybe_snapshot(self.store, self.recent.entries)
        return pos


def _forget(tasks: set[asyncio.Future[None]]) -> Callable[[asyncio.Future[None]], None]:
    """A done callback dropping a background job from ``tasks``, its error seen.

    A snapshot that fails marks the journal failed and logs it (``Journal._fail``); the
    writes after it are refused, so nothing is left to report here.
    """

    def done(task: asyncio.Future[None]) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()

    return done


def _whole_slots(snaps: list[SlotSnapshot]) -> list[SlotSnapshot]:
    """The parts of copied slots, each slot's default-table part first (made empty if none).

    The journal logs them in this order: replaying the default part replaces the whole
    slot, each later part only its table's.
    """
    by_slot: dict[int, list[SlotSnapshot]] = {}
    for snap in snaps:
        by_slot.setdefault(int(snap.slot), []).append(snap)
    out = []
    for slot, parts in by_slot.items():
        default = [p for p in parts if p.table == DEFAULT_TABLE]
        if not default:
            empty = np.zeros(0, np.uint64)
            default = [SlotSnapshot(slot, parts[0].seq, empty, np.zeros(0, np.float32))]
        out += default[-1:] + [p for p in parts if p.table != DEFAULT_TABLE]
    return out
