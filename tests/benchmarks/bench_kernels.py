"""Benchmark the memory kernels: ours vs a NumPy two-pass baseline vs a fused numba loop.

Run: ``.venv/bin/python -m tests.benchmarks.bench_kernels [N] [REPEATS]``. Not collected by
pytest (testpaths exclude tests/benchmarks). Times are medians over ``repeats`` in
milliseconds, on NumPy (CPU); every kernel runs once untimed first (numba compiles then).

Baselines, per kernel:
- decay: ``np.subtract`` then ``np.clip`` over the whole array (two passes over memory).
- reinforce (100k Zipf-distributed rows, duplicates): ``np.add.at`` then ``np.clip`` of the
  whole array; the numba loop adds sequentially in float32 (not our float64 per-row sums).
- top-100: a full ``np.argsort`` (stable, so ties go to the lower row); the numba loop keeps
  one bounded candidate list per thread and merges them, same order as ours.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import numba
import numpy as np

from worker import kernels

K_TOP = 100
K_REINFORCE = 100_000


@numba.njit(parallel=True)
def _decay_numba(s, rate):  # pragma: no cover - compiled
    for i in numba.prange(s.shape[0]):
        s[i] = min(max(s[i] - rate, np.float32(0.0)), np.float32(1.0))


@numba.njit
def _reinforce_numba(s, rows, boosts):  # pragma: no cover - compiled
    for i in range(rows.shape[0]):  # sequential: duplicate rows would race in prange
        s[rows[i]] += boosts[i]
    for i in range(rows.shape[0]):
        s[rows[i]] = min(max(s[rows[i]], np.float32(0.0)), np.float32(1.0))


@numba.njit(parallel=True)
def _topk_numba(s, ids, k, chunks):  # pragma: no cover - compiled
    vals = np.full((chunks, k), -np.inf, np.float32)
    keys = np.zeros((chunks, k), np.uint64)
    rows = np.full((chunks, k), -1, np.int64)
    step = (s.shape[0] + chunks - 1) // chunks
    for c in numba.prange(chunks):
        worst = 0  # slot of the weakest candidate: lowest strength, then largest id
        for i in range(c * step, min((c + 1) * step, s.shape[0])):
            v = s[i]
            if v > vals[c, worst] or (v == vals[c, worst] and ids[i] < keys[c, worst]):
                vals[c, worst], keys[c, worst], rows[c, worst] = v, ids[i], i
                for j in range(k):
                    if vals[c, j] < vals[c, worst] or (
                        vals[c, j] == vals[c, worst] and keys[c, j] > keys[c, worst]
                    ):
                        worst = j
    return rows.ravel()


def topk_numba(s: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k with the numba candidate lists, then a lexsort of the few candidates."""
    rows = _topk_numba(s, ids, k, numba.get_num_threads() * 4)
    rows = rows[rows >= 0]
    order = np.lexsort((ids[rows], -s[rows]))[:k]
    return ids[rows[order]], s[rows[order]]


def _medians_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time of each function, ms; repeats interleave the functions so that noise
    from neighbours on a shared machine hits all of them alike."""
    for fn in fns.values():
        fn()  # warm-up (and numba compilation)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def _row(kernel: str, fns: dict[str, Callable[[], object]], repeats: int) -> dict:
    ms = _medians_ms(fns, repeats)
    ours, baseline, fused = ms["ours"], ms["baseline"], ms["numba"]
    return {
        "kernel": kernel,
        "ours_ms": ours,
        "numpy_baseline_ms": baseline,
        "numba_fused_ms": fused,
        "ours/baseline": ours / baseline,
        "ours/numba": ours / fused,
    }


def run_kernel_bench(n: int = 10_000_000, repeats: int = 5) -> list[dict]:
    """Time decay, reinforce of 100k ids and top-100 on n memories.

    Returns:
        One dict per kernel: ``kernel``, ``ours_ms``, ``numpy_baseline_ms``,
        ``numba_fused_ms`` (medians, milliseconds) and the ratios ``ours/baseline`` and
        ``ours/numba``.
    """
    rng = np.random.default_rng(0)
    s = rng.random(n, dtype=np.float32)
    ids = rng.permutation(n).astype(np.uint64) * np.uint64(7919)
    rate = np.float32(1e-4)
    rows_k = ((rng.zipf(1.2, K_REINFORCE) - 1) % n).astype(np.int64)
    boosts_k = (rng.random(K_REINFORCE, dtype=np.float32) * np.float32(0.01)).astype(np.float32)

    def two_pass_decay():
        np.subtract(s, rate, out=s)
        np.clip(s, 0, 1, out=s)

    def add_at_reinforce():
        np.add.at(s, rows_k, boosts_k)
        np.clip(s, 0, 1, out=s)

    def fused_decay():
        _decay_numba(s, rate)

    results = [
        _row(
            "decay",
            {
                "ours": lambda: kernels.decay(s, rate),
                "baseline": two_pass_decay,
                "numba": fused_decay,
            },
            repeats,
        ),
        _row(
            "decay (portable xp path)",
            {
                "ours": lambda: kernels.decay_xp(s, rate),
                "baseline": two_pass_decay,
                "numba": fused_decay,
            },
            repeats,
        ),
        _row(
            f"reinforce {K_REINFORCE // 1000}k Zipf",
            {
                "ours": lambda: kernels.reinforce(s, rows_k, boosts_k),
                "baseline": add_at_reinforce,
                "numba": lambda: _reinforce_numba(s, rows_k, boosts_k),
            },
            repeats,
        ),
        _row(
            f"top-{K_TOP}",
            {
                "ours": lambda: kernels.topk(s, ids, K_TOP),
                "baseline": lambda: np.argsort(-s, kind="stable")[:K_TOP],
                "numba": lambda: topk_numba(s, ids, K_TOP),
            },
            repeats,
        ),
    ]
    ours, fused = kernels.topk(s, ids, K_TOP), topk_numba(s, ids, K_TOP)
    assert np.array_equal(ours[0], fused[0]), "numba top-k disagrees with kernels.topk"
    return results


def format_table(rows: list[dict]) -> str:
    """Render benchmark rows as a Markdown table."""
    head = "| kernel | ours ms | NumPy baseline ms | numba fused ms | ours/baseline | ours/numba |"
    lines = [head, "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['kernel']} | {r['ours_ms']:.2f} | {r['numpy_baseline_ms']:.2f} | "
            f"{r['numba_fused_ms']:.2f} | {r['ours/baseline']:.2f} | {r['ours/numba']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000_000
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    print(f"n={n:,} repeats={repeats} numba threads={numba.get_num_threads()}")
    print(format_table(run_kernel_bench(n, repeats)))
