"""SlotWeights: per-slot prefix sums of integer sampling weights, for prioritized sampling.

Prioritized sampling (Schaul et al. 2016, "Prioritized Experience Replay") draws memory i
with probability P(i) = s_i^alpha / sum_j s_j^alpha. To make a draw exact and the same
whatever the number of workers, the order rows sit in or the order sums were taken in, the
weights are integers (docs/architecture.md, "Sampling"):

    w_i = 0                                        if s_i == 0 (as Reverb's selector)
    w_i = max(1, rint(float64(s_i) ** alpha * 2**32))  otherwise      (uint64, <= 2**32)

so P(i) = w_i / W with W = sum_j w_j, exact in any summation order (W < 2**64 for fewer
than 2**32 memories). alpha 0 gives every memory of non-zero strength the weight 2**32
(uniform over them); ``UNIFORM`` gives every memory the weight 1 (the fallback when every
weight is 0, again as Reverb).

The draws' canonical order is slot ascending, then id ascending within a slot. The
coordinator draws u in [0, W) and maps it to a slot and an offset in the slot's weight (from
each slot's total); this structure maps the offset to the memory: slot s keeps its ids in
id order with the inclusive prefix sums ``cum`` of their weights, and the memory at offset o
is the first with ``cum > o`` (``np.searchsorted(cum, o, "right")``, zero weights skipped).

Cost: the store marks a slot stale on every change to it (``mark``, the hook each
mutation calls); ``refresh`` rebuilds the stale slots asked about in one vectorized pass,
O(m log m) for their m memories (a sort by id), and a draw then costs O(log n_s) for a slot
of n_s memories. A decay marks every slot, so the sample after one re-reads the store once.
A refresh makes a *version*: the slots' arrays as they were (never mutated, only replaced),
kept for ``KEEP_VERSIONS`` refreshes, so the two phases of a sample read one state even when
writes land in between.

Shape letters: n memories of a slot, m memories rebuilt, K draws, T slots asked about.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shared.memory.validation import MemoryInputError

__all__ = [
    "KEEP_MODES",
    "KEEP_VERSIONS",
    "UNIFORM",
    "SlotWeights",
    "StaleVersion",
    "sample_weights",
]

UNIFORM: float | None = None  # the weight mode "1 per memory, whatever its strength"
WEIGHT_SCALE = float(2**32)
KEEP_VERSIONS = 8  # refreshes whose arrays phase 2 of a sample may still read
KEEP_MODES = 2  # alphas whose structure is kept

# Reads the memories of a set of slots: slots [T] int64 -> (slot [m] int64, ids [m] uint64,
# strengths [m] float32), grouped by slot in any order within a slot.
SlotReader = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


class StaleVersion(LookupError):
    """Phase 2 of a sample named a version no longer kept (ABORTED: the sample is redone)."""


def sample_weights(strengths: np.ndarray, alpha: float | None) -> np.ndarray:
    """Return the integer sampling weights of strengths (module docstring).

    Args:
        strengths: [n] float32 in [0, 1].
        alpha: the priority exponent, finite and >= 0; ``UNIFORM`` (None): 1 each.

    Returns:
        [n] uint64, each in [0, 2**32].
    """
    if alpha is None:
        return np.ones(len(strengths), np.uint64)
    s = np.asarray(strengths, np.float64)
    w = np.rint(np.power(s, alpha) * WEIGHT_SCALE)
    w = np.where(s > 0, np.maximum(w, 1.0), 0.0)
    return w.astype(np.uint64)


@dataclass(frozen=True)
class _Slot:
    """One slot at a refresh: ids [n] uint64 ascending, strengths [n] float32, cum [n] uint64."""

    ids: np.ndarray
    strengths: np.ndarray
    cum: np.ndarray

    @property
    def total(self) -> int:
        return int(self.cum[-1]) if len(self.cum) else 0


_EMPTY = _Slot(np.empty(0, np.uint64), np.empty(0, np.float32), np.empty(0, np.uint64))


@dataclass
class _Mode:
    """The structure for one alpha: which slots are stale, each slot's arrays, its version."""

    stale: np.ndarray  # [S] bool
    current: dict[int, _Slot]
    total_S: np.ndarray  # [S] uint64 each slot's weight sum in ``current`` (0: none)
    count_S: np.ndarray  # [S] int64 each slot's memories in ``current``
    version: int = 0  # the newest version made for this alpha (0: none)


