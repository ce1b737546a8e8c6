"""Recovery: time from kill -9 of a worker to replication factor 2 again, and the client's
write throughput during recovery as a ratio to before it.

A local cluster of 3 worker processes (heartbeat 0.2 s, timeout 1 s) is loaded with N
memories; a client reinforces batches of 10k random ids, one after another without pause.
Each repetition kills one worker with SIGKILL, waits until every slot has two live copies
again, then starts a fresh worker and waits for the rebalance so the next repetition starts
from 3 workers. The throughput ratio is the ids acknowledged per second from the kill to
replication factor 2 again, over the ids acknowledged per second in the 3 s before the kill;
an id counts when its worker acknowledges its part of a batch (``progress``), so the parts of
live primaries count without waiting for the part of the dead one. The table gives medians
over the repetitions. Not collected by pytest; ``make bench-recovery``
(``--sizes 100000,1000000,10000000 --repeats 3``: about 6 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from shared.cli.local_cluster import LocalCluster
from shared.client import Client

FAST = "heartbeat_interval_s: 0.2\nheartbeat_timeout_s: 1.0\n"


class Load:
    """Reinforces continuously, one batch after another; keeps (time, ids acknowledged).

    A sample is taken whenever a worker acknowledges its part of a batch (``progress``), so
    the parts of live primaries count when they are acknowledged, not when the part routed
    to a dead primary is, after the failover.
    """

    def __init__(self, client: Client, ids: np.ndarray) -> None:
        self.client, self.ids = client, ids
        self.samples: list[tuple[float, int]] = []
        self.failures = 0
        self.stop = False
        self._rng = np.random.default_rng(1)

    def _acked(self, n: int) -> None:
        self.samples.append((time.perf_counter(), n))

    async def run(self) -> None:
        while not self.stop:
            batch = self._rng.choice(self.ids, size=10_000)
            try:
                await self.client.reinforce(batch, np.full(10_000, 1e-4, np.float32), self._acked)
            except Exception:
                self.failures += 1

    def rate(self, t0: float, t1: float) -> float:
        """Acknowledged ids per second between t0 and t1."""
        n = sum(k for t, k in self.samples if t0 < t <= t1)
        return n / max(t1 - t0, 1e-9)


async def _replicated(client: Client, workers: int) -> bool:
    s = await client.status()
    alive = sum(1 for w in s["workers"] if w["state"] == "ALIVE")
    return (
        alive == workers
        and s["under_replicated_slots"] == 0
        and s["replication_factor"] == min(2, workers)
    )


async def _settled(client: Client, workers: int) -> bool:
    """RF 2 with every worker a primary: a joining worker gets slots only once the copies to
    it are done, so the rebalance after a join is over (its copies would slow the writes)."""
    s = await client.status()
    alive = [w for w in s["workers"] if w["state"] == "ALIVE"]
    return await _replicated(client, workers) and all(w["slots_primary"] > 0 for w in alive)


async def _wait(pred, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await pred():
        if time.monotonic() > deadline:
            raise TimeoutError("the cluster did not recover in time")
        await asyncio.sleep(0.02)


async def measure(n: int, repeats: int, root: Path) -> dict[str, Any]:
    cfg = root / "coordinator.yaml"
    cfg.write_text(FAST)
    cluster = LocalCluster(
        3, data_dir=root / "cluster", log_dir=root / "logs", coordinator_args=["--config", str(cfg)]
    )
    await asyncio.to_thread(cluster.start, 120.0)
    recover_s, ratios = [], []
    try:
        async with Client(cluster.address, timeout_s=120) as client:
            await client.wait_ready(120)
            ids = np.arange(1, n + 1, dtype=np.uint64)
            for i in range(0, n, 500_000):
                await client.upsert(
                    ids[i : i + 500_000], np.full(min(500_000, n - i), 0.5, np.float32)
                )
            load = Load(client, ids)
            task = asyncio.create_task(load.run())
            for rep in range(repeats):
                await _wait(lambda: _settled(client, 3), 300)
                await asyncio.sleep(3.0)
                t_kill = time.perf_counter()
                victim = rep % len(cluster.workers)
                await asyncio.to_thread(cluster.kill_worker, victim)
                await _wait(lambda: _replicated(client, 2), 300)
                t_ok = time.perf_counter()
                recover_s.append(t_ok - t_kill)
                ratios.append(load.rate(t_kill, t_ok) / load.rate(t_kill - 3.0, t_kill))
                cluster.workers[victim] = cluster.add_worker(f"worker-r{rep}")
                await _wait(lambda: _settled(client, 3), 300)
            load.stop = True
            await task
    finally:
        await asyncio.to_thread(cluster.stop)
    return {
        "memories": n,
        "recovery_s": statistics.median(recover_s),
        "throughput_ratio": statistics.median(ratios),
        "failures": load.failures,
        "ratios": ratios,
        "recoveries_s": recover_s,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100000,1000000,10000000")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    print("load average {:.2f} {:.2f} {:.2f} (1, 5, 15 min)".format(*os.getloadavg()))
    print(
        f"{'memories':>10} {'kill -9 to RF 2 (s)':>20} {'goal':>8} "
        f"{'writes during/before':>21} {'goal':>6} {'failed calls':>13}"
    )
    for n in (int(x) for x in a.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix="neuroshard-recovery-") as tmp:
            r = asyncio.run(measure(n, a.repeats, Path(tmp)))
        goal = "< 3 s" if n == 1_000_000 else ""
        print(
            f"{n:>10,} {r['recovery_s']:>20.2f} {goal:>8} {r['throughput_ratio']:>21.2f} "
            f"{'>= 0.5':>6} {r['failures']:>13}",
            flush=True,
        )
        print(
            f"{'':>10} each repetition: ratios "
            + ", ".join(f"{x:.2f}" for x in r["ratios"])
            + "; seconds to RF 2 "
            + ", ".join(f"{x:.2f}" for x in r["recoveries_s"])
        )
    print("load average {:.2f} {:.2f} {:.2f} (1, 5, 15 min)".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
