"""Vectorized memory-store kernels: decay, reinforce, quality and top-k.

Every kernel takes arrays of the module ``xp`` they live in (NumPy on a CPU, CuPy on a GPU)
and uses only the NumPy-compatible API, so one function serves both. Strengths live on the
device; ids, rows and boosts are small host (NumPy) arrays and control logic stays on host.

On NumPy, :func:`decay` runs a fused ``numba.njit(parallel=True)`` loop (one pass over
memory, 4-6x faster than blocked NumPy at 10M on a 2-core VM; see
``tests/benchmarks/bench_kernels.py``); :func:`decay_xp` is the portable path, used on CuPy
and when numba is missing, and gives bit-identical results (tested).

The ``*_runs`` kernels work on a slot set of a store: R runs of rows ``starts[r]:ends[r]``.
On NumPy they are one serial compiled pass over all runs (``worker/store/kernels_numba.py``);
elsewhere they apply the whole-array kernels run by run and merge.

Shape letters: N memories, K batch items, U distinct rows, C top-k candidates, R runs.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

import numpy as np

from shared.memory.stats import EMPTY_QUALITY, HIST_BINS, Quality, merge_quality, merge_topk

try:  # optional GPU path
    import cupy as _cupy
except ImportError:  # pragma: no cover - no CUDA in CI
    _cupy = None

try:
    from worker.store import kernels_numba as _nb
except ImportError:  # pragma: no cover - numba is a declared dependency
    _nb = None  # type: ignore[assignment]

DECAY_BLOCK = 1 << 16  # elements: 256 KiB of float32, stays in L2 between subtract and clip
_NUMBA_MIN = 1 << 15  # below this, thread start-up outweighs the fused loop's gain
# numba's "workqueue" threading layer aborts on concurrent launches; a lock keeps us safe
# on any layer and costs nothing for a memory-bound loop.
_NUMBA_LOCK = threading.Lock()


def get_xp(device: str = "auto") -> tuple[ModuleType, str]:
    """Resolve a device setting to an array module and a device name.

    Args:
        device: "cpu" (NumPy), "cuda" (CuPy, device 0) or "auto" (CUDA when available).

    Returns:
        ``(xp, name)``: ``(numpy, "cpu")`` or ``(cupy, "cuda:0")``.

    Raises:
        RuntimeError: "cuda" asked for but CuPy or a CUDA device is missing.
        ValueError: unknown device.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device: {device!r} is not one of 'auto', 'cpu', 'cuda'")
    if device == "cpu":
        return np, "cpu"
    if _cupy is not None:
        try:
            if _cupy.cuda.runtime.getDeviceCount() > 0:
                return _cupy, "cuda:0"
        except _cupy.cuda.runtime.CUDARuntimeError:
            pass
    if device == "cuda":
        raise RuntimeError("device: 'cuda' requested but CuPy or a CUDA device is missing")
    return np, "cpu"


def array_module(a: Any) -> ModuleType:
    """Return the array module (numpy or cupy) an array belongs to."""
    return _cupy.get_array_module(a) if _cupy is not None else np


