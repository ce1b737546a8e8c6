"""Tests for worker/store/kernels.py against straightforward NumPy formulas, bit for bit.

Each invariant is written once over an array module ``xp``; the NumPy run always happens,
the CuPy run is marked ``gpu`` and skips without a CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.memory.slots import slot_of
from shared.memory.stats import EMPTY_QUALITY, Quality, merge_quality, merge_topk
from worker.store import kernels

UNIT = st.floats(0, 1, width=32)


def _cupy_or_skip():
    try:
        xp, name = kernels.get_xp("cuda")
    except RuntimeError:
        pytest.skip("no CUDA device")
    return xp


XPS = [np, pytest.param("cupy", marks=pytest.mark.gpu)]


@pytest.fixture(params=XPS)
def xp(request):
    return _cupy_or_skip() if request.param == "cupy" else np


def bits(a) -> np.ndarray:
    return kernels.to_host(a).astype(np.float32).view(np.uint32)


def test_get_xp_on_a_cpu_host():
    assert kernels.get_xp("cpu") == (np, "cpu")
    xp, name = kernels.get_xp("auto")
    assert name in ("cpu", "cuda:0")
    with pytest.raises(ValueError, match="device: 'tpu'"):
        kernels.get_xp("tpu")
    if name == "cpu":
        with pytest.raises(RuntimeError, match="cuda"):
            kernels.get_xp("cuda")


@pytest.mark.parametrize("n", [0, 1, 1000, 100_000, 300_001])
@pytest.mark.parametrize("rate", [0.0, 1e-3, 0.25, 0.5, 1.0])
def test_decay_matches_subtract_then_clip(xp, n, rate):
    rng = np.random.default_rng(n)
    s = rng.random(n, dtype=np.float32)
    s[: min(n, 4)] = [0.0, 1.0, np.float32(rate), 0.5][: min(n, 4)]
    expected = np.clip(s - np.float32(rate), 0, 1).astype(np.float32)
    got = xp.asarray(s)
    kernels.decay(got, rate)
    assert np.array_equal(bits(got), bits(expected))


def test_fused_decay_and_portable_decay_are_bit_identical():
    rng = np.random.default_rng(7)
    s = rng.random(1 << 20, dtype=np.float32)
    s[::7] = 0.0
    s[::11] = 1.0
    s[::13] = np.float32(0.1)
    for rate in (0.0, np.float32(0.1), 0.3, 1.0):
        fused, portable = s.copy(), s.copy()
        kernels.decay(fused, rate)
        kernels.decay_xp(portable, rate)
        assert np.array_equal(bits(fused), bits(portable))


def test_decay_works_on_slices_in_place():
    s = np.full(100_000, 0.5, np.float32)
    kernels.decay(s[10:60_000], 0.2)
    assert np.all(s[:10] == 0.5) and np.all(s[60_000:] == 0.5)
    assert np.all(s[10:60_000] == np.float32(0.5) - np.float32(0.2))


def reinforce_formula(s: np.ndarray, rows: np.ndarray, boosts: np.ndarray) -> np.ndarray:
    """Sum each row's boosts left to right in float64, round once, add and clip in float32."""
    out = s.copy()
    for r in np.unique(rows):
        total = 0.0
        for b in boosts[rows == r]:
            total += float(b)
        out[r] = np.clip(out[r] + np.float32(total), 0, 1)
    return out


@given(
    st.lists(UNIT, min_size=1, max_size=20),
    st.lists(st.tuples(st.integers(0, 19), st.floats(0, 2, width=32)), max_size=40),
)
def test_reinforce_matches_formula(strengths, pairs):
    s = np.array(strengths, np.float32)
    pairs = [(r % len(s), b) for r, b in pairs]
    rows = np.array([p[0] for p in pairs], np.int64)
    boosts = np.array([p[1] for p in pairs], np.float32)
    expected = reinforce_formula(s, rows, boosts)
    kernels.reinforce(s, rows, boosts)
    assert np.array_equal(bits(s), bits(expected))


def test_reinforce_duplicates_add_and_clip(xp):
    s = xp.asarray(np.array([0.0, 0.5, 0.9], np.float32))
    kernels.reinforce(s, np.array([0, 0, 2, 1]), np.array([0.25, 0.25, 0.5, 0.0], np.float32))
    assert kernels.to_host(s).tolist() == [0.5, 0.5, 1.0]
    kernels.reinforce(s, np.array([], np.int64), np.array([], np.float32))
    assert kernels.to_host(s).tolist() == [0.5, 0.5, 1.0]