class SlotWeights:
    """The per-slot sampling structure of one store, rebuilt lazily for stale slots.

    Kept for the ``KEEP_MODES`` alphas sampled last (a learner's alpha and the uniform
    fallback, say), so alternating between them does not rebuild every slot each time.
    """

    def __init__(self, slots: int) -> None:
        """Make the structure of a store of ``slots`` slots; every slot starts stale."""
        self.slots = slots
        self._modes: OrderedDict[float | None, _Mode] = OrderedDict()
        self._versions: OrderedDict[int, tuple[float | None, dict[int, _Slot]]] = OrderedDict()
        self._version = 0

    # -- hooks: every change of the store's strengths or membership calls one --------------

    def mark(self, slots: np.ndarray) -> None:
        """Mark slots [T] int64 (repeats allowed) changed: rebuilt at their next refresh."""
        for mode in self._modes.values():
            mode.stale[slots] = True

    def mark_all(self) -> None:
        """Mark every slot changed (a decay of the whole store, a reload)."""
        for mode in self._modes.values():
            mode.stale[:] = True

    # -- sampling ----------------------------------------------------------------------------

    def refresh(
        self, alpha: float | None, slots: np.ndarray, read: SlotReader
    ) -> tuple[int, np.ndarray, int]:
        """Bring slots up to date for ``alpha`` and make a version of them.

        Args:
            alpha: the priority exponent (validated by the caller) or ``UNIFORM``.
            slots: [T] int64 distinct slots asked about (a worker's primary slots).
            read: reads the memories of the stale ones (``SlotReader``).

        Returns:
            (version, totals [T] uint64 the slots' weight sums, memories in the slots).
        """
        mode = self._modes.get(alpha)
        if mode is None:
            mode = self._modes[alpha] = _Mode(
                np.ones(self.slots, bool),
                {},
                np.zeros(self.slots, np.uint64),
                np.zeros(self.slots, np.int64),
            )
            while len(self._modes) > KEEP_MODES:
                self._modes.popitem(last=False)
        self._modes.move_to_end(alpha)
        stale = slots[mode.stale[slots]]
        if len(stale) or mode.version not in self._versions:
            self._rebuild(alpha, mode, stale, read)
            self._version += 1
            mode.version = self._version
            self._versions[self._version] = (alpha, dict(mode.current))
            while len(self._versions) > KEEP_VERSIONS:
                self._versions.popitem(last=False)
        return mode.version, mode.total_S[slots], int(mode.count_S[slots].sum())

    def _rebuild(
        self, alpha: float | None, mode: _Mode, stale: np.ndarray, read: SlotReader
    ) -> None:
        """Recompute the stale slots' arrays in one pass; replaces them, never mutates."""
        slot_m, ids_m, strengths_m = read(stale)
        order = np.lexsort((ids_m, slot_m))
        slot_m, ids_m, strengths_m = slot_m[order], ids_m[order], strengths_m[order]
        cum_m = np.cumsum(sample_weights(strengths_m, alpha), dtype=np.uint64)
        bounds = (
            np.searchsorted(slot_m, stale, side="left"),
            np.searchsorted(slot_m, stale, side="right"),
        )
        for s, a, b in zip(stale.tolist(), bounds[0].tolist(), bounds[1].tolist(), strict=True):
            if a == b:
                mode.current.pop(s, None)
                continue
            before = cum_m[a - 1] if a else np.uint64(0)
            mode.current[s] = _Slot(ids_m[a:b], strengths_m[a:b], cum_m[a:b] - before)
        # Each rebuilt slot's sum and count, for refresh's answer without a loop over slots.
        mode.total_S[stale] = 0
        mode.count_S[stale] = 0
        lo, hi = np.asarray(bounds[0], np.int64), np.asarray(bounds[1], np.int64)
        full = hi > lo
        if full.any():
            last = cum_m[hi[full] - 1]
            first = np.where(lo[full] > 0, cum_m[np.maximum(lo[full] - 1, 0)], np.uint64(0))
            mode.total_S[stale[full]] = last - first
            mode.count_S[stale[full]] = hi[full] - lo[full]
        mode.stale[stale] = False

    def pick(
        self, version: int, slots: np.ndarray, offsets: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Map draws (slot, offset in the slot's weight) to memories, as of ``version``.

        Args:
            version: a version ``refresh`` returned.
            slots: [K] int64 slot of each draw.
            offsets: [K] uint64 offset of each draw, below its slot's total at ``version``.

        Returns:
            (ids [K] uint64, strengths [K] float32, weights [K] uint64) of the drawn memories.

        Raises:
            StaleVersion: ``version`` is no longer kept (ABORTED).
            MemoryInputError: an offset at or past its slot's total (INVALID_ARGUMENT).
        """
        kept = self._versions.get(version)
        if kept is None:
            raise StaleVersion(f"sampling version {version} is no longer kept; sample again")
        alpha, views = kept
        if len(slots) == 0:
            return np.empty(0, np.uint64), np.empty(0, np.float32), np.empty(0, np.uint64)
        # One search for every draw: the drawn slots' prefix sums laid end to end, each
        # shifted by the weight of the slots before it (so the whole stays ascending), and
        # each draw's offset shifted by its slot's shift. A per-slot search cost ~10 NumPy
        # calls per drawn slot.
        uniq, inverse = np.unique(slots, return_inverse=True)
        drawn = [views.get(s, _EMPTY) for s in uniq.tolist()]
        totals = np.fromiter((v.total for v in drawn), np.uint64, len(drawn))
        over = offsets.astype(np.uint64) >= totals[inverse]
        if over.any():
            bad = int(slots[int(np.argmax(over))])
            raise MemoryInputError(f"offsets: one of slot {bad} is past its sum")
        shift = np.cumsum(totals, dtype=np.uint64) - totals
        lengths = np.fromiter((len(v.ids) for v in drawn), np.int64, len(drawn))
        cum = np.concatenate([v.cum for v in drawn]) + np.repeat(shift, lengths)
        at = np.searchsorted(cum, offsets.astype(np.uint64) + shift[inverse], side="right")
        ids = np.concatenate([v.ids for v in drawn])[at]
        strengths = np.concatenate([v.strengths for v in drawn])[at]
        return ids, strengths, sample_weights(strengths, alpha)