def to_host(a: Any) -> np.ndarray:
    """Return a NumPy copy-or-view of a NumPy or CuPy array."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def decay_xp(strength: Any, rate: float, block: int = DECAY_BLOCK) -> None:
    """Portable decay: ``s = clip(s - rate, 0, 1)`` with NumPy-API calls, block by block.

    Each block is subtracted then clipped while it is still in cache, which halves the
    memory traffic of two whole-array passes.

    Args:
        strength: [N] float32 on any device, updated in place.
        rate: decay per call, in [0, 1] (cast to float32).
        block: elements per block.
    """
    xp = array_module(strength)
    r = np.float32(rate)
    step = block if xp is np else max(len(strength), 1)  # a GPU has no cache to chase
    for start in range(0, len(strength), step):
        part = strength[start : start + step]
        xp.subtract(part, r, out=part)
        xp.clip(part, np.float32(0), np.float32(1), out=part)


def decay(strength: Any, rate: float) -> None:
    """Decay strengths in place: ``s = clip(s - rate, 0, 1)`` in float32.

    Args:
        strength: [N] float32, NumPy or CuPy, updated in place.
        rate: decay per call, in [0, 1] (validated by the caller; cast to float32).
    """
    fused_ok = (
        _nb is not None
        and isinstance(strength, np.ndarray)
        and len(strength) >= _NUMBA_MIN
        and strength.flags.c_contiguous
        and strength.dtype == np.float32
    )
    if fused_ok:
        with _NUMBA_LOCK:
            _nb.decay_fused(strength, np.float32(rate))
    else:
        decay_xp(strength, rate)


def _compiled(strength: Any) -> bool:
    """Whether the numba loops apply: a contiguous float32 NumPy array and numba present."""
    return (
        _nb is not None
        and isinstance(strength, np.ndarray)
        and strength.dtype == np.float32
        and strength.flags.c_contiguous
    )


def _pairs(starts: np.ndarray, ends: np.ndarray) -> list[tuple[int, int]]:
    return list(zip(np.asarray(starts).tolist(), np.asarray(ends).tolist(), strict=True))


def decay_runs(strength: Any, starts: np.ndarray, ends: np.ndarray, rate: float) -> None:
    """Decay the rows of R runs in place: ``s = clip(s - rate, 0, 1)``, as :func:`decay`.

    Args:
        strength: [N] float32, NumPy or CuPy, updated in place.
        starts: [R] int64 host, first row of each run.
        ends: [R] int64 host, end (exclusive) of each run: rows ``starts[r]:ends[r]``.
        rate: decay per call, in [0, 1] (validated by the caller; cast to float32).
    """
    if _compiled(strength):
        _nb.decay_runs(strength, _i64(starts), _i64(ends), np.float32(rate))
        return
    for start, end in _pairs(starts, ends):
        decay(strength[start:end], rate)


def _i64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def row_sums(rows: np.ndarray, boosts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum boosts per distinct row, deterministically.

    ``np.bincount`` adds the weights of one row sequentially in batch order in float64. A
    row's sum therefore depends only on the sequence of its own boosts, so a batch applied
    whole or split by slot (keeping per-id order) gives the same sums bit for bit; on a GPU
    atomics would make the order racy, hence this runs on host.

    Args:
        rows: [K] int64 host row indices, duplicates allowed.
        boosts: [K] float32 host.

    Returns:
        ``(unique_rows, sums)``: [U] int64 ascending and [U] float32 (float64 sums rounded once).
    """
    unique_rows, inverse = np.unique(np.asarray(rows, dtype=np.int64), return_inverse=True)
    sums = np.bincount(inverse.ravel(), weights=np.asarray(boosts, dtype=np.float64))
    return unique_rows, sums.astype(np.float32)


def reinforce(strength: Any, rows: np.ndarray, boosts: np.ndarray) -> None:
    """Add boosts to the strengths at rows, summing duplicate rows, then clamp to [0, 1].

    Args:
        strength: [N] float32, NumPy or CuPy, updated in place.
        rows: [K] int64 host row indices into strength; duplicates allowed.
        boosts: [K] float32 host, finite and >= 0.
    """
    unique_rows, sums = row_sums(rows, boosts)
    add_sums(strength, unique_rows, sums)