@settings(max_examples=50)
@given(st.lists(st.tuples(st.integers(0, 30), st.floats(0, 1, width=32)), max_size=60))
def test_reinforce_whole_equals_split_by_slot(pairs):
    ids = np.array([p[0] for p in pairs], np.uint64)
    boosts = np.array([p[1] for p in pairs], np.float32)
    start = np.linspace(0, 0.9, 31, dtype=np.float32)
    whole = start.copy()
    kernels.reinforce(whole, ids.astype(np.int64), boosts)
    split = start.copy()
    slots = slot_of(ids, 4)
    for s in range(4):  # boolean masks keep per-id order
        mask = slots == s
        kernels.reinforce(split, ids[mask].astype(np.int64), boosts[mask])
    assert np.array_equal(bits(whole), bits(split))


def quality_formula(s: np.ndarray) -> Quality:
    hist, _ = np.histogram(s, bins=10, range=(0.0, 1.0))
    total = float(np.sum(s, dtype=np.float64))
    return Quality(
        len(s), total, total / len(s), float(s.min()), float(s.max()), tuple(hist.tolist())
    )


def test_quality_matches_numpy(xp):
    rng = np.random.default_rng(3)
    s = rng.random(250_000, dtype=np.float32)
    s[:5] = [0.0, 1.0, np.float32(0.1), np.float32(0.7), np.float32(0.9)]
    got = kernels.quality(xp.asarray(s))
    assert got == quality_formula(s)


def test_quality_bins_and_empty():
    q = kernels.quality(np.array([1.0, 1.0, 0.0, 0.95, 0.05, 0.7, 0.1], np.float32))
    # 1.0 falls in the last bin; float32(0.7) in [0.7, 0.8) as with np.histogram.
    assert q.histogram == (2, 1, 0, 0, 0, 0, 0, 1, 0, 3)
    assert (q.count, q.min, q.max) == (7, 0.0, 1.0)
    assert kernels.quality(np.empty(0, np.float32)) == EMPTY_QUALITY
    assert EMPTY_QUALITY == Quality(0, 0.0, 0.0, 0.0, 0.0, (0,) * 10)


@given(st.lists(st.lists(UNIT, max_size=30), max_size=5))
def test_merge_quality_equals_quality_of_the_union(parts):
    arrays = [np.array(p, np.float32) for p in parts]
    merged = merge_quality([kernels.quality(a) for a in arrays])
    union = np.concatenate([np.empty(0, np.float32), *arrays])
    whole = kernels.quality(union)
    assert (merged.count, merged.min, merged.max, merged.histogram) == (
        whole.count,
        whole.min,
        whole.max,
        whole.histogram,
    )
    assert merged.sum == pytest.approx(whole.sum, rel=1e-12, abs=1e-12)
    assert merged.mean == pytest.approx(whole.mean, rel=1e-12, abs=1e-12)


def topk_formula(s: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.lexsort((ids, -s))[:k]  # full sort: strength descending, then id ascending
    return ids[order], s[order]


TIE_VALUES = st.sampled_from([0.0, 0.25, 0.5, 1.0]) | UNIT


@given(
    st.lists(
        st.tuples(TIE_VALUES, st.integers(0, 2**64 - 1)), max_size=60, unique_by=lambda t: t[1]
    ),
    st.integers(1, 70),
)
def test_topk_matches_full_sort_with_ties(rows, k):
    s = np.array([r[0] for r in rows], np.float32)
    ids = np.array([r[1] for r in rows], np.uint64)
    got_ids, got_s = kernels.topk(s, ids, k)
    want_ids, want_s = topk_formula(s, ids, k)
    assert got_ids.dtype == np.uint64 and got_s.dtype == np.float32
    assert np.array_equal(got_ids, want_ids) and np.array_equal(bits(got_s), bits(want_s))


def test_topk_many_ties_at_threshold(xp):
    rng = np.random.default_rng(5)
    s = np.where(rng.random(200_000) < 0.3, 1.0, rng.random(200_000) * 0.9).astype(np.float32)
    ids = rng.permutation(10**6)[:200_000].astype(np.uint64)
    got_ids, got_s = kernels.topk(xp.asarray(s), ids, 100)
    want_ids, want_s = topk_formula(s, ids, 100)
    assert np.array_equal(got_ids, want_ids) and np.array_equal(got_s, want_s)
    assert np.all(got_s == 1.0) and np.all(np.diff(got_ids.astype(np.int64)) > 0)


@given(
    st.lists(st.tuples(TIE_VALUES, st.integers(0, 10**6)), max_size=80, unique_by=lambda t: t[1]),
    st.integers(1, 4),
    st.integers(1, 30),
)
def test_merge_topk_equals_topk_of_concatenation(rows, parts, k):
    s = np.array([r[0] for r in rows], np.float32)
    ids = np.array([r[1] for r in rows], np.uint64)
    pieces = np.array_split(np.arange(len(rows)), parts)
    local = [kernels.topk(s[p], ids[p], k) for p in pieces]
    got_ids, got_s = merge_topk(local, k)
    want_ids, want_s = kernels.topk(s, ids, k)
    assert np.array_equal(got_ids, want_ids) and np.array_equal(got_s, want_s)
    assert merge_topk([], k)[0].size == 0


# -- run kernels (a store's slot set: rows starts[r]:ends[r]) --------------------------------


def _runs_case(seed: int, n: int = 50_000):
    """Strengths with ties and clipped values, distinct ids, and ~40 random disjoint runs."""
    rng = np.random.default_rng(seed)
    s = rng.choice(np.array([0, 0.25, 0.5, 1, 1], np.float32), n)
    free = rng.random(n) < 0.5
    s[free] = rng.random(int(free.sum()), dtype=np.float32)
    ids = rng.permutation(n * 3)[:n].astype(np.uint64) * np.uint64(2**40 + 1)
    cuts = np.sort(rng.choice(np.arange(1, n), 80, replace=False))
    starts, ends = cuts[0::2].astype(np.int64), cuts[1::2].astype(np.int64)
    rows = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends, strict=True)])
    return s, ids, starts, ends, rows


