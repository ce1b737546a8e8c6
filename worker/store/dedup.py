"""De-duplication of client writes: which slots already applied each recent request id.

A client retries a write that failed or timed out, and the first attempt may have been applied
(here, and forwarded to the replica) before the failure. Every keyed write carries a
``request_id``; each slot that applies it is remembered, so a retry applies only to the slots
that have not (a retried reinforce must not add its boosts twice). Primaries record on apply,
replicas on applying the primary's forward, so a promoted replica knows the ids too; the
journal keeps the table in its snapshots (``worker/store/journal_format.py``). A slot copied to
another worker carries its ids (``of_slots``), and the copy replaces the ids the receiver held
for that slot (``replace_slot``): a copy made for a new replica or a new primary knows every
request its data already contains, so a retry that reaches it is not applied twice.
Decay op ids share the table.

A primary that applied a request but could not confirm it on every trusted copy (the forward
and the report to the coordinator both failed) also holds the request's unconfirmed forwards
here (``hold``), so a retry re-sends them instead of being acknowledged at once. They are
forgotten with the request id, or when confirmed (``confirm``); they are kept in memory only.

Shape letters: N items of a request, K slots.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from worker.store.journal_format import Request

__all__ = ["RecentRequests"]


class RecentRequests:
    """Which slots applied each recent client request id (an LRU of ``capacity`` ids).

    Read on the event loop (``fresh``) and written on the store thread (``record``), hence
    the lock.
    """

    def __init__(self, capacity: int = 8192) -> None:
        """Start with no request id recorded.

        Args:
            capacity: request ids remembered; the oldest is forgotten first.
        """
        self._capacity = capacity
        # request id -> the slots that applied it, least recently recorded id first. No
        # per-slot index: a write records hundreds of slots, and keeping one cost a Python
        # loop over them per write; a copy, which asks per slot (``of_slots``), scans the ids.
        self._slots: OrderedDict[bytes, set[int]] = OrderedDict()
        self._unconfirmed: dict[bytes, Any] = {}  # request id -> its unconfirmed forwards
        self._lock = threading.Lock()

    def fresh(self, rid: bytes, slots: np.ndarray) -> np.ndarray:
        """Return keep [N] bool: the items whose slot has not applied ``rid`` yet.

        Args:
            rid: the request id (empty: never seen, every item is fresh).
            slots: [N] int64 slot of each item of the request.
        """
        with self._lock:
            done = list(self._slots.get(rid, ())) if rid else []
        if not done:
            return np.ones(len(slots), bool)
        return ~np.isin(slots, np.asarray(done, np.int64))

    def record(self, rid: bytes, slots: np.ndarray) -> None:
        """Note that ``slots`` applied request ``rid`` (an empty ``rid`` is not recorded).

        Args:
            rid: the request id.
            slots: [K] int64 slots that applied it; repeats are harmless.
        """
        if not rid or len(slots) == 0:
            return
        with self._lock:
            self._record(rid, slots.tolist())

    def _record(self, rid: bytes, slots: list[int]) -> None:
        """``record`` with the lock held."""
        applied = self._slots.get(rid)
        if applied is None:
            self._slots[rid] = set(slots)
        else:
            applied.update(slots)
            self._slots.move_to_end(rid)
        while len(self._slots) > self._capacity:
            gone, _ = self._slots.popitem(last=False)
            self._unconfirmed.pop(gone, None)

    def of_slot(self, slot: int) -> list[bytes]:
        """Return the ids slot ``slot`` applied, least recently recorded first (a copy's)."""
        return self.of_slots([slot])[slot]

    def of_slots(self, slots: list[int]) -> dict[int, list[bytes]]:
        """Return, for each of ``slots``, the ids it applied, least recently recorded first.

        The order of this table's LRU, so a copy that records them in turn
        (``replace_slot``) forgets them in the same order as this worker. One scan of the
        ids for all the slots (a copy batch's).
        """
        found: dict[int, list[bytes]] = {s: [] for s in slots}
        wanted = set(found)
        for rid, applied in self._held():  # the scan without the lock: see ``_held``
            for s in applied & wanted:
                found[s].append(rid)
        return found

    def _held(self) -> list[tuple[bytes, set[int]]]:
        """The ids and their slot sets, least recently recorded first, taken under the lock.

        Only the store thread changes the sets (``record``, ``replace_slots``), and the
        scans over this list run on it too; so the event loop's ``fresh`` waits for the
        lock while the list is taken, not for the scan of thousands of ids.
        """
        with self._lock:
            return list(self._slots.items())

    def replace_slot(self, slot: int, rids: list[bytes]) -> None:
        """Make ``rids`` the ids slot ``slot`` applied: a copy of the slot was installed.

        The ids recorded for the slot before are forgotten for it: the copy's data is what
        the slot holds now, and it contains exactly the requests of ``rids``.
        """
        self.replace_slots({slot: rids})

    def replace_slots(self, copies: dict[int, list[bytes]]) -> None:
        """``replace_slot`` for several slots at once (one scan of the ids, a copy batch's).

        Args:
            copies: slot -> the ids its copy applied, least recently recorded first.
        """
        replaced = set(copies)
        hit = [(rid, a) for rid, a in self._held() if not a.isdisjoint(replaced)]
        with self._lock:
            for rid, applied in hit:
                applied.difference_update(replaced)
                if not applied and self._slots.get(rid) is applied:
                    del self._slots[rid]
                    self._unconfirmed.pop(rid, None)
            for slot, rids in copies.items():
                for rid in rids:
                    if rid:
                        self._record(rid, [slot])

    def hold(self, rid: bytes, forwards: Any) -> None:
        """Keep the forwards of applied request ``rid`` that no trusted copy confirmed yet.

        Args:
            rid: a request id this worker recorded (an empty or unknown one is not held).
            forwards: what a retry must re-send (``replication.Forwards``); empty: none.
        """
        with self._lock:
            if rid in self._slots and forwards:
                self._unconfirmed[rid] = forwards
            else:
                self._unconfirmed.pop(rid, None)

    def unconfirmed(self, rid: bytes) -> Any:
        """Return the forwards held for ``rid`` (``hold``), or None when it has none."""
        if not self._unconfirmed:  # the fast path: no write left unconfirmed
            return None
        with self._lock:
            return self._unconfirmed.get(rid)

    def confirm(self, rid: bytes) -> None:
        """Forget the unconfirmed forwards of ``rid``: every trusted copy has them now."""
        with self._lock:
            self._unconfirmed.pop(rid, None)

    def entries(self) -> list[Request]:
        """Return every (request id, sorted slots) held, oldest first (a journal snapshot's)."""
        with self._lock:
            return [(rid, sorted(slots)) for rid, slots in self._slots.items()]
