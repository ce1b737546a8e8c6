"""SlotStore: one worker's memories for the slots it holds.

Layout: rows sorted by ``sort_key(id)`` (see ``shared/memory/slots.py``), so every slot is one
contiguous segment and per-slot operations are slices. ``keys`` and ``ids`` stay on host
for ``np.searchsorted`` lookups; ``strength`` lives on the kernel device (NumPy or CuPy).
Payloads are sparse (most memories have none): a dict from id to bytes.

Every mutating method validates its whole input (``shared/memory/validation.py``) before
touching anything, so a refused batch changes nothing. Sequence numbers per slot belong to
the replication layer; the store only keeps them and carries them through export and import.

Shape letters: N memories held, K batch items, S slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from shared.memory.slots import slot_bounds, slot_of, sort_key
from shared.memory.stats import Quality
from shared.memory.validation import (
    MemoryInputError,
    as_ids,
    as_slots,
    validate_k,
    validate_rate,
    validate_reinforce,
    validate_upsert,
    validate_values,
)
from worker import kernels

__all__ = ["SlotSnapshot", "SlotStore"]


@dataclass
class SlotSnapshot:
    """The whole content of one slot, as carried by export/import (migration, re-replication).

    Attributes:
        slot: slot number.
        seq: the slot's sequence number at the copy.
        ids: [n] uint64 host, in key order.
        strengths: [n] float32 host.
        payloads: id -> payload for the ids that have one.
        requests: the recent client request ids and decay op ids the slot applied
            (``worker/dedup.py``), oldest first; the store itself keeps none.
    """

    slot: int
    seq: int
    ids: np.ndarray
    strengths: np.ndarray
    payloads: dict[int, bytes] = field(default_factory=dict)
    requests: list[bytes] = field(default_factory=list)


class SlotStore:
    """Memories of the slots one worker holds, sorted by slot key."""

    def __init__(
        self,
        slots: int = 1024,
        device: str = "cpu",
        max_payload_bytes: int = 4096,
        k_max: int = 10000,
    ) -> None:
        """Make an empty store.

        Args:
            slots: number of hash slots S of the cluster, a power of two.
            device: "cpu", "cuda" or "auto" (see ``kernels.get_xp``).
            max_payload_bytes: largest payload of one memory, bytes.
            k_max: largest k a top-k request may ask for.
        """
        sort_key(np.empty(0, np.uint64), slots)  # validates slots
        self.slots = slots
        self.xp, self.device = kernels.get_xp(device)
        self.max_payload_bytes = max_payload_bytes
        self.k_max = k_max
        self.keys = np.empty(0, np.uint64)
        self.ids = np.empty(0, np.uint64)
        self.strength = self.xp.empty(0, np.float32)
        self.payloads: dict[int, bytes] = {}
        self.seq = np.zeros(slots, np.uint64)

    def __len__(self) -> int:
        """Memories held."""
        return len(self.ids)

    # --- row bookkeeping -------------------------------------------------------------------

    def _locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(rows [K] int64, found [K] bool)`` of keys; rows are only valid where found."""
        rows = np.searchsorted(self.keys, keys)
        if len(self.keys) == 0:
            return rows, np.zeros(len(keys), bool)
        found = self.keys[np.minimum(rows, len(self.keys) - 1)] == keys
        found &= rows < len(self.keys)
        return rows, found

    def _insert(
        self, keys: np.ndarray, ids: np.ndarray, strengths: np.ndarray, at: np.ndarray | None
    ) -> None:
        """Merge new rows (keys sorted, none present yet) into the sorted arrays in O(N + K).

        Args:
            keys: [K] uint64 sort keys of the new rows, ascending.
            ids: [K] uint64 ids of the new rows.
            strengths: [K] float32 strengths of the new rows.
            at: [K] int64 ``np.searchsorted(self.keys, keys)`` when the caller has it.
        """
        if len(keys) == 0:
            return
        if at is None:
            at = np.searchsorted(self.keys, keys)
        self.keys = kernels.insert_rows(self.keys, keys, at)
        self.ids = kernels.insert_rows(self.ids, ids, at)
        self.strength = kernels.insert_rows(self.strength, strengths, at)

    def _remove(self, drop: np.ndarray) -> None:
        """Remove the rows where drop [N] bool is set, with their payloads."""
        if self.payloads:
            for i in self.ids[drop].tolist():
                self.payloads.pop(i, None)
        keep = ~drop
        self.keys, self.ids = self.keys[keep], self.ids[keep]
        self.strength = self.strength[self.xp.asarray(keep)]

    def _run_bounds(
        self, slots: Sequence[int] | np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(starts [R], ends [R])`` int64: the non-empty row ranges of a slot set.

        None: all rows. Ascending, adjacent slots merged into one run.
        """
        if slots is None:
            n = len(self.ids)
            return np.array([0] if n else [], np.int64), np.array([n] if n else [], np.int64)
        chosen = np.unique(as_slots(slots, self.slots))
        bounds = slot_bounds(self.keys, self.slots)
        starts, ends = bounds[chosen], bounds[chosen + 1]
        nonempty = ends > starts
        starts, ends = starts[nonempty], ends[nonempty]
        if len(starts) == 0:
            return starts, ends
        first = np.ones(len(starts), bool)  # a run not continuing the previous one
        first[1:] = starts[1:] != ends[:-1]
        return starts[first], ends[np.append(first[1:], True)]

    def _runs(self, slots: Sequence[int] | np.ndarray | None) -> list[tuple[int, int]]:
        """Return the runs of :meth:`_run_bounds` as ``(start, end)`` pairs."""
        starts, ends = self._run_bounds(slots)
        return list(zip(starts.tolist(), ends.tolist(), strict=True))

    # --- mutations -------------------------------------------------------------------------

    def upsert(
        self,
        ids: np.ndarray,
        strengths: np.ndarray,
        payloads: Sequence[bytes | None] | None = None,
    ) -> int:
        """Insert or overwrite memories; within a batch the last occurrence of an id wins.

        Args:
            ids: [K] uint64.
            strengths: [K] float32 in [0, 1].
            payloads: None leaves payloads alone; else [K] bytes (b"" removes one; a None
                entry leaves that one alone), each at most ``max_payload_bytes``.

        Returns:
            Number of distinct ids written.

        Raises:
            MemoryInputError: bad input (INVALID_ARGUMENT); nothing is applied.
        """
        ids, strengths, checked = validate_upsert(ids, strengths, payloads, self.max_payload_bytes)
        # One sort by key (quicksort: 5x faster than a stable sort here) gives the distinct
        # keys in order for the lookup; an id's last occurrence in the batch is the largest
        # batch index among the items of its key.
        all_keys = sort_key(ids, self.slots)
        order = np.argsort(all_keys)
        sorted_keys = all_keys[order]
        first = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]][: len(order)])
        keys = sorted_keys[first]
        last = order if len(first) == len(order) else np.maximum.reduceat(order, first)
        rows, found = kernels.locate_sorted(self.keys, keys)
        if found.any():
            self.strength[self.xp.asarray(rows[found])] = self.xp.asarray(strengths[last[found]])
        new = ~found
        self._insert(keys[new], ids[last[new]], strengths[last[new]], rows[new])
        if checked is not None:
            for i in last.tolist():
                self._set_payload(int(ids[i]), checked[i])
        return len(last)

    def _set_payload(self, id_: int, payload: bytes | None) -> None:
        if payload is None:
            return
        if payload:
            self.payloads[id_] = bytes(payload)
        else:
            self.payloads.pop(id_, None)

    def delete(self, ids: np.ndarray) -> int:
        """Delete memories by id (with their payloads); absent ids are ignored.

        Returns:
            Number of distinct ids found and deleted.

        Raises:
            MemoryInputError: ids is not a 1-D array of uint64 (INVALID_ARGUMENT).
        """
        ids = np.unique(as_ids(ids))
        rows, found = self._locate(sort_key(ids, self.slots))
        drop = np.zeros(len(self.ids), bool)
        drop[rows[found]] = True
        self._remove(drop)
        return int(found.sum())

    def reinforce(self, ids: np.ndarray, boosts: np.ndarray) -> int:
        """Add boosts to present memories (duplicates add), clamping to [0, 1].

        Uses ``kernels.reinforce``: per-id sums in batch order, so applying a batch whole or
        split by slot gives the same strengths bit for bit. Absent ids are skipped.

        Returns:
            Number of batch items whose id was present.

        Raises:
            MemoryInputError: bad input (INVALID_ARGUMENT); nothing is applied.
        """
        ids, boosts = validate_reinforce(ids, boosts)
        # kernels.row_sums, grouped by key rather than by row: each distinct key is looked
        # up once, with sorted needles (cache-friendly). Keys map one to one to rows in the
        # same order, and bincount adds each key's boosts in batch order in float64, so the
        # sums are those of kernels.reinforce bit for bit.
        keys, inverse = np.unique(sort_key(ids, self.slots), return_inverse=True)
        rows, found = kernels.locate_sorted(self.keys, keys)
        weights = boosts.astype(np.float64)
        sums = np.bincount(inverse.ravel(), weights=weights, minlength=len(keys))
        kernels.add_sums(self.strength, rows[found], sums[found].astype(np.float32))
        return int(np.count_nonzero(found[inverse]))

    def decay(self, rate: float, slots: Sequence[int] | np.ndarray | None = None) -> int:
        """Decay the memories of a slot set (None: all): ``s = clip(s - rate, 0, 1)``.

        Returns:
            Number of memories decayed.

        Raises:
            MemoryInputError: rate outside [0, 1] or a bad slot (INVALID_ARGUMENT).
        """
        rate32 = validate_rate(rate)
        starts, ends = self._run_bounds(slots)
        kernels.decay_runs(self.strength, starts, ends, float(rate32))
        return int(np.sum(ends - starts))

    # --- queries ---------------------------------------------------------------------------

    def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[bytes | None]]:
        """Look memories up by id.

        Returns:
            ``(found [K] bool, strengths [K] float32 host (0 where missing), payloads)``,
            payloads[i] None when the id is missing or has no payload.

        Raises:
            MemoryInputError: ids is not a 1-D array of uint64 (INVALID_ARGUMENT).
        """
        ids = as_ids(ids)
        rows, found = self._locate(sort_key(ids, self.slots))
        strengths = np.zeros(len(ids), np.float32)
        strengths[found] = kernels.to_host(self.strength[self.xp.asarray(rows[found])])
        payloads: list[bytes | None] = [None] * len(ids)
        if self.payloads:
            for i in np.flatnonzero(found).tolist():
                payloads[i] = self.payloads.get(int(ids[i]))
        return found, strengths, payloads

    def quality(self, slots: Sequence[int] | np.ndarray | None = None) -> Quality:
        """Summarize the strengths of a slot set (None: all), see ``kernels.quality``."""
        return kernels.quality_runs(self.strength, *self._run_bounds(slots))

    def topk(
        self, k: int, slots: Sequence[int] | np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Return the local top-k ``(ids [k'] uint64, strengths [k'] float32)`` of a slot set.

        Raises:
            MemoryInputError: k < 1 or k > k_max (INVALID_ARGUMENT).
        """
        k = validate_k(k, self.k_max)
        return kernels.topk_runs(self.strength, self.ids, *self._run_bounds(slots), k)

    def count(self, slots: Sequence[int] | np.ndarray | None = None) -> int:
        """Return the number of memories in a slot set (None: all)."""
        starts, ends = self._run_bounds(slots)
        return int(np.sum(ends - starts))

    def slot_counts(self) -> np.ndarray:
        """Return [S] int64 memories per slot."""
        return np.diff(slot_bounds(self.keys, self.slots))

    def held_slots(self) -> np.ndarray:
        """Return the slots holding at least one memory, ascending, int64."""
        return np.flatnonzero(self.slot_counts())

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(ids [N] uint64, strengths [N] float32)`` on host, sorted by id."""
        order = np.argsort(self.ids, kind="stable")
        return self.ids[order], kernels.to_host(self.strength)[order]

    # --- slots: sequence numbers, export, import -------------------------------------------

    def bump_seq(self, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """Advance the sequence number of each distinct slot by one.

        Returns:
            [len(slots)] uint64, the new sequence number of each slot as given.
        """
        chosen = as_slots(slots, self.slots)
        self.seq[np.unique(chosen)] += np.uint64(1)
        seqs: np.ndarray = self.seq[chosen].copy()
        return seqs

    def export_slot(self, slot: int) -> SlotSnapshot:
        """Copy out one slot's memories, payloads and sequence number (host arrays)."""
        start, end = self._bounds_of(slot)
        ids = self.ids[start:end].copy()
        strengths = kernels.to_host(self.strength[start:end]).copy()
        payloads = {}
        if self.payloads:
            for i in ids.tolist():
                if i in self.payloads:
                    payloads[i] = self.payloads[i]
        return SlotSnapshot(int(slot), int(self.seq[slot]), ids, strengths, payloads)

    def _bounds_of(self, slot: int) -> tuple[int, int]:
        slot = int(as_slots([slot], self.slots)[0])
        bounds = slot_bounds(self.keys, self.slots)
        return int(bounds[slot]), int(bounds[slot + 1])

    def import_slot(self, snapshot: SlotSnapshot) -> None:
        """Replace whatever this store held for the snapshot's slot, and take its seq.

        Raises:
            MemoryInputError: an id belongs to another slot or repeats, a strength is out of
                range, or a payload is too big or names an id not in the snapshot.
        """
        slot, ids, strengths = self._validate_snapshot(snapshot)
        start, end = self._bounds_of(slot)
        drop = np.zeros(len(self.ids), bool)
        drop[start:end] = True
        self._remove(drop)
        keys = sort_key(ids, self.slots)
        order = np.argsort(keys)
        self._insert(keys[order], ids[order], strengths[order], None)
        self.payloads.update({int(i): bytes(p) for i, p in snapshot.payloads.items() if p})
        self.seq[slot] = np.uint64(snapshot.seq)

    def import_slots(self, snapshots: Sequence[SlotSnapshot]) -> None:
        """``import_slot`` for many slots in one merge: O(N + K) instead of O(N) per slot.

        Every snapshot is validated before anything changes; a slot given twice takes the
        last snapshot.

        Raises:
            MemoryInputError: as ``import_slot`` (nothing is changed).
        """
        last = {int(s.slot): s for s in snapshots}
        checked = [(s, *self._validate_snapshot(s)) for s in last.values()]
        if not checked:
            return
        drop = np.zeros(len(self.ids), bool)
        for start, end in self._runs(np.fromiter(last, np.int64, len(last))):
            drop[start:end] = True
        self._remove(drop)
        ids = np.concatenate([c[2] for c in checked])
        strengths = np.concatenate([c[3] for c in checked])
        keys = sort_key(ids, self.slots)
        order = np.argsort(keys)
        self._insert(keys[order], ids[order], strengths[order], None)
        for snap, slot, _, _ in checked:
            self.payloads.update({int(i): bytes(p) for i, p in snap.payloads.items() if p})
            self.seq[slot] = np.uint64(snap.seq)

    def _validate_snapshot(self, snap: SlotSnapshot) -> tuple[int, np.ndarray, np.ndarray]:
        slot = int(as_slots([snap.slot], self.slots, name="snapshot.slot")[0])
        ids = as_ids(snap.ids, name="snapshot.ids")
        strengths = validate_values(snap.strengths, "snapshot.strengths", ids, unit_range=True)
        wrong = np.flatnonzero(slot_of(ids, self.slots) != slot)
        if len(wrong):
            i = int(wrong[0])
            raise MemoryInputError(f"snapshot.ids[{i}]: {ids[i]} is not in slot {slot}")
        if len(np.unique(ids)) != len(ids):
            raise MemoryInputError("snapshot.ids: ids repeat")
        known = set(ids.tolist())
        for i, p in snap.payloads.items():
            if int(i) not in known:
                raise MemoryInputError(f"snapshot.payloads: id {i} is not in snapshot.ids")
            if len(p) > self.max_payload_bytes:
                raise MemoryInputError(
                    f"snapshot.payloads[{i}]: {len(p)} bytes exceeds max_payload_bytes "
                    f"{self.max_payload_bytes}"
                )
        return slot, ids, strengths

    def drop_slots(self, slots: Sequence[int] | np.ndarray) -> int:
        """Forget the memories of some slots and reset their seq to 0; return the count dropped."""
        chosen = np.unique(as_slots(slots, self.slots))
        drop = np.zeros(len(self.ids), bool)
        for start, end in self._runs(chosen):
            drop[start:end] = True
        self._remove(drop)
        self.seq[chosen] = np.uint64(0)
        return int(drop.sum())
