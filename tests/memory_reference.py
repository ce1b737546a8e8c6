"""ReferenceStore: the single-process NumPy model the memory-store invariant is checked against.

The invariant (docs/architecture.md, "Invariants"): for any sequence of operations and any number of
workers, the cluster's ``{id: strength}`` equals this reference bit for bit (float32).

The reference is written independently of the code it checks: it imports nothing from
``worker`` (no kernels, no store) nor ``shared.memory.validation``/``stats``, so a change of
arithmetic in the kernels makes the invariant tests fail instead of changing both sides. The
semantics, in float32 unless stated (docs/architecture.md, "Invariants"):

- decay(rate): ``s = clip(s - float32(rate), 0, 1)``;
- reinforce(ids, boosts): the boosts of one id are added in batch order in float64, the sum
  rounded once to float32, then ``s = clip(s + sum, 0, 1)``; absent ids are skipped;
- quality(): count, float64 sum and mean, min, max, and ``np.histogram(s, 10, (0, 1))``
  (bin k is ``float32(k/10) <= s < float32((k+1)/10)``, the last bin closed);
- topk(k): sorted by strength descending, ties by smaller id, the first k;
- a table with a capacity (``ReferenceTables.create``): an upsert applies the whole batch,
  a new id taking the insert number of its last occurrence in the batch (an id already held
  keeps its own), then evicts ``count - capacity`` memories, all of them candidates (the
  batch's too): ``fifo`` the smallest insert numbers, ``weakest`` the smallest (strength, id);
- ``forget_below`` x: a decay then removes the memories left at or below x.

Storage is plain: one array of ids sorted by id, the strengths and the payloads (an object
array) aligned with it, no slots, no keys, no device. Slot numbers only select the rows of
``decay``/``quality``/``topk`` slot sets, through ``shared.memory.slots.slot_of``, whose
values are pinned by golden vectors in ``tests/unit/shared/memory/test_slots.py``.

Inputs are checked with the same acceptance rules as the cluster (a plain local check
raising ``ReferenceInputError``), so a test may feed both the same batch; the messages are
not the cluster's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shared.memory.slots import slot_of

HIST_BINS = 10
_ZERO, _ONE = np.float32(0), np.float32(1)


class ReferenceInputError(ValueError):
    """The reference refuses a batch the cluster would refuse too; nothing was applied."""


@dataclass(frozen=True)
class Quality:
    """The reference's summary of a set of strengths (same field names as the store's).

    ``sum`` and ``mean`` are float64; ``min``/``max`` float32 values as Python floats; an
    empty set has count 0 and every other field 0.
    """

    count: int
    sum: float
    mean: float
    min: float
    max: float
    histogram: tuple[int, ...]


# --- input checks: the cluster's acceptance rules, written plainly -------------------------


def _ids(ids: object) -> np.ndarray:
    """[K] uint64 from a 1-D array of non-negative integers."""
    a = np.asarray(ids)
    if a.ndim != 1:
        raise ReferenceInputError(f"ids: shape {a.shape} is not 1-D")
    if a.size == 0:
        return a.astype(np.uint64)
    if a.dtype.kind not in "iu":
        raise ReferenceInputError(f"ids: dtype {a.dtype} is not an integer type")
    if a.dtype.kind == "i" and bool((a < 0).any()):
        raise ReferenceInputError("ids: a negative id")
    return a.astype(np.uint64)


def _values(values: object, name: str, n: int, upper: float | None) -> np.ndarray:
    """[n] float32 from numbers that are finite, >= 0, <= upper (when given) and fit float32.

    The bounds are checked on the values as given (float64), then they are rounded to
    float32 once; -0.0 becomes +0.0.
    """
    a = np.asarray(values)
    if a.ndim != 1 or len(a) != n:
        raise ReferenceInputError(f"{name}: shape {a.shape}, expected ({n},)")
    if a.size and a.dtype.kind not in "fiu":
        raise ReferenceInputError(f"{name}: dtype {a.dtype} is not a number type")
    a64 = a.astype(np.float64)
    with np.errstate(over="ignore"):
        a32 = a64.astype(np.float32)
    ok = np.isfinite(a64) & np.isfinite(a32) & (a64 >= 0)
    if upper is not None:
        ok &= a64 <= upper
    if not bool(ok.all()):
        raise ReferenceInputError(f"{name}[{int(np.argmin(ok))}]: out of range")
    return np.where(a32 == 0, _ZERO, a32).astype(np.float32)


def _rate(rate: object) -> np.float32:
    if isinstance(rate, bool) or not isinstance(rate, int | float | np.integer | np.floating):
        raise ReferenceInputError(f"rate: {rate!r} is not a number")
    if not (np.isfinite(rate) and 0 <= rate <= 1):
        raise ReferenceInputError(f"rate: {rate!r} is not in [0, 1]")
    return np.float32(rate)


class ReferenceStore:
    """All memories in one process, sorted by id; same method names as ``SlotStore``."""

    def __init__(
        self,
        slots: int = 1024,
        max_payload_bytes: int = 4096,
        k_max: int = 10000,
        capacity: int = 0,
        eviction: str = "fifo",
        forget_below: float | None = None,
    ):
        self.slots = slots
        self.max_payload_bytes = max_payload_bytes
        self.k_max = k_max
        self.capacity, self.eviction, self.forget_below = capacity, eviction, forget_below
        self.ids = np.empty(0, np.uint64)
        self.strength = np.empty(0, np.float32)
        self.payload = np.empty(0, object)  # bytes, or None for no payload
        self.inserted = np.empty(0, np.int64)  # insert number of each memory
        self.inserts = 0  # batch items inserted so far (numbers the next batch's)

    def _rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(rows, found)`` of ids in the sorted id array."""
        rows = np.searchsorted(self.ids, ids)
        found = rows < len(self.ids)
        found[found] = self.ids[rows[found]] == ids[found]
        return rows, found

    def _mask(self, slots: Sequence[int] | np.ndarray | None) -> np.ndarray:
        """[N] bool: the rows whose id is in one of ``slots`` (None: every row)."""
        if slots is None:
            return np.ones(len(self.ids), bool)
        chosen = np.asarray(slots)
        if chosen.ndim != 1 or (chosen.size and chosen.dtype.kind not in "iu"):
            raise ReferenceInputError("slots: expected a 1-D array of integers")
        if chosen.size and bool(((chosen < 0) | (chosen >= self.slots)).any()):
            raise ReferenceInputError(f"slots: a slot outside [0, {self.slots})")
        return np.isin(slot_of(self.ids, self.slots), chosen.astype(np.int64))

    def upsert(self, ids, strengths, payloads=None) -> int:
        """Insert or overwrite; the last occurrence of an id in the batch wins.

        ``payloads`` None leaves payloads alone; else one entry per id: bytes (b"" removes
        the payload) or None (leaves that one alone). Returns the number of distinct ids.
        """
        ids = _ids(ids)
        strengths = _values(strengths, "strengths", len(ids), upper=1.0)
        if payloads is not None:
            payloads = list(payloads)
            if len(payloads) != len(ids):
                raise ReferenceInputError("payloads: not one per id")
            for p in payloads:
                if p is not None and not isinstance(p, bytes | bytearray | memoryview):
                    raise ReferenceInputError(f"payloads: {type(p).__name__} is not bytes")
                if p is not None and len(p) > self.max_payload_bytes:
                    raise ReferenceInputError("payloads: one exceeds max_payload_bytes")
        # The last occurrence of each distinct id: first occurrence in the reversed batch.
        last = len(ids) - 1 - np.unique(ids[::-1], return_index=True)[1]
        is_new = ~np.isin(ids[last], self.ids)
        new_ids = ids[last][is_new]
        numbers = self.inserts + last[is_new]  # the batch position of the last occurrence
        self.inserts += len(ids)
        self.ids = np.concatenate([self.ids, new_ids])
        self.strength = np.concatenate([self.strength, np.zeros(len(new_ids), np.float32)])
        self.payload = np.concatenate([self.payload, np.full(len(new_ids), None, object)])
        self.inserted = np.concatenate([self.inserted, numbers.astype(np.int64)])
        order = np.argsort(self.ids)
        self.ids, self.strength, self.payload, self.inserted = (
            self.ids[order],
            self.strength[order],
            self.payload[order],
            self.inserted[order],
        )
        rows = np.searchsorted(self.ids, ids[last])
        self.strength[rows] = strengths[last]
        if payloads is not None:
            for row, i in zip(rows.tolist(), last.tolist(), strict=True):
                if payloads[i] is not None:
                    self.payload[row] = bytes(payloads[i]) if len(payloads[i]) else None
        self._evict()
        return len(last)

    def _evict(self) -> None:
        """Remove what exceeds the capacity, in the table's eviction order."""
        excess = len(self.ids) - self.capacity if self.capacity else 0
        if excess <= 0:
            return
        first = self.inserted if self.eviction == "fifo" else self.strength
        victims = np.lexsort((self.ids, first))[:excess]
        self._keep(~np.isin(np.arange(len(self.ids)), victims))

    def _keep(self, keep: np.ndarray) -> None:
        self.ids, self.strength = self.ids[keep], self.strength[keep]
        self.payload, self.inserted = self.payload[keep], self.inserted[keep]

    def update_strengths(self, ids, strengths) -> int:
        """Set the strengths of the ids present (the last occurrence in the batch wins),
        payloads kept; absent ids skipped. Returns the number of distinct ids found."""
        ids = _ids(ids)
        strengths = _values(strengths, "strengths", len(ids), upper=1.0)
        for i, s in zip(ids.tolist(), strengths.tolist(), strict=True):  # in batch order
            row = int(np.searchsorted(self.ids, np.uint64(i)))
            if row < len(self.ids) and int(self.ids[row]) == i:
                self.strength[row] = np.float32(s)
        return int(np.isin(np.unique(ids), self.ids).sum())

    def get(self, ids) -> tuple[np.ndarray, np.ndarray, list[bytes | None]]:
        """Return ``(found, strengths (0 where missing), payloads)``."""
        ids = _ids(ids)
        rows, found = self._rows(ids)
        strengths = np.zeros(len(ids), np.float32)
        strengths[found] = self.strength[rows[found]]
        payloads = [self.payload[r] if f else None for r, f in zip(rows, found, strict=True)]
        return found, strengths, payloads

    def delete(self, ids) -> int:
        """Delete by id; return the number of distinct ids found."""
        ids = _ids(ids)
        gone = np.isin(self.ids, ids)
        self._keep(~gone)
        return int(gone.sum())

    def reinforce(self, ids, boosts) -> int:
        """Add each present id's boosts (summed in float64 in batch order, rounded once to
        float32) to its strength and clip to [0, 1]; return the batch items found."""
        ids = _ids(ids)
        boosts = _values(boosts, "boosts", len(ids), upper=None)
        rows, found = self._rows(ids)
        distinct, inverse = np.unique(rows[found], return_inverse=True)
        sums = np.zeros(len(distinct), np.float64)
        np.add.at(sums, inverse.ravel(), boosts[found].astype(np.float64))  # in batch order
        added = self.strength[distinct] + sums.astype(np.float32)
        self.strength[distinct] = np.clip(added, _ZERO, _ONE)
        return int(found.sum())

    def decay(self, rate, slots=None) -> int:
        """``s = clip(s - float32(rate), 0, 1)`` for the memories of a slot set (None: all);
        return how many were decayed."""
        rate32 = _rate(rate)
        mask = self._mask(slots)
        self.strength[mask] = np.clip(self.strength[mask] - rate32, _ZERO, _ONE)
        if self.forget_below is not None and rate32 > 0:
            self._keep(~(mask & (self.strength <= np.float32(self.forget_below))))
            return self.count(slots)  # what is left of the slot set
        return int(mask.sum())

    def quality(self, slots=None) -> Quality:
        """Count, float64 sum and mean, min, max and the 10-bin histogram of a slot set."""
        s = self.strength[self._mask(slots)]
        if len(s) == 0:
            return Quality(0, 0.0, 0.0, 0.0, 0.0, (0,) * HIST_BINS)
        total = float(np.sum(s, dtype=np.float64))
        hist, _ = np.histogram(s, bins=HIST_BINS, range=(0.0, 1.0))
        return Quality(
            count=len(s),
            sum=total,
            mean=total / len(s),
            min=float(s.min()),
            max=float(s.max()),
            histogram=tuple(int(c) for c in hist),
        )

    def topk(self, k, slots=None) -> tuple[np.ndarray, np.ndarray]:
        """The k strongest of a slot set, strongest first, ties by smaller id:
        ``(ids [k'] uint64, strengths [k'] float32)``, k' = min(k, memories)."""
        if isinstance(k, bool) or not isinstance(k, int | np.integer):
            raise ReferenceInputError(f"k: {k!r} is not an integer")
        if not 1 <= k <= self.k_max:
            raise ReferenceInputError(f"k: {k} is not in [1, {self.k_max}]")
        mask = self._mask(slots)
        ids, s = self.ids[mask], self.strength[mask]
        order = np.lexsort((ids, -s))[: int(k)]
        return ids[order], s[order]

    def sample(self, n, alpha, seed) -> tuple[np.ndarray, np.ndarray, list, np.ndarray]:
        """Prioritized sampling with replacement, as docs/architecture.md ("Sampling") defines it.

        Weights: 0 for strength 0, else max(1, rint(float64(s) ** alpha * 2**32)); every
        weight 1 when all are 0. Order: slot ascending, then id. u = PCG64(seed)'s
        ``integers(0, W, n, uint64)``; draw k is the first memory whose running weight sum
        exceeds u[k]. Returns ``(ids [n], strengths [n], payloads [n] (None: none),
        probabilities [n] float64 = w / W)``; raises ReferenceInputError on an empty store.
        """
        if not isinstance(n, int) or not 1 <= n:
            raise ReferenceInputError(f"n: {n!r}")
        if not (np.isfinite(alpha) and alpha >= 0):
            raise ReferenceInputError(f"alpha: {alpha!r}")
        if len(self.ids) == 0:
            raise ReferenceInputError("sample of an empty store")
        order = np.lexsort((self.ids, slot_of(self.ids, self.slots)))
        s = self.strength[order].astype(np.float64)
        w = np.zeros(len(s), np.uint64)
        positive = s > 0
        scaled = np.rint(np.power(s[positive], float(alpha)) * 4294967296.0)
        w[positive] = np.maximum(scaled, 1.0).astype(np.uint64)
        if int(w.sum(dtype=np.uint64)) == 0:
            w[:] = 1
        cum = np.cumsum(w, dtype=np.uint64)
        total = int(cum[-1])
        u = np.random.Generator(np.random.PCG64(seed)).integers(0, total, n, dtype=np.uint64)
        position = np.searchsorted(cum, u, side="right")
        picked = order[position]
        probabilities = w[position] / total
        return (
            self.ids[picked],
            self.strength[picked],
            [self.payload[i] for i in picked.tolist()],
            probabilities.astype(np.float64),
        )

    def count(self, slots=None) -> int:
        """Return the number of memories in a slot set (None: all)."""
        return int(self._mask(slots).sum())

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(ids, strengths)`` sorted by id (copies)."""
        return self.ids.copy(), self.strength.copy()

    def payloads(self) -> dict[int, bytes]:
        """Return the payloads as ``{id: bytes}`` (for comparison with a store's dict)."""
        return {int(i): p for i, p in zip(self.ids, self.payload, strict=True) if p is not None}


class ReferenceTables:
    """Named ``ReferenceStore``s: the replay tables of one cluster, ids per table.

    ``default`` always exists; ``create`` adds an empty table (with its own payload limit),
    ``drop`` forgets one and its memories. ``tables[name]`` is the table's store.
    """

    DEFAULT = "default"

    def __init__(self, slots: int = 1024, max_payload_bytes: int = 4096, k_max: int = 10000):
        self.slots, self.max_payload_bytes, self.k_max = slots, max_payload_bytes, k_max
        self.tables = {self.DEFAULT: ReferenceStore(slots, max_payload_bytes, k_max)}

    def __getitem__(self, name: str) -> ReferenceStore:
        return self.tables[name or self.DEFAULT]

    def create(
        self,
        name: str,
        max_payload_bytes: int | None = None,
        capacity: int = 0,
        eviction: str = "fifo",
        forget_below: float | None = None,
    ) -> None:
        if name in self.tables:
            raise ReferenceInputError(f"table {name!r} exists")
        limit = max_payload_bytes or self.max_payload_bytes
        self.tables[name] = ReferenceStore(
            self.slots, limit, self.k_max, capacity, eviction, forget_below
        )

    def drop(self, name: str) -> None:
        if name == self.DEFAULT or name not in self.tables:
            raise ReferenceInputError(f"table {name!r} cannot be dropped")
        del self.tables[name]
