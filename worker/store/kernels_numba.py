"""Compiled CPU loops behind ``worker/store/kernels.py`` and ``worker/store/store.py`` (numba).

Importing this module needs numba; ``worker.store.kernels`` falls back to its NumPy-API paths
without it. Every loop does the same float32 operations as the NumPy path it replaces, so
results are bit-identical (tested in tests/unit/worker/store/test_kernels.py).

Only ``decay_fused`` is parallel, for a whole large array (the kernel benchmark's case). The
loops over *runs* (the row ranges of a slot set, ``starts[r]:ends[r]``) are serial and release
the GIL: a worker shares the CPU with the other daemons (bench-memory runs 3 workers and a
coordinator on 2 cores), and a parallel region then waits until every one of its threads is
scheduled; measured on 673k strengths under load ~4: 7.6 ms median parallel, 0.1 ms serial.

``sweep_runs`` is the memory iteration's fused pass: decay, statistics and top-k candidates
block by block while each block is in cache; ``quality_runs`` reads the same blocks, so both
give the same float64 sum.

Shape letters: N rows, R runs, M sorted keys looked up, C top-k candidates, E edges.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np

F = TypeVar("F", bound=Callable[..., Any])


def _njit(**options: Any) -> Callable[[F], F]:
    """``numba.njit(**options)`` typed for mypy: a compiled function keeps its signature.

    numba ignores the annotations (it compiles for the argument types of each call).
    """
    return cast(Callable[[F], F], numba.njit(**options))


@_njit(parallel=True, cache=True)
def decay_fused(strength: np.ndarray, rate: np.float32) -> None:  # pragma: no cover - compiled
    """``s = clip(s - rate, 0, 1)`` over a whole [N] float32 array, rate float32."""
    for i in numba.prange(strength.shape[0]):
        v = strength[i] - rate
        # Same comparisons as np.clip (max then min), so results are bit-identical.
        if v < 0:
            v = np.float32(0.0)
        if v > 1:
            v = np.float32(1.0)
        strength[i] = v


@_njit(cache=True, nogil=True)
def _decay_slice(x: np.ndarray, rate: np.float32) -> None:  # pragma: no cover - compiled
    # A loop from 0 over a slice: LLVM sees non-negative indices and vectorizes it.
    for i in range(x.shape[0]):
        v = x[i] - rate
        if v < 0:
            v = np.float32(0.0)
        if v > 1:
            v = np.float32(1.0)
        x[i] = v


@_njit(cache=True, nogil=True)
def decay_runs(  # pragma: no cover - compiled
    strength: np.ndarray, starts: np.ndarray, ends: np.ndarray, rate: np.float32
) -> None:
    """``s = clip(s - rate, 0, 1)`` over the rows of R runs (starts, ends [R] int64)."""
    for r in range(starts.shape[0]):
        _decay_slice(strength[starts[r] : ends[r]], rate)


@_njit(cache=True, nogil=True)
def _count_at_least(  # pragma: no cover - compiled
    x: np.ndarray, edges: np.ndarray, at_least: np.ndarray
) -> None:
    # One pass per edge with a plain counter: vectorizes (a per-row bin lookup and
    # increment does not, and measured 2.5x slower).
    for e in range(edges.shape[0]):
        edge, c = edges[e], 0
        for i in range(x.shape[0]):
            c += x[i] >= edge
        at_least[e] += c


@_njit(cache=True, nogil=True, fastmath=True)
def _sum(x: np.ndarray) -> float:  # pragma: no cover - compiled
    # fastmath lets LLVM reassociate (vectorize) the float64 sum, 17x faster; the sum is
    # only promised approximately (kernels.quality_runs).
    total = 0.0
    for i in range(x.shape[0]):
        total += np.float64(x[i])
    return total


@_njit(cache=True, nogil=True)
def _min_max_bits(b: np.ndarray) -> tuple[np.int32, np.int32]:  # pragma: no cover - compiled
    # On int32 bit patterns: LLVM vectorizes integer min/max but not float ones (15x).
    lo, hi = np.int32(0x7FFFFFFF), np.int32(-0x80000000)
    for i in range(b.shape[0]):
        lo = min(lo, b[i])
        hi = max(hi, b[i])
    return lo, hi


# Rows per block of a sweep: 32 KiB of float32, which stays in L1/L2 between the decay and
# the statistics' passes over it.
SWEEP_BLOCK = 8192


@_njit(cache=True, nogil=True)
def quality_runs(  # pragma: no cover - compiled
    strength: np.ndarray,
    bits: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    inner_edges: np.ndarray,
) -> tuple[int, float, np.int32, np.int32, np.ndarray]:
    """Strength statistics of R runs: ``(count, float64 sum, min bits, max bits, at_least)``.

    Block by block (``SWEEP_BLOCK`` rows), as :func:`sweep_runs` reads them, so the two give
    the same float64 sum bit for bit.

    Args:
        strength: [N] float32, finite and >= 0 (every stored strength is in [0, 1]).
        bits: [N] int32, ``strength.view(np.int32)``: for non-negative floats the IEEE 754
            bit patterns order as the values, so min/max run on integers.
        starts: [R] int64, first row of each run.
        ends: [R] int64, end (exclusive) of each run.
        inner_edges: [E] float32 histogram edges; ``at_least`` [E] int64 counts
            ``s >= inner_edges[e]``, from which ``kernels.quality`` derives the histogram.
    """
    at_least = np.zeros(inner_edges.shape[0], np.int64)
    lo, hi = np.int32(0x7FFFFFFF), np.int32(-0x80000000)
    total, count = 0.0, 0
    for r in range(starts.shape[0]):
        for a in range(starts[r], ends[r], SWEEP_BLOCK):
            b = min(a + SWEEP_BLOCK, ends[r])
            total, lo, hi = _stats_block(strength, bits, a, b, inner_edges, at_least, total, lo, hi)
        count += ends[r] - starts[r]
    return count, total, lo, hi, at_least


@_njit(cache=True, nogil=True, inline="always")
def _stats_block(  # pragma: no cover - compiled
    strength: np.ndarray,
    bits: np.ndarray,
    a: int,
    b: int,
    inner_edges: np.ndarray,
    at_least: np.ndarray,
    total: float,
    lo: np.int32,
    hi: np.int32,
) -> tuple[float, np.int32, np.int32]:
    """Add rows ``a:b`` to the running statistics; return the new (sum, min bits, max bits)."""
    _count_at_least(strength[a:b], inner_edges, at_least)
    total += _sum(strength[a:b])
    block_lo, block_hi = _min_max_bits(bits[a:b])
    return total, min(lo, block_lo), max(hi, block_hi)


@_njit(cache=True, nogil=True)
def sweep_runs(  # pragma: no cover - compiled
    strength: np.ndarray,
    bits: np.ndarray,
    ids: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    rate: np.float32,
    decay: bool,
    inner_edges: np.ndarray,
    want_quality: bool,
    k: int,
) -> tuple[int, float, np.int32, np.int32, np.ndarray, np.ndarray]:
    """One pass over R runs: decay, then the statistics and the top-k candidates.

    Each block of ``SWEEP_BLOCK`` rows is decayed (``decay``: ``s = clip(s - rate, 0, 1)``
    as :func:`decay_runs`), then, while it is in cache, added to the statistics (as
    :func:`quality_runs`, the same blocks, so the same sum) and offered to the top-k heap (as
    :func:`topk_runs`). The results equal decay_runs then quality_runs / topk_runs exactly.

    Args:
        strength: [N] float32 in [0, 1], updated in place when ``decay``.
        bits: [N] int32, ``strength.view(np.int32)``.
        ids: [N] uint64, distinct.
        starts: [R] int64, first row of each run.
        ends: [R] int64, end (exclusive) of each run.
        rate: float32 in [0, 1].
        decay: apply the decay (else only read).
        inner_edges: [E] float32, as for :func:`quality_runs`.
        want_quality: compute the statistics (else ``at_least`` stays 0 and sum 0).
        k: top-k size, <= the rows of the runs; 0: no top-k.

    Returns:
        ``(count, sum, min bits, max bits, at_least [E] int64, rows [k] int64 in no order)``.
    """
    at_least = np.zeros(inner_edges.shape[0], np.int64)
    lo, hi = np.int32(0x7FFFFFFF), np.int32(-0x80000000)
    total, count = 0.0, 0
    hv = np.empty(k, np.float32)
    hi_ = np.empty(k, np.uint64)
    hr = np.empty(k, np.int64)
    size = 0
    for r in range(starts.shape[0]):
        for a in range(starts[r], ends[r], SWEEP_BLOCK):
            b = min(a + SWEEP_BLOCK, ends[r])
            if decay:
                _decay_slice(strength[a:b], rate)
            if want_quality:
                total, lo, hi = _stats_block(
                    strength, bits, a, b, inner_edges, at_least, total, lo, hi
                )
            if k > 0:
                size = _heap_rows(hv, hi_, hr, size, strength, ids, a, b)
        count += ends[r] - starts[r]
    return count, total, lo, hi, at_least, hr[:size].copy()


@_njit(cache=True, nogil=True, inline="always")
def _worse(va: float, ia: int, vb: float, ib: int) -> bool:  # pragma: no cover - compiled
    """Whether (va, ia) ranks below (vb, ib): lower strength, or equal and larger id."""
    return va < vb or (va == vb and ia > ib)


@_njit(cache=True, nogil=True)
def topk_runs(  # pragma: no cover - compiled
    strength: np.ndarray, ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, k: int
) -> np.ndarray:
    """Rows of the k best memories of R runs (strength desc, then id asc), in no order.

    A binary heap of the k best so far with the worst at the root: a row enters when it
    beats the root; O(N log k) however the strengths are ordered, and one comparison per
    row once the heap holds strong rows. Exact because ids are distinct.
    """
    hv = np.empty(k, np.float32)
    hi = np.empty(k, np.uint64)
    hr = np.empty(k, np.int64)
    size = 0
    for r in range(starts.shape[0]):
        size = _heap_rows(hv, hi, hr, size, strength, ids, starts[r], ends[r])
    return hr[:size].copy()


@_njit(cache=True, nogil=True)
def _heap_rows(  # pragma: no cover - compiled
    hv: np.ndarray,
    hi: np.ndarray,
    hr: np.ndarray,
    size: int,
    strength: np.ndarray,
    ids: np.ndarray,
    a: int,
    b: int,
) -> int:
    """Offer rows ``a:b`` to the heap (values hv, ids hi, rows hr, [k] each); return its size."""
    k = hv.shape[0]
    for row in range(a, b):
        v = strength[row]
        if size == k and v < hv[0]:  # the common case: weaker than the worst kept
            continue
        d = ids[row]
        if size < k:  # sift up from the new leaf
            j = size
            size += 1
            while j > 0:
                p = (j - 1) >> 1
                if not _worse(v, d, hv[p], hi[p]):
                    break
                hv[j], hi[j], hr[j] = hv[p], hi[p], hr[p]
                j = p
        elif _worse(hv[0], hi[0], v, d):  # replace the root, sift down
            j = 0
            while True:
                c = 2 * j + 1
                if c >= size:
                    break
                if c + 1 < size and _worse(hv[c + 1], hi[c + 1], hv[c], hi[c]):
                    c += 1
                if not _worse(hv[c], hi[c], v, d):
                    break
                hv[j], hi[j], hr[j] = hv[c], hi[c], hr[c]
                j = c
        else:
            continue
        hv[j], hi[j], hr[j] = v, d, row
    return size


@_njit(cache=True, nogil=True)
def locate_sorted(  # pragma: no cover - compiled
    keys: np.ndarray, needles: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ascending needles [M] uint64 in ascending keys [N] uint64.

    Returns ``(rows [M] int64, found [M] bool)`` with rows as ``np.searchsorted(keys,
    needles)`` gives them. Each search gallops from the previous row (1, 2, 4, ... rows
    ahead) and then bisects, so it touches memory near the last hit: about twice as fast
    as ``np.searchsorted`` with sorted needles for 30k among 673k keys.
    """
    n, m = keys.shape[0], needles.shape[0]
    rows = np.empty(m, np.int64)
    found = np.zeros(m, np.bool_)
    lo = 0
    for j in range(m):
        x = needles[j]
        hi, step = lo, 1
        while hi < n and keys[hi] < x:
            lo = hi + 1
            hi += step
            step <<= 1
        hi = min(hi, n)
        while lo < hi:
            mid = (lo + hi) >> 1
            if keys[mid] < x:
                lo = mid + 1
            else:
                hi = mid
        rows[j] = lo
        found[j] = lo < n and keys[lo] == x
    return rows, found


