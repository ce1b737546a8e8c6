"""``make bench-memory``: the memory store side by side with its baselines, in one run.

Run: ``.venv/bin/python -m tests.benchmarks.bench_memory [--out docs/bench-memory.md]``.
Not collected by pytest. Three parts, one Markdown table each, against the goals of issue 3:

1. kernels on 10M memories in one process (``bench_kernels.run_kernel_bench``): ours vs a
   NumPy two-pass baseline vs a fused ``numba.njit(parallel=True)`` loop; medians of
   ``--kernel-repeats``. Goal: decay within 1.5x of the fused pass.
2. a local cluster of 3 worker processes (+ coordinator) with 1M and 10M memories
   (``bench_cluster.run_cluster_bench``): iteration latency p50/p99 over ``--iterations``
   iterations (reinforce 100k Zipf ids, then decay, quality, top-100: one sweep call, or
   three calls with ``--iteration separate``), CPU ms per phase summed over all processes,
   and upsert/reinforce throughput through the client, batches of 100k. Goals: iteration at
   1M under 15 ms p50; upsert and reinforce at >= 1M memories/s.
3. the 1M iteration on Redis (``bench_redis.run_redis_bench``), skipped with a message when
   redis-server is missing. Goal: ours 10x faster.
4. single-key latency (``bench_latency.run_latency_bench``): ``SyncClient.get`` of one id and
   a one-id upsert beside Redis GET and SET, interleaved, p50/p99 and CPU per operation.
   Goals (issue 12): get p50 <= 1 ms, upsert p50 <= 3 ms.

The load average is printed before and after each part: on a shared machine, numbers taken
at a load above the core count are contaminated and should be re-run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import numba
import numpy as np

from tests.benchmarks.bench_cluster import TOP_K, ClusterResult, run_cluster_bench
from tests.benchmarks.bench_kernels import _row as _kernel_row
from tests.benchmarks.bench_kernels import format_table, run_kernel_bench, topk_numba
from tests.benchmarks.bench_latency import latency_section, run_latency_bench
from tests.benchmarks.bench_redis import RedisResult, run_redis_bench
from worker.store import kernels

GOAL_DECAY_VS_FUSED = 1.5
GOAL_ITERATION_MS = 15.0
GOAL_RATE = 1_000_000.0
GOAL_VS_REDIS = 10.0
PHASE_NAMES = {
    "reinforce": "reinforce 100k",
    "decay": "decay",
    "quality": "quality",
    "topk": f"top-{TOP_K}",
    "sweep": f"sweep (decay + quality + top-{TOP_K})",
}


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min)"


def _verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def store_path_rows(n: int, repeats: int) -> list[dict]:
    """The kernels as a worker's store runs them (``kernels.*_runs`` over one run of all
    rows: serial numba), against the same baselines as ``run_kernel_bench`` (same data)."""
    rng = np.random.default_rng(0)
    s = rng.random(n, dtype=np.float32)
    ids = rng.permutation(n).astype(np.uint64) * np.uint64(7919)
    rate = np.float32(1e-4)
    starts, ends = np.array([0]), np.array([n])

    def two_pass_decay() -> None:
        np.subtract(s, rate, out=s)
        np.clip(s, 0, 1, out=s)

    rows = [
        _kernel_row(
            "decay, store path (serial numba over runs)",
            {
                "ours": lambda: kernels.decay_runs(s, starts, ends, float(rate)),
                "baseline": two_pass_decay,
                "numba": lambda: kernels.decay(s, float(rate)),  # = the fused parallel loop
            },
            repeats,
        ),
        _kernel_row(
            f"top-{TOP_K}, store path (heap over runs)",
            {
                "ours": lambda: kernels.topk_runs(s, ids, starts, ends, TOP_K),
                "baseline": lambda: np.argsort(-s, kind="stable")[:TOP_K],
                "numba": lambda: topk_numba(s, ids, TOP_K),
            },
            repeats,
        ),
    ]
    assert np.array_equal(
        kernels.topk_runs(s, ids, starts, ends, TOP_K)[0], kernels.topk(s, ids, TOP_K)[0]
    )
    return rows


def kernel_section(n: int, repeats: int) -> str:
    rows = run_kernel_bench(n, repeats) + store_path_rows(n, repeats)
    decay = next(r for r in rows if r["kernel"] == "decay")
    ratio = decay["ours/numba"]
    store = rows[-2]["ours/numba"]
    return "\n".join(
        [
            f"### 1. Kernels, {n:,} memories, one process (median of {repeats})",
            "",
            format_table(rows),
            "",
            f"Goal: decay within {GOAL_DECAY_VS_FUSED}x of the fused numba pass: "
            f"{ratio:.2f}x, {_verdict(ratio <= GOAL_DECAY_VS_FUSED)} (the store's serial "
            f"path: {store:.2f}x on an otherwise idle CPU; it stays serial because workers "
            "share the cores with each other).",
        ]
    )


def _row(name: str, values: list[float], fmt: str, goal: str = "", ratios: str = "") -> str:
    cells = " | ".join(format(v, fmt) for v in values)
    return f"| {name} | {cells} | {goal} | {ratios} |"


def cluster_section(results: list[ClusterResult]) -> str:
    head = " | ".join(f"{r.memories / 1e6:g}M" for r in results)
    ms = lambda what, q=50: [r.ms(what, q) for r in results]  # noqa: E731
    med = lambda attr: [float(np.median(getattr(r, attr))) for r in results]  # noqa: E731
    at_1m = next((r for r in results if r.memories == 1_000_000), None)
    it_vs_goal = "no 1M run"
    if at_1m is not None:
        it_ratio = at_1m.ms("iteration") / GOAL_ITERATION_MS
        it_vs_goal = f"{it_ratio:.1f}x the goal at 1M: {_verdict(it_ratio < 1)}"

    def vs_rate(values: list[float]) -> str:
        return ", ".join(f"{v / GOAL_RATE:.2f}x" for v in values)

    rates = {
        "upsert, new ids (load), memories/s": med("insert_rates"),
        "upsert, existing ids, memories/s": med("overwrite_rates"),
        "reinforce, memories/s": [r.reinforce_rate for r in results],
    }
    lines = [
        f"### 2. Local cluster: 3 worker processes + coordinator, RF=2, through the client "
        f"({', '.join(str(len(r.iteration_s)) for r in results)} iterations)",
        "",
        f"| metric | {head} | goal | vs goal |",
        "|---|" + "---:|" * len(results) + "---|---|",
        _row(
            "iteration p50, ms",
            ms("iteration"),
            ".1f",
            f"< {GOAL_ITERATION_MS:g} ms at 1M",
            it_vs_goal,
        ),
        _row("iteration p99, ms", ms("iteration", 99), ".1f"),
    ]
    phases = list(results[0].phase_s)
    lines += [_row(f"  {PHASE_NAMES[p]} p50, ms", ms(p), ".1f") for p in phases]
    lines += [
        _row(f"  CPU ms per {PHASE_NAMES[p]}, all processes", [r.cpu_ms(p) for r in results], ".1f")
        for p in phases
    ]
    for name, values in rates.items():
        ok = all(v >= GOAL_RATE for v in values)
        lines.append(
            _row(name, values, ",.0f", ">= 1,000,000", f"{vs_rate(values)}: {_verdict(ok)}")
        )
    lines += [
        _row("load time, s", [r.load_s for r in results], ".1f"),
        _row(
            "RSS of the 4 daemons (peak), GiB",
            [r.peak_rss_bytes / 2**30 for r in results],
            ".2f",
            "fits 24 GiB",
        ),
        "",
        "Throughputs are medians over batches of 100k (the load's batches; 5 overwrite "
        "batches; the timed iterations' reinforce phases). p99 of a few dozen iterations is "
        "close to their maximum.",
    ]
    return "\n".join(lines)


def redis_section(ours: ClusterResult, redis: RedisResult) -> str:
    title = f"### 3. The {ours.memories / 1e6:g}M iteration: ours (3 workers) vs Redis"
    if redis.skipped:
        return f"{title}\n\nSkipped: {redis.skipped}."
    lines = [
        f"{title} {redis.version} ({len(redis.iteration_s)} iterations)",
        "",
        "| phase | ours p50 ms | Redis p50 ms | Redis / ours |",
        "|---|---:|---:|---:|",
    ]
    for what in ours.phase_s:
        a = ours.ms(what)
        if what == "sweep":  # Redis does the three phases one after the other
            b = sum(redis.ms(p) for p in ("decay", "quality", "topk"))
        else:
            b = redis.ms(what)
        lines.append(f"| {PHASE_NAMES[what]} | {a:.1f} | {b:.1f} | {b / a:.1f}x |")
    a, b = ours.ms("iteration"), redis.ms("iteration")
    lines.append(f"| iteration | {a:.1f} | {b:.1f} | {b / a:.1f}x |")
    a, b = ours.ms("iteration", 99), redis.ms("iteration", 99)
    lines.append(f"| iteration p99 | {a:.1f} | {b:.1f} | {b / a:.1f}x |")
    speedup = redis.ms("iteration") / ours.ms("iteration")
    lines += [
        "",
        f"Goal: iteration {GOAL_VS_REDIS:g}x faster than Redis: {speedup:.1f}x, "
        f"{_verdict(speedup >= GOAL_VS_REDIS)}. redis-server CPU per iteration: "
        f"{np.median(redis.server_cpu_s) * 1e3:.0f} ms (median). Reinforce through a "
        f"redis-py pipeline instead of pre-encoded RESP: "
        f"{np.median(redis.redis_py_reinforce_s) * 1e3:.0f} ms. Redis quality has no "
        "sum/mean (no cheap way); ours has.",
    ]
    return "\n".join(lines)


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    mem = (
        int(
            next(
                line.split()[1]
                for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")
            )
        )
        / 2**20
    )
    return (
        f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, no GPU; Python "
        f"{platform.python_version()}, NumPy {np.__version__}, numba {numba.__version__} "
        f"({numba.get_num_threads()} threads)"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="kernels,cluster,redis,latency")
    p.add_argument("--sizes", default="1000000,10000000", help="cluster sizes, memories")
    p.add_argument("--kernel-n", type=int, default=10_000_000)
    p.add_argument("--kernel-repeats", type=int, default=7)
    p.add_argument("--iterations", type=int, default=40, help="timed iterations per size")
    p.add_argument("--iterations-10m", type=int, default=15, help="timed iterations at >= 10M")
    p.add_argument("--redis-iterations", type=int, default=10)
    p.add_argument("--redis-n", type=int, default=1_000_000, help="memories in the Redis part")
    p.add_argument("--latency-n", type=int, default=100_000, help="memories, latency part")
    p.add_argument("--latency-rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument(
        "--iteration",
        choices=("sweep", "separate"),
        default="sweep",
        help="cluster iteration: decay + quality + top-k as one sweep call, or three calls",
    )
    p.add_argument("--out", help="also write the report (Markdown) to this file")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    started = datetime.datetime.now().astimezone()
    command = " ".join(["python -m tests.benchmarks.bench_memory", *(argv or sys.argv[1:])])
    report = [f"Run {started:%Y-%m-%d %H:%M %Z}: `{command}`", "", f"Machine: {machine()}.", ""]

    def emit(text: str) -> None:
        print(text + "\n", flush=True)
        report.append(text + "\n")

    emit(f"_{_load()} at the start_")
    if "kernels" in parts:
        emit(kernel_section(args.kernel_n, args.kernel_repeats))
        emit(f"_{_load()}_")
    clusters: list[ClusterResult] = []
    if "cluster" in parts:
        for n in (int(s) for s in args.sizes.split(",")):
            t = time.perf_counter()
            its = args.iterations if n < 10_000_000 else args.iterations_10m
            clusters.append(run_cluster_bench(n, iterations=its, iteration=args.iteration))
            print(f"cluster {n:,}: {time.perf_counter() - t:.0f} s, {_load()}", flush=True)
        emit(cluster_section(clusters))
        emit(f"_{_load()}_")
    if "redis" in parts:
        ours = next((r for r in clusters if r.memories == args.redis_n), None)
        if ours is None:
            ours = run_cluster_bench(
                args.redis_n, iterations=args.iterations, iteration=args.iteration
            )
        redis = run_redis_bench(args.redis_n, iterations=args.redis_iterations)
        emit(redis_section(ours, redis))
        emit(f"_{_load()}_")
    if "latency" in parts:
        emit(latency_section(run_latency_bench(args.latency_n, args.latency_rounds)))
        emit(f"_{_load()} at the end_")
    if args.out:
        Path(args.out).write_text("\n".join(report))


if __name__ == "__main__":
    main()
