"""SlotRows: where a store's memories live, one region of rows per slot, and an id index.

Layout: two row buffers of capacity C, ``ids`` (uint64, host) and ``strength`` (float32, on
the kernel device). Slot s owns rows ``base[s] : base[s] + cap[s]`` of them and holds its
``length[s]`` memories in the first rows of that region, in no particular order; the rows
past them (and regions no slot owns any more) are gaps whose content means nothing. A
hash table (``worker/store/row_index_numba.py``) maps an id to its row.

So an insert appends to its slot's region, O(batch) (sorted arrays made every insert copy
the whole store, O(N)). A region that is full moves to the end of the buffers with twice
the room; when the buffers are full, every region is laid out again in slot order with
half as much room again as it holds (amortized O(1) moves per insert, as a growing vector).
The kernels still see a slot set as R runs of rows ``starts[r]:ends[r]`` of one contiguous
``strength`` and ``ids`` (``worker/store/kernels.py``), now one run per slot.

Shape letters: N memories held, K batch items, S slots, C row capacity, T table cells,
R runs.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from worker.store import row_index_numba as nb

__all__ = ["SlotRows"]

_MIN_REGION = 16  # rows: a new slot's first region
_MAX_LOAD = 0.5  # table cells used at most; expected probes of a miss ~2.5 (Knuth 6.4)
_MIN_TABLE = 1 << 10


class SlotRows:
    """Row buffers with one region per slot, and the index id -> row."""

    def __init__(self, slots: int, xp: ModuleType) -> None:
        """Make empty rows for ``slots`` slots (a validated power of two), strengths on xp."""
        self.slots = slots
        self.bits = slots.bit_length() - 1
        self.xp = xp
        self.ids = np.zeros(0, np.uint64)
        self.strength: Any = xp.zeros(0, np.float32)
        self.base = np.zeros(slots, np.int64)
        self.length = np.zeros(slots, np.int64)
        self.cap = np.zeros(slots, np.int64)
        self.top = 0  # rows below top belong to regions (or were left behind by a move)
        self.count = 0
        self._new_table(_MIN_TABLE)

    def _new_table(self, cells: int) -> None:
        self.table = np.full(cells, nb.EMPTY, np.int32)
        self.tshift = np.uint64(64 - (cells.bit_length() - 1))

    # --- lookups ---------------------------------------------------------------------------

    def locate(self, keys: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ids [K] uint64 with their sort keys [K]: ``(rows [K] int64, found [K] bool)``.

        Rows are -1 where not found. Keys in ascending order run faster (cache).
        """
        return nb.lookup(self.table, self.tshift, self.ids, keys, ids)

    def runs(self, chosen: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """``(starts [R], ends [R])`` int64: the non-empty regions of distinct slots, by slot.

        Args:
            chosen: ascending distinct slots, int64; None: every slot.

        Regions that follow each other in the buffers are merged into one run.
        """
        base, length = (
            (self.base, self.length)
            if chosen is None
            else (
                self.base[chosen],
                self.length[chosen],
            )
        )
        held = length > 0
        starts, ends = base[held], base[held] + length[held]
        if len(starts) < 2:
            return starts, ends
        first = np.ones(len(starts), bool)  # a run not continuing the previous one
        first[1:] = starts[1:] != ends[:-1]
        return starts[first], ends[np.append(first[1:], True)]

    def region(self, slot: int) -> tuple[int, int]:
        """``(start, end)`` rows of one slot's memories."""
        start = int(self.base[slot])
        return start, start + int(self.length[slot])

    def live_rows(self) -> np.ndarray:
        """[N] int64: the rows of every memory, slot by slot."""
        starts, ends = self.runs(None)
        sizes = ends - starts
        offsets = np.repeat(starts - np.cumsum(sizes) + sizes, sizes)
        return offsets + np.arange(int(sizes.sum()), dtype=np.int64)

    def dense(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids [N] uint64, strengths [N] float32)`` host copies, slot by slot."""
        ids = np.empty(self.count, np.uint64)
        nb.gather_regions(self.ids, self.base, self.length, ids)
        host = self.strength if isinstance(self.strength, np.ndarray) else self.strength.get()
        strengths = np.empty(self.count, np.float32)
        nb.gather_regions(host, self.base, self.length, strengths)
        return ids, strengths

    # --- mutations -------------------------------------------------------------------------

    def append(self, keys: np.ndarray, ids: np.ndarray, strengths: np.ndarray) -> None:
        """Add memories whose ids are absent and distinct.

        Args:
            keys: [K] uint64 sort keys of the ids (ascending is faster, not required).
            ids: [K] uint64.
            strengths: [K] float32 host.
        """
        if len(keys) == 0:
            return
        slot_of = keys >> np.uint64(64 - self.bits) if self.bits else np.zeros(len(keys), int)
        adding = np.bincount(slot_of.astype(np.int64), minlength=self.slots)
        self._reserve(self.length + adding)
        self._grow_table(self.count + len(keys))
        rows = nb.append(
            self.table, self.tshift, self.ids, self.base, self.length, self.bits, keys, ids
        )
        self.strength[self.xp.asarray(rows)] = self.xp.asarray(strengths)
        self.count += len(keys)

    def remove(self, rows: np.ndarray) -> None:
        """Forget the memories at rows [M] int64 (distinct, held).

        Their cells leave the index, then each slot's holes are filled with its last rows so
        that its memories stay at the front of its region.
        """
        if len(rows) == 0:
            return
        rows = np.sort(rows)
        nb.unlink(self.table, self.tshift, self.ids, self.bits, rows)
        slot = (
            (nb.sort_keys(self.ids[rows], self.bits) >> np.uint64(64 - self.bits)).astype(np.int64)
            if self.bits
            else np.zeros(len(rows), np.int64)
        )
        dropped = np.bincount(slot, minlength=self.slots)
        new_length = self.length - dropped
        # Holes inside the shrunk regions, and the surviving rows past their new ends: as
        # many of each per slot, paired in (slot, row) order. Sources lie past every
        # destination of their slot, so the moves have no chains.
        holes = rows[rows < self.base[slot] + new_length[slot]]
        hole_slot = slot[rows < self.base[slot] + new_length[slot]]
        touched = np.flatnonzero(dropped)
        tail_start, tail_len = self.base[touched] + new_length[touched], dropped[touched]
        tail = np.repeat(tail_start - np.cumsum(tail_len) + tail_len, tail_len) + np.arange(
            int(tail_len.sum()), dtype=np.int64
        )
        tail_slot = np.repeat(touched, tail_len)
        survive = ~np.isin(tail, rows, assume_unique=True)
        src, src_slot = tail[survive], tail_slot[survive]
        dst = holes[np.lexsort((holes, hole_slot))]
        src = src[np.lexsort((src, src_slot))]
        if len(src):
            nb.move(self.table, self.tshift, self.ids, self.bits, src, dst)
            self.strength[self.xp.asarray(dst)] = self.strength[self.xp.asarray(src)]
        self.length = new_length
        self.count -= len(rows)

    def clear(self, chosen: np.ndarray, release: bool) -> int:
        """Forget every memory of the distinct slots chosen [M] int64; return how many.

        Args:
            chosen: [M] int64 distinct slots.
            release: also give up the slots' regions (a dropped slot), rather than keep them
                for the memories about to arrive (a slot replaced by a copy).
        """
        starts, ends = self.runs(np.sort(chosen))
        sizes = ends - starts
        rows = np.repeat(starts - np.cumsum(sizes) + sizes, sizes) + np.arange(
            int(sizes.sum()), dtype=np.int64
        )
        nb.unlink(self.table, self.tshift, self.ids, self.bits, rows)
        self.length[chosen] = 0
        self.count -= len(rows)
        if release:
            self.cap[chosen] = 0
            self.base[chosen] = 0
            if self.count < len(self.ids) // 4:  # mostly gaps: give the memory back
                self._relayout(self.length)
        return len(rows)

    # --- room ------------------------------------------------------------------------------

    def _reserve(self, need: np.ndarray) -> None:
        """Make every slot's region hold at least need [S] int64 rows."""
        short = np.flatnonzero(need > self.cap)
        if len(short) == 0:
            return
        room = np.maximum(2 * need[short], _MIN_REGION)
        if self.top + int(room.sum()) > len(self.ids):
            self._relayout(need)
            return
        for slot, size in zip(short.tolist(), room.tolist(), strict=True):
            self._move_region(slot, self.top)
            self.cap[slot] = size
            self.top += size

    def _move_region(self, slot: int, to: int) -> None:
        start, end = self.region(slot)
        if end > start:
            src = np.arange(start, end, dtype=np.int64)
            nb.move(self.table, self.tshift, self.ids, self.bits, src, src - start + to)
            self.strength[to : to + end - start] = self.strength[start:end]
        self.base[slot] = to

    def _relayout(self, need: np.ndarray) -> None:
        """Copy every region, in slot order, into new buffers with room for need [S] rows.

        Each slot gets half as much room again as it needs, and the buffers half the total
        again as spare for regions that outgrow theirs.
        """
        cap = np.where(need > 0, np.maximum(need + need // 2, _MIN_REGION), 0)
        base = np.concatenate([[0], np.cumsum(cap)[:-1]]).astype(np.int64)
        top = int(cap.sum())
        total = top + top // 2
        if total >= 2**31:  # rows are int32 in the table
            raise MemoryError(f"store: {total} rows exceed the 2**31 a store can index")
        ids = np.zeros(total, np.uint64)
        strength = self.xp.zeros(total, np.float32)
        for slot in np.flatnonzero(self.length).tolist():
            start, end = self.region(slot)
            to = int(base[slot])
            ids[to : to + end - start] = self.ids[start:end]
            strength[to : to + end - start] = self.strength[start:end]
        self.ids, self.strength = ids, strength
        self.base, self.cap, self.top = base, cap, top
        cells = _MIN_TABLE
        while int(need.sum()) > _MAX_LOAD * cells:  # sized for the rows about to arrive
            cells *= 2
        self._rebuild_table(cells)

    def _grow_table(self, count: int) -> None:
        """Double the table until count rows fit under the load limit."""
        cells = len(self.table)
        while count > _MAX_LOAD * cells:
            cells *= 2
        if cells != len(self.table):
            self._rebuild_table(cells)

    def _rebuild_table(self, cells: int) -> None:
        self._new_table(cells)
        nb.rebuild(self.table, self.tshift, self.ids, self.bits, self.base, self.length)