@_njit(cache=True, nogil=True)
def add_clip(  # pragma: no cover - compiled
    strength: np.ndarray, rows: np.ndarray, sums: np.ndarray
) -> None:
    """``s[rows] = clip(s[rows] + sums, 0, 1)`` in float32 for distinct rows [U] int64."""
    for j in range(rows.shape[0]):
        v = strength[rows[j]] + sums[j]
        if v < 0:
            v = np.float32(0.0)
        if v > 1:
            v = np.float32(1.0)
        strength[rows[j]] = v


@_njit(cache=True, nogil=True)
def insert_rows(  # pragma: no cover - compiled
    old: np.ndarray, new: np.ndarray, at: np.ndarray, out: np.ndarray
) -> None:
    """Fill ``out`` [N + K] with ``old`` [N] and ``new`` [K] inserted before rows ``at``.

    ``at`` is [K] int64, ascending, as ``np.searchsorted(old_keys, new_keys)`` gives it: one
    pass of slice copies instead of masked scatters. ``out`` comes from NumPy, whose large
    allocations fault in faster (huge pages) than numba's: 22 vs 40 ms for 6.7M uint64.
    """
    src = 0
    for j in range(new.shape[0]):
        a = at[j]
        out[src + j : a + j] = old[src:a]
        out[a + j] = new[j]
        src = a
    out[src + new.shape[0] :] = old[src:]
