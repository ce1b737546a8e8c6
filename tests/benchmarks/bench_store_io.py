"""``memory export`` / ``memory import`` beside the plain client paths they compete with.

One coordinator and 3 workers run as processes on loopback (``LocalCluster``), RF=2. Per
repetition, interleaved: export the whole store (``Client.export_memories``) against reading
every memory by id (``Client.get`` in 100k batches, what a script without export would do);
import the exported file (``Client.import_memories``, overwrites) against upserting the same
arrays in 100k batches (what ``memory load`` does). Medians of the repetitions, ratios.

CPU ms of each operation: utime + stime of the 4 daemons (``/proc/PID/stat``) plus this client
process (``os.times``), summed: much less sensitive to the shared machine's load than wall
time. Then the peak RSS of ``neuroshard memory export`` run as its own process (``wait4``),
at two store sizes: the client holds one chunk, not the store.

Run: ``.venv/bin/python -m tests.benchmarks.bench_store_io [N] [REPEATS]``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

from coordinator.memory.access_stream import generate_memories
from shared.cli.local_cluster import LocalCluster
from shared.client import Client
from tests.benchmarks.bench_cluster import _proc_kib

CLI = [sys.executable, "-m", "shared.cli"]

BATCH = 100_000
TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pids: list[int]) -> float:
    """utime + stime of ``pids`` (from /proc) and of this process, seconds."""
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime
    t = os.times()
    return total + t.user + t.system


async def _timed(pids: list[int], work: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    """(wall s, CPU s of every process) of one call."""
    c0, t0 = _cpu_s(pids), time.perf_counter()
    await work()
    return time.perf_counter() - t0, _cpu_s(pids) - c0


async def _compare(
    c: Client, pids: list[int], ids: np.ndarray, s: np.ndarray, tmp: Path, reps: int
):
    async def get_all() -> None:
        for a in range(0, len(ids), BATCH):
            await c.get(ids[a : a + BATCH])

    async def upsert_all() -> None:
        for a in range(0, len(ids), BATCH):
            await c.upsert(ids[a : a + BATCH], s[a : a + BATCH])

    path = tmp / "bench.npz"
    ops: dict[str, Callable[[], Awaitable[object]]] = {
        "export": lambda: c.export_memories(path),
        "get every id": get_all,
        "import": lambda: c.import_memories(path),
        "upsert in 100k batches": upsert_all,
    }
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in ops}
    for _ in range(reps):
        for name, work in ops.items():
            out[name].append(await _timed(pids, work))
    return out


def _export_rss(address: str, path: Path) -> tuple[float, int, int]:
    """(wall s, memories, peak RSS bytes) of ``neuroshard memory export`` as its own process.

    The peak is the child's ``VmHWM`` polled every 5 ms until it exits: ``wait4``'s
    ``ru_maxrss`` would count the pages this (large) process had when it forked the child.
    """
    t0 = time.perf_counter()
    p = subprocess.Popen(
        [*CLI, "memory", "export", str(path), "--json", "--coordinator", address],
        stdout=subprocess.PIPE,
    )
    peak = 0
    while p.poll() is None:
        peak = max(peak, _proc_kib(p.pid, "VmHWM"))
        time.sleep(0.005)
    out = p.communicate()[0]
    assert p.returncode == 0, "export failed"
    return time.perf_counter() - t0, json.loads(out)["memories"], peak * 1024


async def _run(cluster: LocalCluster, n: int, more: int, reps: int, tmp: Path) -> None:
    pids = [p.pid for p in [cluster.coordinator, *cluster.workers] if p is not None]
    ids, s = generate_memories(n + more, 0)
    async with Client(cluster.address, timeout_s=300.0) as c:
        await c.wait_ready(timeout_s=60.0)
        for a in range(0, n, BATCH):
            await c.upsert(ids[a : min(a + BATCH, n)], s[a : min(a + BATCH, n)])
        results = await _compare(c, pids, ids[:n], s[:n], tmp, reps)
        rss = [await asyncio.to_thread(_export_rss, cluster.address, tmp / "cli.npz")]
        for a in range(n, n + more, BATCH):
            await c.upsert(ids[a : min(a + BATCH, n + more)], s[a : min(a + BATCH, n + more)])
        rss.append(await asyncio.to_thread(_export_rss, cluster.address, tmp / "cli.npz"))
    print(f"{n} memories, 3 workers, RF 2, {reps} repetitions interleaved (medians)")
    print(f"load average: {os.getloadavg()}")
    print("| operation | wall s | memories/s | CPU ms, all processes |")
    print("|---|---|---|---|")
    med = {
        k: (float(np.median([w for w, _ in v])), float(np.median([c for _, c in v])))
        for k, v in results.items()
    }
    for name, (wall, cpu) in med.items():
        print(f"| {name} | {wall:.2f} | {n / wall:,.0f} | {cpu * 1e3:.0f} |")
    print(
        f"export / get: wall {med['export'][0] / med['get every id'][0]:.2f}x, "
        f"CPU {med['export'][1] / med['get every id'][1]:.2f}x"
    )
    print(
        f"import / upsert: wall {med['import'][0] / med['upsert in 100k batches'][0]:.2f}x, "
        f"CPU {med['import'][1] / med['upsert in 100k batches'][1]:.2f}x"
    )
    for wall, memories, peak in rss:
        print(f"CLI export of {memories} memories: {wall:.2f} s, peak RSS {peak / 2**20:.0f} MiB")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    with tempfile.TemporaryDirectory(prefix="bench-store-io-") as tmp, LocalCluster(3) as cluster:
        asyncio.run(_run(cluster, n, 3 * n, reps, Path(tmp)))


if __name__ == "__main__":
    main()
