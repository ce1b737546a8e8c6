"""The memory iteration and client throughput on a local cluster of real worker processes.

Part 2 of ``make bench-memory`` (see ``bench_memory.py``). One coordinator and 3 workers run as
processes on loopback (``shared.local_cluster.LocalCluster``), each memory on two workers
(RF=2). The benchmark is a client (``shared.client.Client``) in this process, doing what the
``memory`` job does (``coordinator/memory/memory_job.py``) with the job's defaults
(``configs/jobs/memory-zipf.yaml``):

- load: generated memories upserted in batches of 100k (new ids: inserts);
- upsert overwrite: batches of 100k existing ids with new strengths;
- iterations: reinforce 100k accesses drawn from YCSB's scrambled Zipfian stream (theta
  0.99, boost 0.05), then decay 0.001, quality and top-100: by default as one ``sweep`` call
  (the job's way: one RPC per worker), with ``iteration="separate"`` as three calls (decay,
  quality, topk: the way before the sweep, and Redis's); each phase timed with
  ``perf_counter``; drawing the access batch is not counted (as in the job);
- reinforce throughput: the 100k accesses over the reinforce phase's time.

Memory use is read from ``/proc/PID/status`` (VmRSS now, VmHWM peak) of the 4 daemons. CPU
time per phase is read from ``/proc/PID/stat`` (utime + stime) of the 4 daemons and this
process before and after each phase: CPU ms per operation summed over all processes, much
less sensitive to other load on the machine than wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from coordinator.memory.access_stream import ScrambledZipfStream, generate_memories
from shared.cli.local_cluster import LocalCluster
from shared.client import Client

BATCH = 100_000
ALPHA, BOOST, DECAY_RATE, TOP_K, SEED = 0.99, 0.05, 0.001, 100, 0
PHASES = ("reinforce", "decay", "quality", "topk")  # iteration="separate" (and Redis)
SWEEP_PHASES = ("reinforce", "sweep")  # iteration="sweep": decay + quality + top-k in one call
ITERATIONS = {"separate": PHASES, "sweep": SWEEP_PHASES}
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass
class ClusterResult:
    """What one cluster size measured; times in seconds, rates in memories per second."""

    memories: int
    workers: int
    iteration: str = "sweep"
    start_s: float = 0.0
    load_s: float = 0.0
    insert_rates: list[float] = field(default_factory=list)  # per 100k batch of the load
    overwrite_rates: list[float] = field(default_factory=list)  # per 100k batch
    iteration_s: list[float] = field(default_factory=list)
    phase_s: dict[str, list[float]] = field(default_factory=dict)
    cpu_s: dict[str, list[float]] = field(default_factory=dict)  # per phase, all processes
    rss_bytes: int = 0  # sum of the daemons' VmRSS after the run
    peak_rss_bytes: int = 0  # sum of the daemons' VmHWM
    top_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint64))

    def cpu_ms(self, what: str) -> float:
        """Mean CPU time of a phase summed over the daemons and the client, ms.

        A mean, not a median: /proc counts CPU time in clock ticks (10 ms), far coarser than
        one phase, so only the total over all iterations is precise.
        """
        return float(np.mean(self.cpu_s[what]) * 1e3)

    def ms(self, what: str, q: float = 50) -> float:
        """Percentile ``q`` of an iteration's or a phase's time, ms."""
        s = self.iteration_s if what == "iteration" else self.phase_s[what]
        return float(np.percentile(np.asarray(s) * 1e3, q))

    @property
    def reinforce_rate(self) -> float:
        return BATCH / float(np.median(self.phase_s["reinforce"]))


def _proc_kib(pid: int, key: str) -> int:
    """A ``VmRSS``/``VmHWM`` line of /proc/PID/status, KiB (0 when the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_s(pids: list[int]) -> float:
    """utime + stime of processes (``/proc/PID/stat`` fields 14 and 15), seconds."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total * _TICK_S


def _memory_use(cluster: LocalCluster) -> tuple[int, int]:
    """(sum of VmRSS, sum of VmHWM) of the coordinator and workers, bytes."""
    pids = [p.pid for p in [cluster.coordinator, *cluster.workers] if p is not None]
    return (
        sum(_proc_kib(p, "VmRSS") for p in pids) * 1024,
        sum(_proc_kib(p, "VmHWM") for p in pids) * 1024,
    )


async def _load(c: Client, ids: np.ndarray, strengths: np.ndarray, r: ClusterResult) -> None:
    t0 = time.perf_counter()
    for start in range(0, len(ids), BATCH):
        end = min(start + BATCH, len(ids))
        t = time.perf_counter()
        await c.upsert(ids[start:end], strengths[start:end])
        r.insert_rates.append((end - start) / (time.perf_counter() - t))
    r.load_s = time.perf_counter() - t0


async def _overwrite(c: Client, ids: np.ndarray, batches: int, r: ClusterResult) -> None:
    rng = np.random.default_rng([SEED, 7])
    for _ in range(batches):
        start = int(rng.integers(0, max(1, len(ids) - BATCH)))
        part = ids[start : start + BATCH]
        values = rng.random(len(part), dtype=np.float32)
        t = time.perf_counter()
        await c.upsert(part, values)
        r.overwrite_rates.append(len(part) / (time.perf_counter() - t))


async def _iterate(
    c: Client,
    stream: ScrambledZipfStream,
    iterations: int,
    warmup: int,
    r: ClusterResult,
    pids: list[int],
) -> None:
    boosts = np.full(BATCH, BOOST, np.float32)
    phases = ITERATIONS[r.iteration]
    r.phase_s = {p: [] for p in phases}
    r.cpu_s = {p: [] for p in phases}

    async def sweep() -> None:
        _, _, r.top_ids, _ = await c.sweep(DECAY_RATE, TOP_K)

    async def top() -> None:
        r.top_ids, _ = await c.topk(TOP_K)

    steps = {
        "decay": lambda: c.decay(DECAY_RATE),
        "quality": c.quality,
        "topk": top,
        "sweep": sweep,
    }
    for i in range(warmup + iterations):
        accessed = stream.next_batch(i)
        steps["reinforce"] = lambda a=accessed: c.reinforce(a, boosts)
        times, cpus = [], []
        for p in phases:
            cpu0, t0 = _cpu_s(pids), time.perf_counter()
            await steps[p]()
            times.append(time.perf_counter() - t0)
            cpus.append(_cpu_s(pids) - cpu0)
        if i < warmup:
            continue
        for p, t, cpu in zip(phases, times, cpus, strict=True):
            r.phase_s[p].append(t)
            r.cpu_s[p].append(cpu)
        r.iteration_s.append(sum(times))


async def _run(
    address: str,
    n: int,
    iterations: int,
    warmup: int,
    overwrites: int,
    r: ClusterResult,
    cluster: LocalCluster,
) -> None:
    ids, strengths = generate_memories(n, SEED)
    stream = ScrambledZipfStream(ids, ALPHA, BATCH, SEED)
    async with Client(address, timeout_s=300.0) as c:
        await c.wait_ready(timeout_s=60.0)
        await _load(c, ids, strengths, r)
        await _overwrite(c, ids, overwrites, r)
        pids = [p.pid for p in [cluster.coordinator, *cluster.workers] if p is not None]
        await _iterate(c, stream, iterations, warmup, r, [*pids, os.getpid()])
        r.rss_bytes, r.peak_rss_bytes = _memory_use(cluster)


def run_cluster_bench(
    n: int,
    iterations: int = 30,
    warmup: int = 3,
    overwrites: int = 5,
    workers: int = 3,
    log_dir: str | None = None,
    iteration: str = "sweep",
) -> ClusterResult:
    """Start a local cluster, load ``n`` memories, time overwrites and iterations, stop it.

    Daemon logs go to ``log_dir`` (default: a temporary directory, removed afterwards).
    ``iteration``: "sweep" (decay + quality + top-k in one call) or "separate" (three calls).

    Raises:
        shared.local_cluster.ClusterStartError: the cluster did not start.
    """
    r = ClusterResult(memories=n, workers=workers, iteration=iteration)
    t = time.perf_counter()
    logs = tempfile.TemporaryDirectory(prefix="bench-cluster-logs-") if log_dir is None else None
    with (
        logs or contextlib.nullcontext(),
        LocalCluster(workers, log_dir=log_dir or (logs.name if logs else None)) as cluster,
    ):
        r.start_s = time.perf_counter() - t
        try:
            import uvloop

            uvloop.run(_run(cluster.address, n, iterations, warmup, overwrites, r, cluster))
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
            asyncio.run(_run(cluster.address, n, iterations, warmup, overwrites, r, cluster))
    return r
