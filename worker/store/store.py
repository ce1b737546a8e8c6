"""SlotStore: one worker's memories for the slots it holds, one ``TableStore`` per table.

A table (``shared/memory/tables.py``) is its own set of slot rows (``worker/store/
table_store.py``): ids are per table, and whatever is kept per (table, slot) lives in the
table's store. The sequence number of a slot belongs to the slot, not a table: a slot's one
stream of mutations (``worker/memory/replication.py``) orders the writes of every table, and a
slot copy (``export_slot_parts``) carries every table's part of it. The replication layer
owns the seqs; the store only keeps them and carries them through export and import.

Every method takes the table it works on (``table``, default ``DEFAULT_TABLE``); a table
that holds nothing here yet is made on first use. Tables are dropped only by ``drop_table``
(a table the slot map no longer lists) and reset by ``adopt_table`` (one re-created under the
same name: another incarnation id).

Shape letters: N memories held, K batch items, S slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.memory.slots import sort_key
from shared.memory.stats import Quality
from shared.memory.tables import DEFAULT_TABLE
from shared.memory.validation import MemoryInputError, as_slots
from shared.proto import worker_pb2
from worker.store import kernels
from worker.store.sampling import SlotWeights
from worker.store.slot_rows import SlotRows
from worker.store.table_store import SlotPart, TableStore, distinct_in_order, distinct_slots

__all__ = ["SlotSnapshot", "SlotStore", "distinct_in_order"]

Slots = Sequence[int] | np.ndarray | None


@dataclass
class SlotSnapshot:
    """One table's part of one slot, as carried by export/import (migration, re-replication).

    A whole slot is the parts of every table holding memories in it, the default table's
    first and always present (``SlotStore.export_slot_parts``).

    Attributes:
        slot: slot number.
        seq: the slot's sequence number at the copy.
        ids: [n] uint64 host, in key order.
        strengths: [n] float32 host.
        payloads: id -> payload for the ids that have one.
        requests: the recent client request ids and decay op ids the slot applied
            (``worker/store/dedup.py``), oldest first, on the default table's part; the store
            itself keeps none.
        table: the table the part belongs to.
        stamps: id -> insert stamp, for the ids that have one (a capped table's).
    """

    slot: int
    seq: int
    ids: np.ndarray
    strengths: np.ndarray
    payloads: dict[int, bytes] = field(default_factory=dict)
    requests: list[bytes] = field(default_factory=list)
    table: str = DEFAULT_TABLE
    stamps: dict[int, int] = field(default_factory=dict)


class SlotStore:
    """Memories of the slots one worker holds, per table, and the slots' sequence numbers."""

    def __init__(
        self,
        slots: int = 1024,
        device: str = "cpu",
        max_payload_bytes: int = 4096,
        k_max: int = 10000,
    ) -> None:
        """Make an empty store (holding the default table, empty).

        Args:
            slots: number of hash slots S of the cluster, a power of two.
            device: "cpu", "cuda" or "auto" (see ``kernels.get_xp``).
            max_payload_bytes: largest payload of one memory, bytes (the cluster's; a table
                may have a smaller limit, passed with each upsert).
            k_max: largest k a top-k request may ask for.
        """
        sort_key(np.empty(0, np.uint64), slots)  # validates slots
        self.slots = slots
        self.xp, self.device = kernels.get_xp(device)
        self._max_payload_bytes = max_payload_bytes
        self.k_max = k_max
        self._tables: dict[str, TableStore] = {}
        self._ids: dict[str, int] = {}  # table -> incarnation id (0: not known yet)
        self.seq = np.zeros(slots, np.uint64)
        self.table(DEFAULT_TABLE)

    def __len__(self) -> int:
        """Memories held, in every table."""
        return sum(len(t) for t in self._tables.values())

    @property
    def max_payload_bytes(self) -> int:
        """The cluster's payload limit, bytes: what a copy or a replayed write may carry."""
        return self._max_payload_bytes

    @max_payload_bytes.setter
    def max_payload_bytes(self, value: int) -> None:
        self._max_payload_bytes = value
        for t in self._tables.values():
            t.max_payload_bytes = value

    # --- tables ----------------------------------------------------------------------------

    def table(self, name: str) -> TableStore:
        """Return a table's store, made empty on first use."""
        t = self._tables.get(name)
        if t is None:
            t = self._tables[name] = TableStore(
                self.slots, self.xp, self._max_payload_bytes, self.k_max
            )
            self._ids.setdefault(name, 0)
        return t

    def tables(self) -> dict[str, int]:
        """Return the tables held here (the default one included) and their incarnation ids."""
        return dict(self._ids)

    def adopt_table(self, name: str, table_id: int) -> bool:
        """Take a table's incarnation id from the slot map; forget its memories if another.

        A table held under id 0 (made by a forward or a copy before the map that created it
        arrived) takes the id and keeps its memories.

        Returns:
            True when memories of an older incarnation were forgotten.
        """
        held = self._ids.get(name, 0)
        reset = held not in (0, table_id)
        if reset:
            del self._tables[name]
        self.table(name)
        self._ids[name] = table_id
        return reset

    def drop_table(self, name: str) -> int:
        """Forget a table and its memories (not the default one); return the count dropped."""
        if name == DEFAULT_TABLE or name not in self._tables:
            return 0
        self._ids.pop(name, None)
        return len(self._tables.pop(name))

    # --- rows of the default table (diagnostics, tests) -----------------------------------

    @property
    def ids(self) -> np.ndarray:
        """The default table's [C] uint64 host row buffer of ids (``TableStore.ids``)."""
        return self.table(DEFAULT_TABLE).ids

    @property
    def strength(self) -> Any:
        """The default table's [C] float32 row buffer of strengths on the kernel device."""
        return self.table(DEFAULT_TABLE).strength

    @property
    def payloads(self) -> dict[int, bytes]:
        """The default table's payloads, id -> bytes."""
        return self.table(DEFAULT_TABLE).payloads

    @property
    def _rows(self) -> SlotRows:
        return self.table(DEFAULT_TABLE)._rows

    # --- mutations -------------------------------------------------------------------------

    def upsert(
        self,
        ids: np.ndarray,
        strengths: np.ndarray,
        payloads: Sequence[bytes | None] | None = None,
        existing_only: bool = False,
        table: str = DEFAULT_TABLE,
        max_payload_bytes: int | None = None,
        stamps: np.ndarray | None = None,
    ) -> int:
        """Insert or overwrite memories of a table (``TableStore.upsert``).

        Raises:
            MemoryInputError: bad input (INVALID_ARGUMENT); nothing is applied.
        """
        return self.table(table).upsert(
            ids, strengths, payloads, max_payload_bytes, stamps, existing_only
        )

    def delete(self, ids: np.ndarray, table: str = DEFAULT_TABLE) -> int:
        """Delete memories of a table by id (``TableStore.delete``)."""
        return self.table(table).delete(ids)

    def reinforce(self, ids: np.ndarray, boosts: np.ndarray, table: str = DEFAULT_TABLE) -> int:
        """Add boosts to present memories of a table (``TableStore.reinforce``)."""
        return self.table(table).reinforce(ids, boosts)

    def decay(
        self,
        rate: float,
        slots: Slots = None,
        table: str = DEFAULT_TABLE,
        forget_below: float | None = None,
    ) -> int:
        """Decay the memories of a table's slot set (``TableStore.decay``, forgetting)."""
        return self.table(table).decay(rate, slots, forget_below)

    # --- queries ---------------------------------------------------------------------------

    def get(
        self, ids: np.ndarray, with_payloads: bool = True, table: str = DEFAULT_TABLE
    ) -> tuple[np.ndarray, np.ndarray, list[bytes | None]]:
        """Look memories of a table up by id (``TableStore.get``)."""
        return self.table(table).get(ids, with_payloads)

    def get_reply(
        self,
        ids: np.ndarray,
        with_payloads: bool,
        max_bytes: int | None,
        table: str = DEFAULT_TABLE,
    ) -> worker_pb2.GetResponse:
        """Answer a Get of a table (``TableStore.get_reply``)."""
        return self.table(table).get_reply(ids, with_payloads, max_bytes)

    def quality(self, slots: Slots = None, table: str = DEFAULT_TABLE) -> Quality:
        """Summarize the strengths of a table's slot set (``TableStore.quality``)."""
        return self.table(table).quality(slots)

    def topk(
        self, k: int, slots: Slots = None, table: str = DEFAULT_TABLE
    ) -> tuple[np.ndarray, np.ndarray]:
        """Return the local top-k of a table's slot set (``TableStore.topk``)."""
        return self.table(table).topk(k, slots)

    def sweep(
        self,
        rate: float | None,
        slots: Slots,
        k: int,
        want_quality: bool,
        decay_slots: Slots = None,
        table: str = DEFAULT_TABLE,
        forget_below: float | None = None,
    ) -> tuple[Quality | None, tuple[np.ndarray, np.ndarray] | None]:
        """Decay, summarize and take the top-k of a table's slot set (``TableStore.sweep``)."""
        return self.table(table).sweep(rate, slots, k, want_quality, decay_slots, forget_below)

    @property
    def sampling(self) -> SlotWeights:
        """The default table's per-slot sampling weights (``TableStore.sampling``)."""
        return self.table(DEFAULT_TABLE).sampling

    def sample_sums(
        self, alpha: float | None, slots: np.ndarray, table: str = DEFAULT_TABLE
    ) -> tuple[int, np.ndarray, int]:
        """Phase 1 of a sample of a table (``TableStore.sample_sums``)."""
        return self.table(table).sample_sums(alpha, slots)

    def sample_pick(
        self,
        version: int,
        slots: np.ndarray,
        offsets: np.ndarray,
        with_payloads: bool,
        table: str = DEFAULT_TABLE,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[bytes], np.ndarray]:
        """Phase 2 of a sample of a table (``TableStore.sample_pick``)."""
        return self.table(table).sample_pick(version, slots, offsets, with_payloads)

    def candidates(
        self, k: int, order: str, slots: Slots = None, table: str = DEFAULT_TABLE
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Return a table's first k memories to evict and its count (``TableStore.candidates``)."""
        return self.table(table).candidates(k, order, slots)

    def count(self, slots: Slots = None, table: str | None = None) -> int:
        """Return the number of memories in a slot set (None: all) of a table (None: all)."""
        chosen = [self.table(table)] if table is not None else self._tables.values()
        return sum(t.count(slots) for t in chosen)

    def slot_counts(self, table: str | None = None) -> np.ndarray:
        """Return [S] int64 memories per slot, of one table or (None) of all."""
        if table is not None:
            return self.table(table).slot_counts()
        counts = np.zeros(self.slots, np.int64)
        for t in self._tables.values():
            counts += t.slot_counts()
        return counts

    def held_slots(self) -> np.ndarray:
        """Return the slots holding at least one memory (in any table), ascending, int64."""
        return np.flatnonzero(self.slot_counts())

    def items(self, table: str = DEFAULT_TABLE) -> tuple[np.ndarray, np.ndarray]:
        """Return a table's ``(ids [N] uint64, strengths [N] float32)`` on host, by id."""
        return self.table(table).items()

    def rows(self, table: str = DEFAULT_TABLE) -> tuple[np.ndarray, np.ndarray]:
        """Return a table's ``(ids [N], strengths [N])`` host copies: what a snapshot saves."""
        return self.table(table).rows()

    def load(
        self,
        ids: np.ndarray,
        strengths: np.ndarray,
        payloads: dict[int, bytes],
        seq: np.ndarray,
        table: str = DEFAULT_TABLE,
        table_id: int = 0,
        stamps: dict[int, int] | None = None,
    ) -> None:
        """Fill an empty table with memories (in any order) and their payloads; set the seqs.

        Args:
            ids: [N] uint64, distinct.
            strengths: [N] float32 in [0, 1] (not checked: a snapshot of this store's).
            payloads: id -> payload, for ids among ``ids``.
            seq: [S] uint64 sequence number of every slot.
            table: the table filled.
            table_id: its incarnation id.
            stamps: id -> insert stamp, for ids among ``ids``.

        Raises:
            MemoryInputError: the table is not empty, seq has the wrong length, or ids repeat.
        """
        if len(seq) != self.slots:
            raise MemoryInputError(f"seq: {len(seq)} entries for {self.slots} slots")
        self.table(table).load(ids, strengths, payloads, stamps)
        self._ids[table] = table_id
        self.seq = np.asarray(seq, np.uint64).copy()

    # --- slots: sequence numbers, export, import -------------------------------------------

    def bump_seq(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """Advance the sequence number of each distinct slot by one.

        Returns:
            [len(slots)] uint64, the new sequence number of each slot as given.
        """
        chosen = as_slots(slots, self.slots)
        self.seq[distinct_slots(chosen)] += np.uint64(1)
        seqs: np.ndarray = self.seq[chosen].copy()
        return seqs

    def export_slot(self, slot: int, table: str = DEFAULT_TABLE) -> SlotSnapshot:
        """Copy out one table's part of a slot: memories in key order, payloads, seq (host)."""
        slot = int(as_slots([slot], self.slots)[0])
        ids, strengths, payloads, stamps = self.table(table).export_slot(slot)
        seq = int(self.seq[slot])
        return SlotSnapshot(slot, seq, ids, strengths, payloads, table=table, stamps=stamps)

    def export_slot_parts(self, slot: int) -> list[SlotSnapshot]:
        """Copy out a whole slot: the default table's part, then each other table's, by name.

        Tables other than the default one are left out where they hold nothing in the slot.
        """
        slot = int(as_slots([slot], self.slots)[0])
        parts = [self.export_slot(slot)]
        for name in sorted(self._tables):
            if name != DEFAULT_TABLE and self._tables[name].slot_counts()[slot]:
                parts.append(self.export_slot(slot, name))
        return parts

    def import_slot(self, snapshot: SlotSnapshot) -> None:
        """Replace whatever this store held for the snapshot's slot, and take its seq.

        Raises:
            MemoryInputError: as ``import_slots``.
        """
        self.import_slots([snapshot])

    def import_slots(self, snapshots: Sequence[SlotSnapshot], whole_slots: bool = True) -> None:
        """Install copied slot parts: O(K) for K memories imported; take their slots' seqs.

        Every part is validated before anything changes; a (table, slot) given twice takes
        the last part.

        Args:
            snapshots: the parts.
            whole_slots: the parts are whole slots: each replaces everything held for its
                slot, in every table. False: each replaces only its (table, slot) (a log
                replaying a copy part by part, the default table's part first).

        Raises:
            MemoryInputError: an id belongs to another slot or repeats, a strength is out of
                range, or a payload is too big or names an id not in the snapshot
                (INVALID_ARGUMENT); nothing is changed.
        """
        last = {(s.table, int(s.slot)): s for s in snapshots}
        checked: dict[str, dict[int, SlotPart]] = {}
        for (name, _), s in last.items():
            slot = int(as_slots([s.slot], self.slots, name="snapshot.slot")[0])
            part = self.table(name).validate_part(slot, s.ids, s.strengths, s.payloads, s.stamps)
            checked.setdefault(name, {})[slot] = part
        if not last:
            return
        if whole_slots:
            slots = np.unique(np.fromiter((k[1] for k in last), np.int64, len(last)))
            for t in self._tables.values():
                t.clear_slots(slots)
        for name, parts in checked.items():
            self.table(name).install(parts)
        for s in last.values():
            self.seq[int(s.slot)] = np.uint64(s.seq)

    def drop_slots(self, slots: Sequence[int] | np.ndarray) -> int:
        """Forget the memories of some slots in every table and reset their seq to 0.

        Returns:
            The count of memories dropped.
        """
        chosen = np.unique(as_slots(slots, self.slots))
        dropped = sum(t.drop_slots(chosen) for t in self._tables.values())
        self.seq[chosen] = np.uint64(0)
        return dropped
