"""``make bench-learner``: the seed roadmap's three validations of the memory store as a learner.

Run: ``.venv/bin/python -m tests.benchmarks.bench_learner [--quick] [--out F.md]``. Not
collected by pytest (``tests/integration/test_bench_learner.py`` runs ``--quick``). Each part
prints every measurement as a Markdown table:

1. scale: a ``kind: memory`` job of ``--scale-memories`` (10M) memories and 20 iterations of
   reinforce (a Zipf batch) + decay(0.01) (+ quality, top-k and convergence, one sweep and one
   read), submitted to the coordinator: the job's convergence, ``iteration_ms`` p50 and std
   dev over the iterations, peak RSS (VmHWM) of every process, the GPU or "no GPU".
2. distributed: 5 workers, 100,000 memories, 50 iterations driven from this client, each
   reinforce + sweep (decay + quality + top-k: the aggregate) + a read of the accessed
   memories (convergence), exactly as the memory job's iteration: convergence, iteration
   latency p50 (target 50 ms) and std dev, network bandwidth over the iterations' wall time
   from the daemons' own byte counters (what they sent, as servers and as clients; and every
   message on the wire, the sum of what they served), per-worker CPU
   utilisation and the balance max/min of memories and CPU across workers, consistency (the
   top-k's rank order equal to ``tests/memory_reference.py``'s after every iteration), and
   memories lost (the store's count against the memories loaded).
3. fault tolerance: part 2 again, same seed, with worker-1 killed (SIGKILL) once iteration 25
   is done: seconds from the kill to the coordinator declaring it DEAD and to every slot
   having two live copies again, memories lost (%), convergence degradation against part 2
   (``100 * (c_undisturbed - c_killed) / c_undisturbed`` after the last iteration; 0 when
   every write is applied exactly once), latency p50 before and after the kill, consistency.

4. training (``tests/benchmarks/learner_training.py``): the digits job with ``strategy: sync``
   on 2 workers, prioritized vs uniform sampling, ``--seeds`` (5) each: steps, epochs and wall
   seconds to test accuracy ``--target-accuracy`` (0.95), medians.
5. gpt (the same module): the GPT example (``strategy: allreduce``, 2 workers) on the first
   9,600 rows of ``--gpt-data`` (``chars.npz`` of ``make example-data``; the part is skipped
   without it), prioritized vs uniform, ``--seeds`` each: steps, epochs and wall seconds to
   validation loss ``--target-loss``, medians.

Convergence (README, "Memory jobs: convergence and quality";
``shared.memory.stats.convergence_ratio``): after an iteration's reinforce and decay, the mean
strength of the distinct memories that iteration reinforced over the table's mean strength.

Daemons are processes (``LocalCluster``; SIGKILL, ``/proc`` figures per process) unless
``--inprocess``; ``--quick`` runs all four parts at small sizes with in-process daemons (a
smoke run: its figures say nothing about performance; ``--quick --processes`` with processes).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.memory.access_stream import ScrambledZipfStream, generate_memories
from shared.client import Client, NeuroshardError
from shared.config import LogConfig
from shared.logging import configure_logging
from shared.memory.stats import Quality, convergence_ratio
from tests.benchmarks import learner_training
from tests.benchmarks.learner_daemons import (
    Daemons,
    InProcessDaemons,
    ProcessDaemons,
    WireTotals,
)
from tests.memory_reference import ReferenceStore

GPT_TARGET_LOSS = 2.3  # nats per character, the GPT part's validation loss
TARGET_ITERATION_MS = 50.0  # the roadmap's per-iteration target at 100k, 5 workers
HEARTBEATS = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.0}
LOAD_BATCH = 100_000
KILLS = {"processes": "SIGKILL", "in-process": "in-process: stopped serving at once"}
SWEEP_RETRY_S = 60.0  # a sweep is retried with its op id (exactly-once) this long


@dataclass(frozen=True)
class Params:
    """One distributed run: sizes, the access stream and the iteration's operations."""

    workers: int = 5
    memories: int = 100_000
    iterations: int = 50
    batch: int = 10_000  # accesses per iteration (Zipf)
    alpha: float = 0.99
    boost: float = 0.05
    decay: float = 0.01
    k: int = 100
    seed: int = 0
    kill_at: int | None = None  # iterations done when worker-1 is killed
    slots: int = 1024