def locate_sorted(keys: np.ndarray, needles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Find ascending needles in ascending keys (host arrays of one integer dtype).

    Returns:
        ``(rows [M] int64, found [M] bool)``: rows as ``np.searchsorted(keys, needles)``;
        ``found`` where ``keys[rows] == needles``.
    """
    if _nb is not None and keys.dtype == np.uint64 and needles.dtype == np.uint64:
        return _nb.locate_sorted(np.ascontiguousarray(keys), np.ascontiguousarray(needles))
    rows = np.searchsorted(keys, needles)
    found = np.zeros(len(needles), bool)
    inside = rows < len(keys)
    found[inside] = keys[rows[inside]] == needles[inside]
    return rows, found


def insert_rows(old: Any, new: np.ndarray, at: np.ndarray) -> Any:
    """Return ``old`` [N] with ``new`` [K] inserted before rows ``at`` [K] int64.

    ``at`` is ascending, as ``np.searchsorted`` of the new keys in the old keys gives it;
    new[j] lands at row ``at[j] + j`` of the result. ``old`` may live on the device (new
    and at are host arrays).
    """
    if _nb is not None and isinstance(old, np.ndarray) and old.flags.c_contiguous:
        out = np.empty(len(old) + len(new), old.dtype)
        _nb.insert_rows(old, np.ascontiguousarray(new, dtype=old.dtype), _i64(at), out)
        return out
    xp = array_module(old)
    dest = np.asarray(at, np.int64) + np.arange(len(at))
    keep = np.ones(len(old) + len(new), bool)
    keep[dest] = False
    out = xp.empty(len(keep), dtype=old.dtype)
    out[xp.asarray(keep)] = old
    out[xp.asarray(dest)] = xp.asarray(new)
    return out


def add_sums(strength: Any, rows: np.ndarray, sums: np.ndarray) -> None:
    """Add per-row sums and clamp: ``s[rows] = clip(s[rows] + sums, 0, 1)`` in float32.

    Args:
        strength: [N] float32, NumPy or CuPy, updated in place.
        rows: [U] int64 host, distinct row indices.
        sums: [U] float32 host, e.g. from :func:`row_sums`.
    """
    if len(rows) == 0:
        return
    if _compiled(strength):
        _nb.add_clip(strength, _i64(rows), np.ascontiguousarray(sums, dtype=np.float32))
        return
    xp = array_module(strength)
    rows_d = xp.asarray(rows)
    values = strength[rows_d]
    values += xp.asarray(sums)
    xp.clip(values, np.float32(0), np.float32(1), out=values)
    strength[rows_d] = values


# Bin edges as NumPy's histogram builds them for float32 data (float32(k / 10)), so a strength
# written as 0.7 counts in [0.7, 0.8) although float32(0.7) is a hair below 7/10.
_EDGES = np.linspace(0.0, 1.0, HIST_BINS + 1).astype(np.float32)
_INNER_EDGES = _EDGES[1:-1].copy()


def quality(strength: Any) -> Quality:
    """Compute count, sum, mean, min, max and the 10-bin histogram of strengths.

    The histogram equals ``np.histogram(s, bins=10, range=(0, 1))`` for float32 s in [0, 1]:
    bin k holds ``edge[k] <= s < edge[k + 1]``, edges float32(k / 10), the last bin closed.
    It is computed as differences of ``count(s >= edge)``: nine compare-and-count passes,
    faster than a search per element and exact on every device.

    Args:
        strength: [N] float32, NumPy or CuPy, values in [0, 1].
    """
    xp = array_module(strength)
    n = len(strength)
    if n == 0:
        return EMPTY_QUALITY
    at_least = [n] + [int(xp.count_nonzero(strength >= e)) for e in _EDGES[1:-1]] + [0]
    hist = -np.diff(np.array(at_least, dtype=np.int64))
    total = float(xp.sum(strength, dtype=xp.float64))
    return Quality(
        count=n,
        sum=total,
        mean=total / n,
        min=float(strength.min()),
        max=float(strength.max()),
        histogram=tuple(int(c) for c in hist),
    )


def quality_runs(strength: Any, starts: np.ndarray, ends: np.ndarray) -> Quality:
    """:func:`quality` of the rows of R runs (starts, ends [R] int64 host).

    Count, min, max and histogram equal :func:`quality` of the runs' concatenation exactly
    (for strengths in [0, 1], as a store holds); the float64 sum is added in another order,
    so it may differ in the last bits.
    """
    if not _compiled(strength):
        return merge_quality([quality(strength[a:b]) for a, b in _pairs(starts, ends)])
    n, total, lo, hi, at_least = _nb.quality_runs(
        strength, strength.view(np.int32), _i64(starts), _i64(ends), _INNER_EDGES
    )
    return _quality_of(n, total, lo, hi, at_least)


def _quality_of(n: int, total: float, lo: Any, hi: Any, at_least: np.ndarray) -> Quality:
    """The ``Quality`` of a compiled pass's figures (lo/hi: min/max as int32 bit patterns)."""
    if n == 0:
        return EMPTY_QUALITY
    hist = -np.diff(np.concatenate([[n], at_least, [0]]).astype(np.int64))
    return Quality(
        count=int(n),
        sum=float(total),
        mean=float(total) / int(n),
        min=float(np.int32(lo).view(np.float32)),
        max=float(np.int32(hi).view(np.float32)),
        histogram=tuple(int(c) for c in hist),
    )


def sweep_runs(
    strength: Any,
    ids: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    rate: float | None,
    want_quality: bool,
    k: int,
) -> tuple[Quality | None, tuple[np.ndarray, np.ndarray] | None]:
    """Decay the rows of R runs, then summarize them and select their top-k, in one pass.

    Equal to :func:`decay_runs` followed by :func:`quality_runs` and :func:`topk_runs` on
    the same runs, bit for bit (the float64 sum included: on NumPy both read the runs in the
    same blocks). On NumPy one compiled pass (``kernels_numba.sweep_runs``); elsewhere (CuPy,
    no numba) exactly those three calls.

    Args:
        strength: [N] float32 in [0, 1], NumPy or CuPy, updated in place.
        ids: [N] uint64 host ids of the same rows, distinct.
        starts: [R] int64 host, first row of each run.
        ends: [R] int64 host, end (exclusive) of each run.
        rate: decay per call in [0, 1] (validated by the caller); None: no decay.
        want_quality: compute the statistics.
        k: top-k size, >= 0 (validated by the caller); 0: no top-k.

    Returns:
        ``(quality or None, (ids [k'] uint64, strengths [k'] float32) or None)``: None where
        not asked for; k' = min(k, rows of the runs).
    """
    if not _compiled(strength):
        if rate is not None:
            decay_runs(strength, starts, ends, rate)
        q = quality_runs(strength, starts, ends) if want_quality else None
        return q, (topk_runs(strength, ids, starts, ends, k) if k > 0 else None)
    starts, ends = _i64(starts), _i64(ends)
    kk = min(int(k), int(np.sum(ends - starts)))
    n, total, lo, hi, at_least, rows = _nb.sweep_runs(
        strength,
        strength.view(np.int32),
        ids,
        starts,
        ends,
        np.float32(rate or 0.0),
        rate is not None,
        _INNER_EDGES,
        want_quality,
        kk,
    )
    q = _quality_of(n, total, lo, hi, at_least) if want_quality else None
    if k <= 0:
        return q, None
    cand_ids, cand_s = ids[rows], strength[rows]
    order = np.lexsort((cand_ids, -cand_s))
    return q, (cand_ids[order], cand_s[order])


def topk(strength: Any, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Return the k strongest memories, strongest first, ties broken by smaller id.

    ``argpartition`` finds the k-th largest strength t; every memory above t is in, and the
    memories tied at t compete on id. Ties are common (clipping piles strengths at 0 and 1),
    so the tied ids are partitioned rather than sorted: the final lexsort sees only k rows.

    Args:
        strength: [N] float32, NumPy or CuPy.
        ids: [N] uint64 host ids of the same rows.
        k: number wanted, >= 0 (validated by the caller).

    Returns:
        ``(ids, strengths)``: [k'] uint64 and [k'] float32 host arrays, k' = min(k, N).
    """
    xp = array_module(strength)
    n = len(strength)
    kk = min(int(k), n)
    if kk == 0:
        return np.empty(0, np.uint64), np.empty(0, np.float32)
    if kk == n:
        rows = np.arange(n)
    else:
        part = xp.argpartition(strength, n - kk)
        threshold = strength[part[n - kk]]
        above = to_host(xp.nonzero(strength > threshold)[0])
        tied = to_host(xp.nonzero(strength == threshold)[0])
        need = kk - len(above)
        if need < len(tied):
            tied = tied[np.argpartition(ids[tied], need - 1)[:need]]
        rows = np.concatenate([above, tied])
    cand_ids = np.asarray(ids)[rows]
    cand_s = to_host(strength[xp.asarray(rows)])
    order = np.lexsort((cand_ids, -cand_s))
    return cand_ids[order], cand_s[order]


def topk_runs(
    strength: Any, ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`topk` of the rows of R runs; same result.

    Args:
        strength: [N] float32, NumPy or CuPy.
        ids: [N] uint64 host ids of the same rows, distinct.
        starts: [R] int64 host, first row of each run.
        ends: [R] int64 host, end (exclusive) of each run.
        k: number wanted, >= 1.
    """
    if not _compiled(strength):
        pairs = _pairs(starts, ends)
        return merge_topk([topk(strength[a:b], ids[a:b], k) for a, b in pairs], k)
    starts, ends = _i64(starts), _i64(ends)
    kk = min(int(k), int(np.sum(ends - starts)))
    if kk <= 0:
        return np.empty(0, np.uint64), np.empty(0, np.float32)
    rows = _nb.topk_runs(strength, ids, starts, ends, kk)
    cand_ids, cand_s = ids[rows], strength[rows]
    order = np.lexsort((cand_ids, -cand_s))
    return cand_ids[order], cand_s[order]
