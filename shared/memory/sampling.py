"""Prioritized sampling's request checks and its draw over slots, shared by coordinator and tests.

A sample of n draws with priority exponent alpha (Schaul et al. 2016) is defined on integer
weights (``worker/store/sampling.py``): P(i) = w_i / W. The draws are made here, from the
weight sum of every slot: a seeded NumPy ``PCG64`` generator draws n integers u in [0, W)
(``Generator.integers(0, W, n, dtype=uint64)``), and each u falls in the slot whose running
sum (slots ascending) first exceeds it, at offset u minus the sums of the slots before it.
The slot's primary maps the offset to a memory (ids ascending within the slot). So the
draws depend on the seed, alpha and the store's content only: not on the workers, nor on
where rows sit, nor on the order sums were taken in.

Shape letters: S slots, K draws.
"""

from __future__ import annotations

import math

import numpy as np

from shared.memory.tables import DEFAULT_TABLE, TableNotFound
from shared.memory.validation import MemoryInputError

__all__ = [
    "DEFAULT_TABLE",
    "TableNotFound",
    "draw_slots",
    "new_seed",
    "validate_sample",
]


def validate_sample(n: object, alpha: object, max_batch: int, replacement: bool = True) -> float:
    """Check a sample request's n, alpha and replacement; return alpha as a float.

    Args:
        n: draws asked for.
        alpha: the priority exponent.
        max_batch: the largest n (``max_sample_batch``).
        replacement: False (sampling without replacement) is refused.

    Raises:
        MemoryInputError: n not an integer in [1, max_batch], alpha negative or not finite,
            or replacement False (INVALID_ARGUMENT, naming the field).
    """
    if isinstance(n, bool) or not isinstance(n, int | np.integer):
        raise MemoryInputError(f"n: {n!r} is not an integer")
    if not 1 <= int(n) <= max_batch:
        raise MemoryInputError(f"n: {n} is not in [1, {max_batch}] (max_sample_batch)")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float | np.integer | np.floating):
        raise MemoryInputError(f"alpha: {alpha!r} is not a number")
    a = float(alpha)
    if not math.isfinite(a) or a < 0:
        raise MemoryInputError(f"alpha: {a!r} must be finite and >= 0")
    if not replacement:
        raise MemoryInputError(
            "replacement: sampling without replacement is not supported; sample with "
            "replacement and drop repeated ids"
        )
    return a


def new_seed() -> int:
    """A fresh random seed in [0, 2**63) for a sample asked without one."""
    return int(np.random.SeedSequence().generate_state(1, np.uint64)[0] >> np.uint64(1))


def draw_slots(totals_S: np.ndarray, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Draw n weights of the store and locate each: its slot and its offset in the slot.

    Args:
        totals_S: [S] uint64 weight sum of every slot (0 for a slot without memories); the
            sum W must be > 0 and below 2**64.
        n: draws, >= 1.
        seed: the generator's seed (``np.random.PCG64(seed)``), >= 0.

    Returns:
        (slots [K] int64, offsets [K] uint64) with offsets[k] < totals_S[slots[k]].
    """
    cum_S = np.cumsum(totals_S, dtype=np.uint64)
    total = int(cum_S[-1])
    rng = np.random.Generator(np.random.PCG64(seed))
    u = rng.integers(0, total, size=n, dtype=np.uint64)
    slots = np.searchsorted(cum_S, u, side="right").astype(np.int64)
    offsets = u - (cum_S[slots] - totals_S[slots])
    return slots, offsets
