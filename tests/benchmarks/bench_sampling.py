"""Prioritized sampling and bulk priority updates on a local cluster (``make bench-sampling``).

A local cluster of 3 worker processes (RF=2, the workers' default ``fsync: always``) holds
``n`` memories (default 100k) with 1 KiB payloads. One async client in this process, one call
at a time, times with ``perf_counter``:

- ``sample``: ``Client.sample(256, alpha=0.6)`` with payloads, the store unchanged between
  calls (the workers' sampling structure is current: two RPC rounds and the draws);
- ``learner step``: a priority update of the 256 ids just drawn, then the next sample (each
  update marks up to 256 slots stale, which the next sample rebuilds);
- ``priority update``: ``Client.update_strengths`` of 256 random stored ids.

Reported: p50/p99 ms per call, samples/s (256 / mean sample time) and priority updates/s
(256 / mean update time). A measurement, not a test: nothing is asserted. The comparison
with Reverb (issue 23 item 5) is a later step.

Usage: ``python -m tests.benchmarks.bench_sampling [--memories N] [--calls C] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from shared.cli.local_cluster import LocalCluster
from shared.client import Client

BATCH = 256
PAYLOAD_BYTES = 1024
LOAD_BATCH = 5000
ALPHA = 0.6


@dataclass
class SamplingResult:
    """Wall times (s) of each call, by operation."""

    memories: int
    workers: int
    times_s: dict[str, list[float]] = field(default_factory=dict)

    def ms(self, op: str, q: float) -> float:
        """Percentile ``q`` of one operation's wall time, ms."""
        return float(np.percentile(np.asarray(self.times_s[op]) * 1e3, q))

    def per_s(self, op: str) -> float:
        """Items (256 a call) per second at the mean call time."""
        return BATCH / float(np.mean(self.times_s[op]))

    def summary(self) -> dict[str, object]:
        """The figures as one JSON-ready dict."""
        return {
            "memories": self.memories,
            "workers": self.workers,
            "batch": BATCH,
            "payload_bytes": PAYLOAD_BYTES,
            "alpha": ALPHA,
            **{
                op: {
                    "p50_ms": round(self.ms(op, 50), 3),
                    "p99_ms": round(self.ms(op, 99), 3),
                    "items_per_s": round(self.per_s(op)),
                    "calls": len(t),
                }
                for op, t in self.times_s.items()
            },
        }


async def _timed(result: SamplingResult, op: str, call: object) -> object:
    t = time.perf_counter()
    out = await call  # type: ignore[misc]
    result.times_s.setdefault(op, []).append(time.perf_counter() - t)
    return out


async def _run(address: str, n: int, calls: int, warmup: int, r: SamplingResult) -> None:
    rng = np.random.default_rng(23)
    ids = rng.choice(1 << 62, n, replace=False).astype(np.uint64)
    async with Client(address, timeout_s=120) as c:
        await c.wait_ready(60)
        for a in range(0, n, LOAD_BATCH):
            part = ids[a : a + LOAD_BATCH]
            payloads = [rng.bytes(PAYLOAD_BYTES) for _ in range(len(part))]
            await c.upsert(part, rng.random(len(part), dtype=np.float32), payloads)
        for i in range(warmup):
            await c.sample(BATCH, alpha=ALPHA, seed=i)
            await c.update_strengths(ids[:BATCH], rng.random(BATCH, dtype=np.float32))
        r.times_s.clear()
        for i in range(calls):
            await _timed(r, "sample", c.sample(BATCH, alpha=ALPHA, seed=i))
        drawn = (await c.sample(BATCH, alpha=ALPHA)).ids
        for _ in range(calls):
            new = rng.random(BATCH, dtype=np.float32)
            t = time.perf_counter()
            await c.update_strengths(drawn, new)
            drawn = (await c.sample(BATCH, alpha=ALPHA)).ids
            r.times_s.setdefault("learner step", []).append(time.perf_counter() - t)
        for _ in range(calls):
            chosen = ids[rng.integers(0, n, BATCH)]
            new = rng.random(BATCH, dtype=np.float32)
            await _timed(r, "priority update", c.update_strengths(chosen, new))


def run_sampling_bench(
    n: int = 100_000, calls: int = 200, warmup: int = 10, workers: int = 3
) -> SamplingResult:
    """Start a local cluster, load ``n`` memories with 1 KiB payloads, time the calls, stop it.

    Raises:
        shared.cli.local_cluster.ClusterStartError: the cluster did not start.
    """
    r = SamplingResult(memories=n, workers=workers)
    with (
        tempfile.TemporaryDirectory(prefix="bench-sampling-logs-") as logs,
        LocalCluster(workers, log_dir=logs) as cluster,
    ):
        asyncio.run(_run(cluster.address, n, calls, warmup, r))
    return r


def main() -> None:
    """Run the benchmark and print its table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memories", type=int, default=100_000)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    r = run_sampling_bench(args.memories, args.calls)
    if args.json:
        print(json.dumps(r.summary(), indent=2))
        return
    print(
        f"{r.workers} workers (RF=2, fsync always), {r.memories} memories with "
        f"{PAYLOAD_BYTES} B payloads, batches of {BATCH}, alpha {ALPHA}"
    )
    print(f"{'operation':<18}{'p50 ms':>9}{'p99 ms':>9}{'items/s':>11}")
    for op in r.times_s:
        print(f"{op:<18}{r.ms(op, 50):>9.2f}{r.ms(op, 99):>9.2f}{r.per_s(op):>11.0f}")


if __name__ == "__main__":
    main()