@dataclass
class Run:
    """What one distributed run measured."""

    params: Params
    daemons: str = ""
    iteration_s: list[float] = field(default_factory=list)
    convergence: list[float] = field(default_factory=list)
    topk_identical: list[bool] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    wire: WireTotals = field(default_factory=WireTotals)
    cpu_s: dict[str, float] = field(default_factory=dict)
    peak_rss: dict[str, int] = field(default_factory=dict)
    memories_held: dict[str, int] = field(default_factory=dict)
    victim: str = ""
    detect_s: float = float("nan")
    restore_s: float = float("nan")


def ms(seconds: list[float], q: float = 50) -> float:
    """Percentile ``q`` of durations in seconds, in milliseconds (nan for none)."""
    return float(np.percentile(np.asarray(seconds) * 1e3, q)) if seconds else float("nan")


def table(rows: list[tuple[str, str]], head: tuple[str, str] = ("measurement", "value")) -> str:
    """A two-column Markdown table."""
    lines = [f"| {head[0]} | {head[1]} |", "|---|---:|"]
    return "\n".join(lines + [f"| {a} | {b} |" for a, b in rows])


def _ratio(values: list[float]) -> str:
    low = min(values) if values else 0.0
    return f"{max(values) / low:.2f}" if low > 0 else "n/a"


def _quality(q: dict[str, Any]) -> Quality:
    return Quality(q["count"], q["sum"], q["mean"], q["min"], q["max"], tuple(q["histogram"]))


def make_daemons(workers: int, inprocess: bool, slots: int) -> Daemons:
    """Daemons with fast heartbeats (a kill is detected within about 1 s)."""
    if inprocess:
        return InProcessDaemons(workers, {**HEARTBEATS, "slots": slots})
    yaml = "".join(f"{k}: {v}\n" for k, v in {**HEARTBEATS, "slots": slots}.items())
    return ProcessDaemons(workers, yaml)


# --- 1. scale: a memory job -------------------------------------------------------------


