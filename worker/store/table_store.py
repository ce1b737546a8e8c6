"""TableStore: one table's memories on one worker, for the slots the worker holds.

Layout (``worker/store/slot_rows.py``): each slot owns a region of two row buffers, ``ids`` on host
and ``strength`` on the kernel device (NumPy or CuPy), and holds its memories at the front of
it in no particular order; a hash table finds an id's row. An insert appends to its slots'
regions, so loading new ids costs O(batch), not O(memories held); the kernels run over a
slot set as runs of rows, one per slot (:meth:`TableStore._run_bounds`). Whatever leaves the
store (``export_slot``, ``items``) is in a fixed order, never the order rows were written in.
Payloads are sparse (most memories have none): a dict from id to bytes.

A worker holds one ``TableStore`` per table (``worker/store/store.py``'s ``SlotStore``, which
also keeps the slots' sequence numbers): a table is its own set of slot rows, so ids are per
table and whatever is kept per slot (rows, and a sampling structure) is kept per table too.

Every mutating method validates its whole input (``shared/memory/validation.py``) before
touching anything, so a refused batch changes nothing.

Shape letters: N memories held, K batch items, S slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from shared.memory.slots import slot_of, sort_key
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
from shared.proto import worker_pb2
from shared.rpc.codec import f32_to_bytes
from shared.rpc.limits import BudgetExceeded
from worker.store import kernels
from worker.store import row_index_numba as row_index
from worker.store.sampling import SlotWeights
from worker.store.slot_rows import SlotRows

__all__ = ["SlotPart", "TableStore", "distinct_in_order", "distinct_slots"]


def distinct_slots(slots: np.ndarray) -> np.ndarray:
    """Return slots [T] int64 distinct and ascending: as given when they already are.

    A write's and a sweep's slot sets come ascending (``np.flatnonzero``); checking that is
    O(T), where ``np.unique`` sorts.
    """
    if len(slots) < 2 or bool((slots[1:] > slots[:-1]).all()):
        return slots
    return np.unique(slots)


def distinct_in_order(ids: np.ndarray) -> np.ndarray:
    """Return the distinct values of ``ids`` ([K] uint64) in order of first occurrence ([M])."""
    if len(ids) < 2:
        return ids
    _, first = np.unique(ids, return_index=True)
    if len(first) == len(ids):
        return ids
    return ids[np.sort(first)]


# One table's memories of one slot: ids [n] uint64 in key order, strengths [n] float32 host,
# the payloads of the ids that have one, and the insert stamps of the ids that have one.
SlotPart = tuple[np.ndarray, np.ndarray, dict[int, bytes], dict[int, int]]

ORDERS = ("weakest", "oldest")  # eviction candidates' orders (``TableStore.candidates``)


class TableStore:
    """One table's memories of the slots one worker holds: a region of rows per slot."""

    def __init__(self, slots: int, xp: ModuleType, max_payload_bytes: int, k_max: int) -> None:
        """Make an empty table.

        Args:
            slots: number of hash slots S of the cluster, a validated power of two.
            xp: the kernel array module (NumPy or CuPy).
            max_payload_bytes: largest payload of one memory, bytes (the cluster's).
            k_max: largest k a top-k request may ask for.
        """
        self.slots = slots
        self.xp = xp
        self.max_payload_bytes = max_payload_bytes
        self.k_max = k_max
        self._rows = SlotRows(slots, xp)
        self.payloads: dict[int, bytes] = {}
        # Per-slot sampling weights (worker/store/sampling.py): every method below that
        # changes a strength or which memories a slot holds marks the slots it touched.
        self.sampling = SlotWeights(slots)
        # Insert stamps of a capped table's memories (``upsert``'s ``stamps``): sparse, as
        # payloads; a memory keeps the stamp of the insert that created it.
        self.stamps: dict[int, int] = {}

    def __len__(self) -> int:
        """Memories held."""
        return self._rows.count

    # --- rows: the buffers the kernels run over ---------------------------------------------

    @property
    def ids(self) -> np.ndarray:
        """[C] uint64 host row buffer of ids, C >= N.

        Only the rows of :meth:`_run_bounds` hold memories; the others are gaps.
        Reallocated when the store grows: do not keep a reference across mutations.
        """
        return self._rows.ids

    @property
    def strength(self) -> Any:
        """[C] float32 row buffer of strengths on the kernel device, aligned with :attr:`ids`."""
        return self._rows.strength

    def _locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(rows [K] int64, found [K] bool)`` of ids; rows are -1 where not found."""
        return self._rows.locate(row_index.sort_keys(ids, self._rows.bits), ids)

    def _run_bounds(
        self, slots: Sequence[int] | np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(starts [R], ends [R])`` int64: the rows of a slot set's memories.

        None: every slot. One run per non-empty slot, in slot order (runs that follow each
        other in the buffers merged); runs need not ascend. This is what the ``*_runs``
        kernels take with :attr:`strength` and :attr:`ids`.
        """
        if slots is None:
            return self._rows.runs(None)
        return self._rows.runs(distinct_slots(as_slots(slots, self.slots)))

    def _slots_of_keys(self, keys: np.ndarray) -> np.ndarray:
        """[K] int64 slots of sort keys [K] uint64 (the slot is a key's top bits)."""
        bits = self._rows.bits
        if not bits:
            return np.zeros(len(keys), np.int64)
        return (keys >> np.uint64(64 - bits)).astype(np.int64)

    def _mark_slots(self, slots: Sequence[int] | np.ndarray | None) -> None:
        """Mark a slot set (None: all) changed for sampling."""
        if slots is None:
            self.sampling.mark_all()
        else:
            self.sampling.mark(as_slots(slots, self.slots))

    def _read_slots(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(slot [m] int64, ids [m] uint64, strengths [m] float32)`` of distinct slots."""
        base, length = self._rows.base[slots], self._rows.length[slots]
        rows = np.repeat(base - np.cumsum(length) + length, length) + np.arange(
            int(length.sum()), dtype=np.int64
        )
        strengths = kernels.to_host(self.strength[self.xp.asarray(rows)])
        return np.repeat(slots, length), self.ids[rows], np.asarray(strengths, np.float32)

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
        max_payload_bytes: int | None = None,
        stamps: np.ndarray | None = None,
        existing_only: bool = False,
    ) -> int:
        """Insert or overwrite memories; within a batch the last occurrence of an id wins.

        Args:
            ids: [K] uint64.
            strengths: [K] float32 in [0, 1].
            payloads: None leaves payloads alone; else [K] bytes (b"" removes one; a None
                entry leaves that one alone), each at most ``max_payload_bytes``.
            max_payload_bytes: the table's payload limit, bytes; None: the cluster's.
            stamps: None, or [K] uint64 insert stamps: an id not held before takes the stamp
                of its last occurrence, a held one keeps its own.
            existing_only: a priority update: write only the ids present (their payloads
                kept), skip the absent ones; ``payloads`` must then be None.

        Returns:
            Number of distinct ids written (``existing_only``: the distinct ids found).

        Raises:
            MemoryInputError: bad input (INVALID_ARGUMENT); nothing is applied.
        """
        ids, strengths, checked = validate_upsert(
            ids, strengths, payloads, max_payload_bytes or self.max_payload_bytes
        )
        if stamps is not None and len(stamps) != len(ids):
            raise MemoryInputError(f"stamps: {len(stamps)} for {len(ids)} ids")
        if existing_only and checked is not None:
            raise MemoryInputError("payloads: a priority update keeps payloads; send none")
        # One sort by key (quicksort: 5x faster than a stable sort here) gives the distinct
        # keys in order for the lookup; an id's last occurrence in the batch is the largest
        # batch index among the items of its key.
        all_keys = sort_key(ids, self.slots)
        order = np.argsort(all_keys)
        sorted_keys = all_keys[order]
        first = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]][: len(order)])
        keys = sorted_keys[first]
        last = order if len(first) == len(order) else np.maximum.reduceat(order, first)
        rows, found = self._rows.locate(keys, ids[last])
        self.sampling.mark(self._slots_of_keys(keys[found] if existing_only else keys))
        if found.any():
            self.strength[self.xp.asarray(rows[found])] = self.xp.asarray(strengths[last[found]])
        if existing_only:
            return int(found.sum())
        new = ~found
        self._rows.append(keys[new], ids[last[new]], strengths[last[new]])
        if stamps is not None:
            fresh = last[new]
            new_ids, new_stamps = ids[fresh].tolist(), np.asarray(stamps)[fresh].tolist()
            self.stamps.update(zip(new_ids, new_stamps, strict=True))
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
        rows, found = self._locate(ids)
        self.sampling.mark(slot_of(ids[found], self.slots))
        if self.payloads or self.stamps:
            for i in ids[found].tolist():
                self.payloads.pop(i, None)
                self.stamps.pop(i, None)
        self._rows.remove(rows[found])
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
        # up once, in key order (the index's cells and the slots' rows are then visited in
        # order, cache-friendly). Keys map one to one to rows, and bincount adds each key's
        # boosts in batch order in float64, so the sums are those of kernels.reinforce bit
        # for bit.
        keys, inverse = np.unique(sort_key(ids, self.slots), return_inverse=True)
        inverse = inverse.ravel()
        key_ids = np.empty(len(keys), np.uint64)
        key_ids[inverse] = ids  # the id of each distinct key (keys map one to one to ids)
        rows, found = self._rows.locate(keys, key_ids)
        self.sampling.mark(self._slots_of_keys(keys[found]))
        weights = boosts.astype(np.float64)
        sums = np.bincount(inverse, weights=weights, minlength=len(keys))
        kernels.add_sums(self.strength, rows[found], sums[found].astype(np.float32))
        return int(np.count_nonzero(found[inverse]))

    def decay(
        self,
        rate: float,
        slots: Sequence[int] | np.ndarray | None = None,
        forget_below: float | None = None,
    ) -> int:
        """Decay the memories of a slot set (None: all): ``s = clip(s - rate, 0, 1)``.

        Args:
            rate: in [0, 1].
            slots: the slot set; None: every slot.
            forget_below: None, or a strength: a decay with rate > 0 then removes the
                memories of the slot set left at or below it (the table's ``forget_below``).

        Returns:
            Number of memories decayed (without forgetting) or left (with it).

        Raises:
            MemoryInputError: rate outside [0, 1] or a bad slot (INVALID_ARGUMENT).
        """
        rate32 = validate_rate(rate)
        starts, ends = self._run_bounds(slots)
        self._mark_slots(slots)
        kernels.decay_runs(self.strength, starts, ends, float(rate32))
        if forget_below is None or not rate32 > 0:
            return int(np.sum(ends - starts))
        self._forget(starts, ends, np.float32(forget_below))
        return self.count(slots)

    def _forget(self, starts: np.ndarray, ends: np.ndarray, below: np.float32) -> None:
        """Remove the memories of runs ``starts[r]:ends[r]`` whose strength is <= ``below``."""
        rows = [np.arange(a, b) for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
        if not rows:
            return
        held = np.concatenate(rows)
        weak = held[kernels.to_host(self.strength[self.xp.asarray(held)]) <= below]
        if len(weak):
            self.delete(self.ids[weak].copy())

    # --- queries ---------------------------------------------------------------------------

    def get(
        self, ids: np.ndarray, with_payloads: bool = True
    ) -> tuple[np.ndarray, np.ndarray, list[bytes | None]]:
        """Look memories up by id.

        Args:
            ids: [K] uint64, repeats allowed (each position answered).
            with_payloads: look the payloads up too; False leaves every entry None.

        Returns:
            ``(found [K] bool, strengths [K] float32 host (0 where missing), payloads)``,
            payloads[i] None when the id is missing or has no payload (or not asked for).

        Raises:
            MemoryInputError: ids is not a 1-D array of uint64 (INVALID_ARGUMENT).
        """
        ids = as_ids(ids)
        rows, found = self._locate(ids)
        strengths = np.zeros(len(ids), np.float32)
        strengths[found] = kernels.to_host(self.strength[self.xp.asarray(rows[found])])
        payloads: list[bytes | None] = [None] * len(ids)
        if with_payloads and self.payloads:
            for i in np.flatnonzero(found).tolist():
                payloads[i] = self.payloads.get(int(ids[i]))
        return found, strengths, payloads

    def get_reply(
        self, ids: np.ndarray, with_payloads: bool, max_bytes: int | None
    ) -> worker_pb2.GetResponse:
        """Answer a Get (``get`` of each distinct id once), refusing a reply over ``max_bytes``.

        The size is counted from the distinct ids and their payloads' lengths before the
        reply message is built.

        Args:
            ids: [K] uint64, repeats allowed.
            with_payloads: answer the payloads too.
            max_bytes: the largest reply, bytes; None: no limit.

        Returns:
            found [M] uint8, strengths [M] float32 and (with payloads) M payloads (b"" where
            missing or none), for the M distinct ids in the order of their first occurrence.

        Raises:
            MemoryInputError: ids is not a 1-D array of uint64 (INVALID_ARGUMENT).
            BudgetExceeded: the reply would exceed ``max_bytes`` (RESOURCE_EXHAUSTED).
        """
        ids = distinct_in_order(as_ids(ids))
        found, strengths, looked_up = self.get(ids, with_payloads)
        m = len(ids)
        size = 2 * (m + 11) + 4 * m  # found and strengths, with their tags and lengths
        payloads = [p or b"" for p in looked_up] if with_payloads else []
        size += sum(len(p) + 6 for p in payloads)  # tag + length varint (< 2**28)
        if max_bytes is not None and size > max_bytes:
            raise BudgetExceeded(
                f"Get reply of {m} distinct ids would be {size} bytes, over max_message_bytes "
                f"{max_bytes}; ask for fewer ids (or without payloads)"
            )
        return worker_pb2.GetResponse(
            found=found.astype(np.uint8).tobytes(),
            strengths=f32_to_bytes(strengths),
            payloads=payloads,
        )

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

    def sweep(
        self,
        rate: float | None,
        slots: Sequence[int] | np.ndarray | None,
        k: int,
        want_quality: bool,
        decay_slots: Sequence[int] | np.ndarray | None = None,
        forget_below: float | None = None,
    ) -> tuple[Quality | None, tuple[np.ndarray, np.ndarray] | None]:
        """Decay a slot set, then summarize it and select its top-k, in one pass.

        Equals ``decay`` then ``quality`` and ``topk`` of ``slots`` exactly
        (``kernels.sweep_runs``).

        Args:
            rate: decay in [0, 1]; None: no decay.
            slots: the slot set summarized (None: all).
            k: top-k size, 0 (none) to ``k_max``.
            want_quality: compute the statistics.
            decay_slots: the part of ``slots`` to decay (slots that applied the decay earlier
                are left out); None: all of ``slots``.
            forget_below: as ``decay``'s (then the decay is a pass of its own, before the
                summary's).

        Returns:
            ``(quality or None, (ids [k'] uint64, strengths [k'] float32) or None)``.

        Raises:
            MemoryInputError: rate outside [0, 1], k out of range or a bad slot
                (INVALID_ARGUMENT); nothing is applied.
        """
        rate32 = None if rate is None else float(validate_rate(rate))
        k = validate_k(k, self.k_max) if k else 0
        if rate32 is not None and (decay_slots is not None or forget_below is not None):
            # A retry (part of the set applied it already), or a decay that forgets.
            self.decay(rate32, slots if decay_slots is None else decay_slots, forget_below)
            rate32 = None
        starts, ends = self._run_bounds(slots)
        if rate32 is not None:
            self._mark_slots(slots)
        return kernels.sweep_runs(self.strength, self.ids, starts, ends, rate32, want_quality, k)

    def sample_sums(self, alpha: float | None, slots: np.ndarray) -> tuple[int, np.ndarray, int]:
        """Phase 1 of a sample: the weight sums of a slot set (``SlotWeights.refresh``).

        Args:
            alpha: the priority exponent, finite and >= 0 (validated by the caller), or
                ``sampling.UNIFORM``.
            slots: [T] int64 distinct slots.

        Returns:
            (version for ``sample_pick``, totals [T] uint64, memories in the slots).
        """
        return self.sampling.refresh(alpha, slots, self._read_slots)

    def sample_pick(
        self, version: int, slots: np.ndarray, offsets: np.ndarray, with_payloads: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[bytes], np.ndarray]:
        """Phase 2 of a sample: the memories at offsets of slots' weights, as of ``version``.

        Args:
            version: from ``sample_sums``.
            slots: [K] int64 slot of each draw (``SlotWeights.pick``).
            offsets: [K] uint64 offset of each draw in its slot's weight sum.
            with_payloads: read the drawn memories' payloads (now).

        Returns:
            (ids [K] uint64, strengths [K] float32 and weights [K] uint64 as of ``version``,
            K payloads (b"" for none or not asked), present [K] bool: the id is still
            stored now; a memory deleted since ``version`` must not be answered).

        Raises:
            StaleVersion: ``version`` is no longer kept (ABORTED).
        """
        ids, strengths, weights = self.sampling.pick(version, slots, offsets)
        present = self._locate(ids)[1]
        payloads = [b""] * len(ids)
        if with_payloads and self.payloads:
            payloads = [self.payloads.get(i, b"") for i in ids.tolist()]
        return ids, strengths, weights, payloads, present

    def count(self, slots: Sequence[int] | np.ndarray | None = None) -> int:
        """Return the number of memories in a slot set (None: all)."""
        starts, ends = self._run_bounds(slots)
        return int(np.sum(ends - starts))

    def slot_counts(self) -> np.ndarray:
        """Return [S] int64 memories per slot."""
        return self._rows.length.copy()

    def held_slots(self) -> np.ndarray:
        """Return the slots holding at least one memory, ascending, int64."""
        return np.flatnonzero(self.slot_counts())

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(ids [N] uint64, strengths [N] float32)`` on host, sorted by id."""
        ids, strengths = self._rows.dense()
        order = np.argsort(ids, kind="stable")
        return ids[order], strengths[order]

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(ids [N] uint64, strengths [N] float32)`` host copies: what a snapshot saves.

        Grouped by slot in ascending slot order, in no particular order within a slot.
        """
        return self._rows.dense()

    def candidates(
        self, k: int, order: str, slots: Sequence[int] | np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Return the first k memories of a slot set to evict, and how many it holds.

        O(N) over the slot set's memories (a capped table's insert pays it on each primary).

        Args:
            k: how many, >= 0.
            order: "weakest": by (strength, id) ascending; "oldest": by (stamp, id)
                ascending (a memory without a stamp counts as stamp 0).
            slots: the slot set (None: all).

        Returns:
            ``(ids [k'] uint64, strengths [k'] float32, stamps [k'] uint64, count)``, k' =
            min(k, count), in eviction order.

        Raises:
            MemoryInputError: an unknown order (INVALID_ARGUMENT).
        """
        if order not in ORDERS:
            raise MemoryInputError(f"order: {order!r} is not one of {', '.join(ORDERS)}")
        starts, ends = self._run_bounds(slots)
        rows = (
            np.concatenate([np.arange(a, b) for a, b in zip(starts, ends, strict=True)])
            if len(starts)
            else np.zeros(0, np.int64)
        )
        ids = self.ids[rows]
        strengths = (
            kernels.to_host(self.strength[self.xp.asarray(rows)])
            if len(rows)
            else (np.zeros(0, np.float32))
        )
        stamps = np.fromiter((self.stamps.get(i, 0) for i in ids.tolist()), np.uint64, len(ids))
        first = stamps if order == "oldest" else strengths
        pick = np.lexsort((ids, first))[:k]
        return ids[pick], strengths[pick], stamps[pick], len(ids)

    # --- slots: export, import ------------------------------------------------------------

    def export_slot(self, slot: int) -> SlotPart:
        """Copy out one slot's memories in key order, their payloads and stamps (host)."""
        start, end = self._rows.region(slot)
        ids = self.ids[start:end]
        # Key order: the copy is the same whatever order the rows were written in.
        order = np.argsort(sort_key(ids, self.slots))
        ids = ids[order]
        strengths = kernels.to_host(self.strength[start:end])[order]
        payloads = {}
        if self.payloads:
            for i in ids.tolist():
                if i in self.payloads:
                    payloads[i] = self.payloads[i]
        stamps = {}
        if self.stamps:
            stamps = {i: self.stamps[i] for i in ids.tolist() if i in self.stamps}
        return ids, strengths, payloads, stamps

    def install(self, parts: dict[int, SlotPart], release: bool = False) -> None:
        """Replace the memories of some slots with validated parts (``validate_part``).

        Args:
            parts: slot -> its new content (may be empty).
            release: give up the regions of the slots left empty (a dropped slot).
        """
        if not parts:
            return
        self._clear(np.fromiter(parts, np.int64, len(parts)), release=release)
        held = [p for p in parts.values() if len(p[0])]
        if not held:
            return
        ids = np.concatenate([p[0] for p in held])
        strengths = np.concatenate([p[1] for p in held])
        keys = sort_key(ids, self.slots)
        order = np.argsort(keys)
        self._rows.append(keys[order], ids[order], strengths[order])
        for p in held:
            self.payloads.update({int(i): bytes(b) for i, b in p[2].items() if b})
            self.stamps.update(p[3])

    def load(
        self,
        ids: np.ndarray,
        strengths: np.ndarray,
        payloads: dict[int, bytes],
        stamps: dict[int, int] | None = None,
    ) -> None:
        """Fill the empty table with memories (in any order) and their payloads.

        Args:
            ids: [N] uint64, distinct.
            strengths: [N] float32 in [0, 1] (not checked: a snapshot of this store's).
            payloads: id -> payload, for ids among ``ids``.
            stamps: id -> insert stamp, for ids among ``ids``.

        Raises:
            MemoryInputError: the table is not empty, or ids repeat.
        """
        if len(self):
            raise MemoryInputError(f"load: the table already holds {len(self)} memories")
        ids = as_ids(ids)
        keys = sort_key(ids, self.slots)
        order = np.argsort(keys)
        keys = keys[order]
        if len(keys) > 1 and not bool((keys[1:] != keys[:-1]).all()):
            raise MemoryInputError("ids: ids repeat")
        self._rows.append(keys, ids[order], np.asarray(strengths, np.float32)[order])
        self.sampling.mark_all()
        self.payloads = dict(payloads)
        self.stamps = dict(stamps or {})

    def validate_part(
        self,
        slot: int,
        ids: Any,
        strengths: Any,
        payloads: dict[int, bytes],
        stamps: dict[int, int] | None = None,
    ) -> SlotPart:
        """Check one slot's copied content for this table; return it as a ``SlotPart``.

        Raises:
            MemoryInputError: an id belongs to another slot or repeats, a strength is out of
                range, or a payload is too big or names an id not in the part
                (INVALID_ARGUMENT).
        """
        slot = int(as_slots([slot], self.slots, name="snapshot.slot")[0])
        ids = as_ids(ids, name="snapshot.ids")
        strengths = validate_values(strengths, "snapshot.strengths", ids, unit_range=True)
        wrong = np.flatnonzero(slot_of(ids, self.slots) != slot)
        if len(wrong):
            i = int(wrong[0])
            raise MemoryInputError(f"snapshot.ids[{i}]: {ids[i]} is not in slot {slot}")
        if len(np.unique(ids)) != len(ids):
            raise MemoryInputError("snapshot.ids: ids repeat")
        known = set(ids.tolist())
        for i, p in payloads.items():
            if int(i) not in known:
                raise MemoryInputError(f"snapshot.payloads: id {i} is not in snapshot.ids")
            if len(p) > self.max_payload_bytes:
                raise MemoryInputError(
                    f"snapshot.payloads[{i}]: {len(p)} bytes exceeds max_payload_bytes "
                    f"{self.max_payload_bytes}"
                )
        stamps = dict(stamps or {})
        for i in stamps:
            if int(i) not in known:
                raise MemoryInputError(f"snapshot.stamps: id {i} is not in snapshot.ids")
        return ids, strengths, payloads, stamps

    def clear_slots(self, chosen: np.ndarray) -> int:
        """Forget the memories of distinct slots [M] int64, keeping their regions for a copy."""
        return self._clear(chosen, release=False)

    def drop_slots(self, chosen: np.ndarray) -> int:
        """Forget the memories of distinct slots [M] int64; return the count dropped."""
        return self._clear(chosen, release=True)

    def _clear(self, chosen: np.ndarray, release: bool) -> int:
        """Forget the memories and payloads of distinct slots; see ``SlotRows.clear``."""
        if len(chosen) == 0:
            return 0
        self.sampling.mark(chosen)
        if self.payloads or self.stamps:
            for start, end in self._runs(chosen):
                for i in self.ids[start:end].tolist():
                    self.payloads.pop(i, None)
                    self.stamps.pop(i, None)
        return self._rows.clear(chosen, release)
