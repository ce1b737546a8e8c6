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
from collections.abc import Sequence
from typing import Any

import numpy as np

from shared.memory.tables import DEFAULT_TABLE, TableNotFound
from shared.memory.validation import MemoryInputError
from shared.rpc.codec import f32_from_bytes, ids_from_bytes

__all__ = [
    "DEFAULT_TABLE",
    "TableNotFound",
    "draw_slots",
    "gather_picks",
    "new_seed",
    "slot_sums",
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


def slot_sums(replies: Sequence[Any], slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Phase 1's answers (``WorkerSampleSumsResponse``, one per primary) as per-slot arrays.

    Args:
        replies: each primary's answer, in the order its index is to name it: ``slots``
            (its primary slots) and ``totals`` ([s] uint64 little-endian bytes).
        slots: S, the map's slot count.

    Returns:
        (totals_S [S] uint64, 0 for a slot no primary answered; owner_S [S] int64, the index
        into ``replies`` of each slot's primary, -1 for none).

    Raises:
        CodecError: a reply's ``totals`` is not whole uint64s (INTERNAL: a worker sent it).
    """
    totals_S = np.zeros(slots, np.uint64)
    owner_S = np.full(slots, -1, np.int64)
    for i, r in enumerate(replies):
        held = np.asarray(r.slots, np.int64)
        totals_S[held] = ids_from_bytes(r.totals, "totals")
        owner_S[held] = i
    return totals_S, owner_S


def gather_picks(
    n: int, parts: Sequence[tuple[np.ndarray, Any]], with_payloads: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[bytes]]:
    """Phase 2's answers (``WorkerSamplePickResponse``) put back in draw order.

    Args:
        n: K, the draws.
        parts: (draws [k] int64, the primary's answer to those draws) per primary asked;
            the draws of all parts are 0 .. K-1, each once.
        with_payloads: the answers carry payloads.

    Returns:
        (ids [K] uint64, strengths [K] float32, weights [K] uint64, payloads: K bytes, b""
        for none or when ``with_payloads`` is False).

    Raises:
        CodecError: an answer's arrays are not whole elements (INTERNAL).
    """
    ids = np.empty(n, np.uint64)
    strengths = np.empty(n, np.float32)
    weights = np.empty(n, np.uint64)
    payloads = [b""] * n
    for draws, r in parts:
        ids[draws] = ids_from_bytes(r.ids)
        strengths[draws] = f32_from_bytes(r.strengths, "strengths")
        weights[draws] = ids_from_bytes(r.weights, "weights")
        if with_payloads:
            for j, p in zip(draws.tolist(), r.payloads, strict=True):
                payloads[j] = p
    return ids, strengths, weights, payloads