def gpu_figures() -> str:
    """``utilisation %, memory MiB`` of every GPU nvidia-smi lists, or "no GPU"."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no GPU"
    done = subprocess.run(
        [smi, "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0 or not done.stdout.strip():
        return "no GPU"
    gpus = [line.split(",") for line in done.stdout.strip().splitlines()]
    return "; ".join(f"GPU {i}: {u.strip()} %, {m.strip()} MiB" for i, (u, m) in enumerate(gpus))


async def scale(memories: int, iterations: int, batch: int, workers: int, inprocess: bool) -> str:
    """Run the scale part; return its table."""
    spec = {
        "kind": "memory",
        "name": "bench-learner-scale",
        "workers": workers,
        "memories": memories,
        "iterations": iterations,
        "decay_rate": 0.01,
        "access": {"distribution": "zipf", "alpha": 0.99, "batch": batch, "boost": 0.05},
        "topk": 100,
        "seed": 0,
    }
    daemons = make_daemons(workers, inprocess, 1024)
    try:
        await daemons.start()
        async with Client(daemons.address, timeout_s=600) as client:
            await client.wait_ready(300)
            job = await client.submit(spec)
            gpu_during = gpu_figures()
            final = await client.wait(job.job_id)
            stats = daemons.proc_stats()
    finally:
        await daemons.stop()
    if final.state != "SUCCEEDED":
        raise RuntimeError(f"the scale job {final.state}: {final.error}")
    r = final.result or {}
    rows = [
        ("daemons", f"{daemons.kind}: coordinator + {workers} workers, RF 2"),
        ("memories", f"{r['memories']:,}"),
        ("iterations (reinforce + decay(0.01) + quality + top-100)", str(r["iterations"])),
        ("access batch (Zipf 0.99), boost", f"{batch:,}, 0.05"),
        ("convergence after the last iteration", f"{r['convergence']:.4f}"),
        ("table mean strength after the last iteration", f"{r['quality']['mean']:.4f}"),
        ("iteration p50, ms", f"{r['iteration_ms_p50']:.1f}"),
        ("iteration std dev, ms", f"{r['iteration_ms_std']:.1f}"),
        ("iteration p99, ms (the slowest shows here)", f"{r['iteration_ms_p99']:.1f}"),
        ("load, s", f"{r['load_s']:.1f}"),
    ]
    rows += [
        (f"peak RSS (VmHWM) {n}, MiB", f"{s.peak_rss_bytes / 2**20:,.0f}") for n, s in stats.items()
    ]
    rows.append(("GPU (during the job)", gpu_during))
    return f"### 1. Scale: {memories:,} memories, {iterations} iterations\n\n{table(rows)}"


# --- 2 and 3. distributed iterations, with or without a kill ---------------------------


async def watch_recovery(
    client: Client, victim: str, left: int, t_kill: float
) -> tuple[float, float]:
    """Seconds from ``t_kill`` until ``victim`` is DEAD, and until every slot has 2 live copies.

    Polls the coordinator's status every 50 ms.
    """
    detect = None
    while True:
        s = await client.status()
        now = time.perf_counter()
        states = {w["name"]: w["state"] for w in s["workers"]}
        if detect is None and states.get(victim) == "DEAD":
            detect = now - t_kill
        alive = sum(1 for st in states.values() if st == "ALIVE")
        if (
            detect is not None
            and alive == left
            and s["under_replicated_slots"] == 0
            and s["replication_factor"] == 2
        ):
            return detect, now - t_kill
        await asyncio.sleep(0.05)


async def sweep(client: Client, p: Params, i: int) -> tuple[dict[str, Any], np.ndarray]:
    """Decay + quality + top-k; retried with the same op id (applied once) while UNAVAILABLE."""
    deadline = time.monotonic() + SWEEP_RETRY_S
    op_id = f"bench-learner/{p.seed}/{i}/decay".encode()
    while True:
        try:
            _, q, ids, _ = await client.sweep(p.decay, p.k, True, op_id)
            assert q is not None
            return q, ids
        except NeuroshardError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def iterate(daemons: Daemons, client: Client, p: Params, run: Run) -> None:
    """Load, then run ``p.iterations`` iterations against the reference; fill ``run``."""
    ids, strengths = generate_memories(p.memories, p.seed)
    for a in range(0, p.memories, LOAD_BATCH):
        await client.upsert(ids[a : a + LOAD_BATCH], strengths[a : a + LOAD_BATCH])
    ref = ReferenceStore(slots=p.slots)
    ref.upsert(ids, strengths)
    stream = ScrambledZipfStream(np.unique(ids), p.alpha, p.batch, p.seed)
    boosts = np.full(p.batch, p.boost, np.float32)
    cpu0 = {n: s.cpu_s for n, s in daemons.proc_stats().items()}
    wire0 = await daemons.rpc_bytes()
    watcher: asyncio.Task[tuple[float, float]] | None = None
    t_start = time.perf_counter()
    for i in range(p.iterations):
        if p.kill_at is not None and i == p.kill_at:
            run.victim = await daemons.kill_worker(1)
            watcher = asyncio.create_task(
                watch_recovery(client, run.victim, p.workers - 1, time.perf_counter())
            )
        accessed = stream.next_batch(i)
        t0 = time.perf_counter()
        await client.reinforce(accessed, boosts)
        q, top_ids = await sweep(client, p, i)
        found, s, _ = await client.get(np.unique(accessed))
        hit = s[found]
        mean = float(np.mean(hit, dtype=np.float64)) if len(hit) else 0.0
        run.iteration_s.append(time.perf_counter() - t0)
        run.convergence.append(convergence_ratio(mean, len(hit), _quality(q)))
        run.counts.append(int(q["count"]))
        ref.reinforce(accessed, boosts)
        ref.decay(p.decay)
        run.topk_identical.append(np.array_equal(top_ids, ref.topk(p.k)[0]))
    run.wall_s = time.perf_counter() - t_start
    wire1 = await daemons.rpc_bytes()
    stats = daemons.proc_stats()
    # A killed worker's counters went with it: bytes are the survivors' (a lower bound).
    run.wire = wire1 - wire0
    run.cpu_s = {n: s.cpu_s - cpu0[n] for n, s in stats.items() if n in cpu0}
    run.peak_rss = {n: s.peak_rss_bytes for n, s in stats.items()}
    if watcher is not None:
        run.detect_s, run.restore_s = await asyncio.wait_for(watcher, 300)
    status = await client.status()
    run.memories_held = {
        w["name"]: int(w["memories"]) for w in status["workers"] if w["state"] == "ALIVE"
    }


async def distributed(p: Params, inprocess: bool) -> Run:
    """One distributed run (part 2, or part 3 with ``p.kill_at``) on fresh daemons."""
    daemons = make_daemons(p.workers, inprocess, p.slots)
    run = Run(p, daemons=daemons.kind)
    try:
        await daemons.start()
        async with Client(daemons.address, timeout_s=120) as client:
            await client.wait_ready(300)
            await iterate(daemons, client, p, run)
    finally:
        await daemons.stop()
    return run


def _identical(run: Run) -> str:
    n = sum(run.topk_identical)
    return f"{n}/{len(run.topk_identical)} iterations" + (
        "" if n == len(run.topk_identical) else " **differ**"
    )


def _lost(run: Run) -> int:
    return run.params.memories - (run.counts[-1] if run.counts else 0)


def distributed_section(run: Run) -> str:
    """Part 2's table."""
    p = run.params
    p50 = ms(run.iteration_s)
    workers = {n: c for n, c in run.cpu_s.items() if n.startswith("worker-")}
    rows = [
        ("daemons", f"{run.daemons}: coordinator + {p.workers} workers, RF 2, {p.slots} slots"),
        ("memories, iterations", f"{p.memories:,}, {p.iterations}"),
        ("access batch (Zipf 0.99), boost, decay, k", f"{p.batch:,}, {p.boost}, {p.decay}, {p.k}"),
        ("convergence after the last iteration", f"{run.convergence[-1]:.4f}"),
        (
            f"iteration p50, ms (target {TARGET_ITERATION_MS:g} ms)",
            f"{p50:.1f} ({'met' if p50 <= TARGET_ITERATION_MS else '**not met**'})",
        ),
        ("iteration std dev, ms", f"{float(np.std(np.asarray(run.iteration_s) * 1e3)):.1f}"),
        ("wall time of the iterations, s", f"{run.wall_s:.2f}"),
        (
            "network: bytes the daemons sent (as servers and as clients), Mbit/s",
            f"{run.wire.sent * 8 / run.wall_s / 1e6:.1f}",
        ),
        (
            "network: every RPC message on the wire (what the daemons served), Mbit/s",
            f"{run.wire.on_the_wire * 8 / run.wall_s / 1e6:.1f}",
        ),
    ]
    rows += [
        (f"CPU {n}, % of one core", f"{c / run.wall_s * 100:.0f}") for n, c in run.cpu_s.items()
    ]
    rows.append(
        (
            "CPU balance across workers, max/min",
            _ratio(list(workers.values())) if workers else "n/a (in-process)",
        )
    )
    rows += [(f"memories of {n} (primary copies)", f"{m:,}") for n, m in run.memories_held.items()]
    rows += [
        (
            "memories balance across workers, max/min",
            _ratio([float(m) for m in run.memories_held.values()]),
        ),
        ("top-k rank order equal to the reference", _identical(run)),
        ("memories lost (count after the last iteration)", f"{_lost(run):,}"),
    ]
    rows += [(f"peak RSS (VmHWM) {n}, MiB", f"{b / 2**20:,.0f}") for n, b in run.peak_rss.items()]
    return f"### 2. Distributed: {p.workers} workers, {p.memories:,} memories\n\n{table(rows)}"


