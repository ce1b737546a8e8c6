"""Benchmark the memory kernels: ours vs a NumPy two-pass baseline vs a fused numba loop.

Run: ``.venv/bin/python -m tests.benchmarks.bench_kernels [N] [REPEATS]``. Not collected by
pytest (testpaths exclude tests/benchmarks). Times are medians over ``repeats`` in
milliseconds, on NumPy (CPU); every kernel runs once untimed first (numba compiles then).

``--store TREE [TREE ...]`` instead times a worker's ``SlotStore`` of each source tree (e.g.
a worktree of main and this one), each in its own process, trees interleaved, ``--rounds``
rounds: ingest (``run_ingest_bench``) and the kernels through the store
(``run_store_bench``), then prints medians per tree and their ratios.

Baselines, per kernel:
- decay: ``np.subtract`` then ``np.clip`` over the whole array (two passes over memory).
- reinforce (100k Zipf-distributed rows, duplicates): ``np.add.at`` then ``np.clip`` of the
  whole array; the numba loop adds sequentially in float32 (not our float64 per-row sums).
- top-100: a full ``np.argsort`` (stable, so ties go to the lower row); the numba loop keeps
  one bounded candidate list per thread and merges them, same order as ours.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np

from worker.store import kernels

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


# --- the store: ingest and kernels through SlotStore, main vs branch ------------------------

INGEST_BATCH = 33_000  # what a worker receives of a 100k client batch with RF=2 and 3 workers


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU (this process, all threads) seconds of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def run_ingest_bench(sizes: tuple[int, ...], batch: int, batches: int) -> dict[str, float]:
    """Load a ``worker.store.store.SlotStore`` (1024 slots) from empty in batches of new ids.

    At each size held: ``batches`` more batches of new ids, then ``batches`` overwrites of
    ids held (random, with repeats). Returns rates (memories/s, wall and CPU) per phase; a
    phase's rate is its memories over its total time, so a batch that lays the store out
    again counts, and ``*_p50_ms`` the median batch.
    """
    from worker.store.store import SlotStore  # the tree under test (see _run_tree)

    warm = SlotStore(1024)  # compile (or load numba's cache) before anything is timed
    warm.upsert(np.arange(5000, dtype=np.uint64), np.zeros(5000, np.float32))
    warm.upsert(np.arange(5000, dtype=np.uint64), np.ones(5000, np.float32))
    warm.delete(np.arange(0, 5000, 3, dtype=np.uint64))
    warm.get(np.arange(10, dtype=np.uint64))
    rng = np.random.default_rng(1)
    total = max(sizes) + batch * batches * len(sizes)
    ids = np.unique(rng.integers(0, 2**64 - 1, total + total // 50, np.uint64, endpoint=True))
    ids = rng.permutation(ids)[:total]
    values = rng.random(total, dtype=np.float32)
    store, held, out = SlotStore(1024), 0, {}

    def load_to(n: int, tag: str) -> None:
        nonlocal held
        start, walls, cpus = held, [], []
        while held < n:
            end = min(n, held + batch)
            w, c = _timed(lambda a=held, b=end: store.upsert(ids[a:b], values[a:b]))
            walls.append(w)
            cpus.append(c)
            held = end
        if not walls:
            return
        count = held - start
        out[f"{tag}_rate"] = count / sum(walls)
        out[f"{tag}_cpu_rate"] = count / max(sum(cpus), 1e-9)
        out[f"{tag}_p50_ms"] = 1000 * statistics.median(walls)

    for size in sorted(sizes):
        load_to(size, "load" if size == max(sizes) else f"load_{size}")
        load_to(held + batch * batches, f"new_{size}")
        walls, cpus = [], []
        for _ in range(batches):
            pick = ids[rng.integers(0, held, batch)]
            w, c = _timed(lambda p=pick: store.upsert(p, values[: len(p)]))
            walls.append(w)
            cpus.append(c)
        out[f"overwrite_{size}_rate"] = batch * batches / sum(walls)
        out[f"overwrite_{size}_cpu_rate"] = batch * batches / max(sum(cpus), 1e-9)
        out[f"overwrite_{size}_p50_ms"] = 1000 * statistics.median(walls)
    assert len(store) == held
    return out


def run_store_bench(n: int, repeats: int) -> dict[str, float]:
    """Median ms of the kernels through a ``SlotStore`` of n memories (1024 slots).

    decay, reinforce of 100k Zipf ids, quality and top-100 over every slot, and over a
    third of the slots (a worker's primaries: what it serves in the memory job).
    """
    from worker.store.store import SlotStore

    rng = np.random.default_rng(2)
    ids = np.unique(rng.integers(0, 2**64 - 1, n + n // 50, np.uint64, endpoint=True))
    ids = rng.permutation(ids)[:n]
    store = SlotStore(1024)
    for a in range(0, n, 1_000_000):
        store.upsert(ids[a : a + 1_000_000], rng.random(len(ids[a : a + 1_000_000]), np.float32))
    hot = ids[(rng.zipf(1.2, K_REINFORCE) - 1) % n]
    boosts = rng.random(K_REINFORCE, dtype=np.float32) * np.float32(0.001)
    third = list(range(0, 1024, 3))
    fns: dict[str, Callable[[], object]] = {
        "decay": lambda: store.decay(1e-4),
        f"reinforce {K_REINFORCE // 1000}k Zipf": lambda: store.reinforce(hot, boosts),
        "quality": lambda: store.quality(),
        f"top-{K_TOP}": lambda: store.topk(K_TOP),
        "decay, 1/3 of slots": lambda: store.decay(1e-4, third),
        "quality, 1/3 of slots": lambda: store.quality(third),
        f"top-{K_TOP}, 1/3 of slots": lambda: store.topk(K_TOP, third),
        "get 1 id": lambda: store.get(ids[:1]),
    }
    return _medians_ms(fns, repeats)


def _run_tree(tree: str, what: str, arg: str) -> dict[str, float]:
    """Run one bench in a fresh process that imports ``worker`` from ``tree``."""
    code = (
        "import json, sys, importlib.util\n"
        f"sys.path.insert(0, {tree!r})\n"
        f"spec = importlib.util.spec_from_file_location('bench', {__file__!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"print(json.dumps(m.{what}(*json.loads({arg!r}))))\n"
    )
    env = {**os.environ, "PYTHONPATH": tree}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"{tree}: {done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def compare_trees(trees: list[str], rounds: int, n: int, sizes: tuple[int, ...]) -> str:
    """Ingest and store kernels of each tree, interleaved over rounds; a Markdown table."""
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    for _ in range(rounds):
        for tree in trees:
            got = _run_tree(tree, "run_ingest_bench", json.dumps([list(sizes), INGEST_BATCH, 20]))
            got.update(_run_tree(tree, "run_store_bench", json.dumps([n, 7])))
            runs[tree].append(got)
    names = [Path(t).name for t in trees]
    lines = [
        "| metric | "
        + " | ".join(f"{x} (median of {rounds})" for x in names)
        + f" | {names[-1]} / {names[0]} |",
        "|---|" + "---:|" * (len(trees) + 1),
    ]
    for key in runs[trees[0]][0]:
        med = [statistics.median(r[key] for r in runs[t]) for t in trees]
        unit = "memories/s" if key.endswith("rate") else "ms"
        cells = " | ".join(f"{m:,.0f}" if unit == "memories/s" else f"{m:.2f}" for m in med)
        lines.append(f"| {key} ({unit}) | {cells} | {med[-1] / med[0]:.2f} |")
    return "\n".join(lines)


def main() -> None:
    """Command line: the kernel table, or ``--store`` trees compared."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("n", nargs="?", type=int, default=10_000_000, help="memories")
    parser.add_argument("repeats", nargs="?", type=int, default=5)
    parser.add_argument("--store", nargs="+", metavar="TREE", help="source trees to compare")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (--store)")
    parser.add_argument(
        "--sizes", default="3300000,6700000", help="store sizes held for ingest (--store)"
    )
    args = parser.parse_args()
    if args.store:
        sizes = tuple(int(x) for x in args.sizes.split(","))
        print(f"load average {os.getloadavg()} at start")
        print(compare_trees(args.store, args.rounds, args.n, sizes))
        print(f"load average {os.getloadavg()} at end")
        return
    print(f"n={args.n:,} repeats={args.repeats} numba threads={numba.get_num_threads()}")
    print(format_table(run_kernel_bench(args.n, args.repeats)))


if __name__ == "__main__":
    main()