@pytest.fixture(params=["compiled", "portable"])
def run_kernels(request, monkeypatch):
    """kernels with the numba loops, or with them disabled (the CuPy / no-numba path)."""
    if request.param == "portable":
        monkeypatch.setattr(kernels, "_nb", None)
    return kernels


@pytest.mark.parametrize("seed", [0, 1])
def test_run_kernels_equal_whole_array_kernels_on_the_runs(run_kernels, seed):
    s, ids, starts, ends, rows = _runs_case(seed)
    q, want = run_kernels.quality_runs(s, starts, ends), kernels.quality(s[rows])
    assert (q.count, q.min, q.max, q.histogram) == (want.count, want.min, want.max, want.histogram)
    assert q.sum == pytest.approx(want.sum, rel=1e-12) and q.mean == pytest.approx(want.mean)
    for k in (1, 7, 100, len(rows) + 5):
        got_ids, got_s = run_kernels.topk_runs(s, ids, starts, ends, k)
        want_ids, want_s = kernels.topk(s[rows], ids[rows], k)
        assert np.array_equal(got_ids, want_ids) and np.array_equal(bits(got_s), bits(want_s))
    for rate in (np.float32(0.25), 0.3, 1.0):
        expected = s.copy()
        expected[rows] = np.clip(s[rows] - np.float32(rate), 0, 1)
        run_kernels.decay_runs(s, starts, ends, rate)
        assert np.array_equal(bits(s), bits(expected))


def test_run_kernels_on_no_rows(run_kernels):
    s, ids, none = np.ones(3, np.float32), np.arange(3, dtype=np.uint64), np.empty(0, np.int64)
    assert run_kernels.quality_runs(s, none, none) == EMPTY_QUALITY
    assert run_kernels.topk_runs(s, ids, none, none, 5)[0].size == 0
    run_kernels.decay_runs(s, none, none, 0.5)
    assert np.all(s == 1)


def test_add_sums_locate_and_insert_compiled_equal_numpy(monkeypatch):
    rng = np.random.default_rng(4)
    keys = np.unique(rng.integers(0, 2**64 - 1, 20_000, np.uint64))
    needles = np.unique(
        np.concatenate([rng.choice(keys, 3000), rng.integers(0, 2**64 - 1, 500, np.uint64)])
    )
    s = rng.random(len(keys), dtype=np.float32)
    rows = np.unique(rng.integers(0, len(keys), 4000))
    sums = (rng.random(len(rows)) * 0.3).astype(np.float32)
    got_rows, got_found = kernels.locate_sorted(keys, needles)
    a = s.copy()
    kernels.add_sums(a, rows, sums)
    new = needles[~np.isin(needles, keys)]
    at = np.searchsorted(keys, new)
    merged = kernels.insert_rows(keys, new, at)
    monkeypatch.setattr(kernels, "_nb", None)
    want_rows, want_found = kernels.locate_sorted(keys, needles)
    b = s.copy()
    kernels.add_sums(b, rows, sums)
    assert np.array_equal(merged, np.sort(np.concatenate([keys, new])))
    assert np.array_equal(merged, kernels.insert_rows(keys, new, at))
    assert np.array_equal(got_rows, np.searchsorted(keys, needles))
    assert np.array_equal(got_rows, want_rows) and np.array_equal(got_found, want_found)
    assert np.array_equal(got_found, np.isin(needles, keys))
    assert np.array_equal(bits(a), bits(b))