def fault_section(run: Run, undisturbed: Run) -> str:
    """Part 3's table, against the undisturbed run (same seed and sizes)."""
    p = run.params
    assert p.kill_at is not None
    c0, c1 = undisturbed.convergence[-1], run.convergence[-1]
    worst = max(
        abs(a - b) / a for a, b in zip(undisturbed.convergence, run.convergence, strict=True)
    )
    rows = [
        ("daemons", f"{run.daemons}: coordinator + {p.workers} workers, RF 2"),
        (f"worker killed ({KILLS[run.daemons]}), after iteration", f"{run.victim}, {p.kill_at}"),
        ("seconds to detect (declared DEAD)", f"{run.detect_s:.2f}"),
        ("seconds to restore two copies of every slot", f"{run.restore_s:.2f}"),
        ("memories lost, %", f"{100 * _lost(run) / p.memories:.3f}"),
        ("convergence, undisturbed / with the kill", f"{c0:.4f} / {c1:.4f}"),
        ("convergence degradation, % (last iteration)", f"{100 * (c0 - c1) / c0:.3f}"),
        ("largest convergence difference over the iterations, %", f"{100 * worst:.3f}"),
        ("iteration p50 before the kill, ms", f"{ms(run.iteration_s[: p.kill_at]):.1f}"),
        ("iteration p50 after the kill, ms", f"{ms(run.iteration_s[p.kill_at :]):.1f}"),
        ("slowest iteration (the one the kill hit), ms", f"{ms(run.iteration_s, 100):.1f}"),
        ("top-k rank order equal to the reference", _identical(run)),
    ]
    title = f"### 3. Fault tolerance: {p.workers} workers, {p.memories:,} memories, one killed"
    return f"{title}\n\n{table(rows)}"


