"""ReferenceStore: the single-process NumPy model the memory-store invariant is checked against.

The invariant (DESIGN.md, "Memory store"): for any sequence of operations and any number of
workers, the cluster's ``{id: strength}`` equals this reference bit for bit (float32).

The reference is deliberately plain: one array of ids sorted by id, the strengths and the
payloads (an object array) aligned with it, no slots, no keys, no device. It validates with
the store's functions and changes strengths only through ``worker/kernels.py``, so a
mismatch points at routing, slotting, replication or migration, not at arithmetic. Slot
numbers are only used to select the rows of ``decay``/``quality``/``topk`` slot sets.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shared.memory.slots import slot_of
from shared.memory.stats import Quality
from shared.memory.validation import (
    as_ids,
    as_slots,
    validate_k,
    validate_rate,
    validate_reinforce,
    validate_upsert,
)
from worker import kernels


class ReferenceStore:
    """All memories in one process, sorted by id; same method names as ``SlotStore``."""

    def __init__(self, slots: int = 1024, max_payload_bytes: int = 4096, k_max: int = 10000):
        self.slots = slots
        self.max_payload_bytes = max_payload_bytes
        self.k_max = k_max
        self.ids = np.empty(0, np.uint64)
        self.strength = np.empty(0, np.float32)
        self.payload = np.empty(0, object)  # bytes, or None for no payload

    def _rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(rows, found)`` of ids in the sorted id array."""
        rows = np.searchsorted(self.ids, ids)
        found = rows < len(self.ids)
        found[found] = self.ids[rows[found]] == ids[found]
        return rows, found

    def _mask(self, slots: Sequence[int] | np.ndarray | None) -> np.ndarray:
        if slots is None:
            return np.ones(len(self.ids), bool)
        return np.isin(slot_of(self.ids, self.slots), as_slots(slots, self.slots))

    def upsert(self, ids, strengths, payloads=None) -> int:
        """Insert or overwrite; the last occurrence of an id in the batch wins."""
        ids, strengths, payloads = validate_upsert(ids, strengths, payloads, self.max_payload_bytes)
        # The last occurrence of each distinct id: first occurrence in the reversed batch.
        last = len(ids) - 1 - np.unique(ids[::-1], return_index=True)[1]
        new_ids = np.setdiff1d(ids[last], self.ids)
        self.ids = np.concatenate([self.ids, new_ids])
        self.strength = np.concatenate([self.strength, np.zeros(len(new_ids), np.float32)])
        self.payload = np.concatenate([self.payload, np.full(len(new_ids), None, object)])
        order = np.argsort(self.ids)
        self.ids, self.strength, self.payload = (
            self.ids[order],
            self.strength[order],
            self.payload[order],
        )
        rows = np.searchsorted(self.ids, ids[last])
        self.strength[rows] = strengths[last]
        if payloads is not None:
            for row, i in zip(rows.tolist(), last.tolist(), strict=True):
                if payloads[i] is not None:
                    self.payload[row] = bytes(payloads[i]) if len(payloads[i]) else None
        return len(np.unique(ids))

    def get(self, ids) -> tuple[np.ndarray, np.ndarray, list[bytes | None]]:
        """Return ``(found, strengths (0 where missing), payloads)``."""
        ids = as_ids(ids)
        rows, found = self._rows(ids)
        strengths = np.zeros(len(ids), np.float32)
        strengths[found] = self.strength[rows[found]]
        payloads = [self.payload[r] if f else None for r, f in zip(rows, found, strict=True)]
        return found, strengths, payloads

    def delete(self, ids) -> int:
        """Delete by id; return the number of distinct ids found."""
        ids = as_ids(ids)
        gone = np.isin(self.ids, ids)
        self.ids, self.strength = self.ids[~gone], self.strength[~gone]
        self.payload = self.payload[~gone]
        return int(gone.sum())

    def reinforce(self, ids, boosts) -> int:
        """Reinforce present ids via ``kernels.reinforce``; return the batch items found."""
        ids, boosts = validate_reinforce(ids, boosts)
        rows, found = self._rows(ids)
        kernels.reinforce(self.strength, rows[found], boosts[found])
        return int(found.sum())

    def decay(self, rate, slots=None) -> int:
        """Decay the memories of a slot set (None: all) via ``kernels.decay``."""
        rate = validate_rate(rate)
        mask = self._mask(slots)
        chosen = self.strength[mask]
        kernels.decay(chosen, rate)
        self.strength[mask] = chosen
        return int(mask.sum())

    def quality(self, slots=None) -> Quality:
        """Summary of a slot set's strengths via ``kernels.quality``."""
        return kernels.quality(self.strength[self._mask(slots)])

    def topk(self, k, slots=None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k of a slot set via ``kernels.topk``."""
        k = validate_k(k, self.k_max)
        mask = self._mask(slots)
        return kernels.topk(self.strength[mask], self.ids[mask], k)

    def count(self, slots=None) -> int:
        return int(self._mask(slots).sum())

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(ids, strengths)`` sorted by id (copies)."""
        return self.ids.copy(), self.strength.copy()

    def payloads(self) -> dict[int, bytes]:
        """Return the payloads as ``{id: bytes}`` (for comparison with a store's dict)."""
        return {int(i): p for i, p in zip(self.ids, self.payload, strict=True) if p is not None}