# --- main ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """The sizes of one report: the scale job's and the distributed runs'."""

    scale_memories: int
    scale_iterations: int
    scale_batch: int
    scale_workers: int
    distributed: Params
    kill_at: int


QUICK = Sizes(
    20_000,
    5,
    2_000,
    2,
    Params(workers=3, memories=5_000, iterations=8, batch=500, k=20, slots=64),
    4,
)
FULL = Sizes(10_000_000, 20, 100_000, 3, Params(), 25)


async def run_all(parts: set[str], quick: bool, inprocess: bool, emit: Any) -> None:
    """Run the parts asked for, emitting each table as it is ready."""
    z = QUICK if quick else FULL
    if "scale" in parts:
        emit(
            await scale(
                z.scale_memories, z.scale_iterations, z.scale_batch, z.scale_workers, inprocess
            )
        )
    p = z.distributed
    undisturbed = None
    if parts & {"distributed", "fault"}:
        undisturbed = await distributed(p, inprocess)
        if "distributed" in parts:
            emit(distributed_section(undisturbed))
    if "fault" in parts:
        assert undisturbed is not None
        killed = await distributed(replace(p, kill_at=z.kill_at), inprocess)
        emit(fault_section(killed, undisturbed))


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, run, print (and with ``--out`` write) the report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="scale,distributed,fault,training,gpt")
    ap.add_argument("--quick", action="store_true", help="small sizes, in-process daemons")
    ap.add_argument("--inprocess", action="store_true", help="daemons in this process")
    ap.add_argument(
        "--processes", action="store_true", help="with --quick: daemons as processes all the same"
    )
    ap.add_argument("--out", help="also write the report (Markdown) to this file")
    ap.add_argument("--seeds", type=int, default=5, help="training: seeds per sampling")
    ap.add_argument("--first-seed", type=int, default=0, help="training, gpt: the first seed")
    ap.add_argument("--target-accuracy", type=float, default=0.95, help="training: digits")
    ap.add_argument("--gpt-data", type=Path, help="gpt: the example's chars.npz (else skipped)")
    ap.add_argument("--target-loss", type=float, default=GPT_TARGET_LOSS, help="gpt")
    ap.add_argument("--gpt-epochs", type=int, default=12, help="gpt: the most epochs a run")
    args = ap.parse_args(argv)
    command = " ".join(
        ["python -m tests.benchmarks.bench_learner", *(argv if argv is not None else sys.argv[1:])]
    )
    started = datetime.datetime.now().astimezone()
    load = "load average {:.2f} {:.2f} {:.2f} (1, 5, 15 min)".format(*os.getloadavg())
    report = [f"Run {started:%Y-%m-%d %H:%M %Z}: `{command}`; {os.cpu_count()} cores, {load}", ""]

    def emit(text: str) -> None:
        print(text + "\n", flush=True)
        report.append(text + "\n")

    print(report[0] + "\n", flush=True)
    inprocess = args.inprocess or (args.quick and not args.processes)
    if inprocess:  # the daemons would log every RPC on this output
        configure_logging(LogConfig(level="warning"))
    parts = set(args.parts.split(","))
    asyncio.run(run_all(parts, args.quick, inprocess, emit))
    if "training" in parts:
        # --quick: one seed to a low target, so the run ends at its first evaluation
        seeds, epochs, target = (
            (1, 3, 0.3) if args.quick else (args.seeds, 30, args.target_accuracy)
        )
        work = learner_training.digits(target)
        runs = learner_training.run(work, seeds, epochs, args.first_seed)
        emit(learner_training.section(4, work, runs, seeds, epochs))
    if "gpt" in parts and args.gpt_data is None:
        print("gpt: skipped (no --gpt-data; `make bench-learner` passes the example's)\n")
    elif "gpt" in parts:
        seeds, epochs, rows = (
            (1, 1, 960) if args.quick else (args.seeds, args.gpt_epochs, learner_training.GPT_ROWS)
        )
        work = learner_training.gpt(args.gpt_data, args.target_loss, rows)
        runs = learner_training.run(work, seeds, epochs, args.first_seed)
        emit(learner_training.section(5, work, runs, seeds, epochs))
    if args.out:
        Path(args.out).write_text("\n".join(report))


if __name__ == "__main__":
    main()
