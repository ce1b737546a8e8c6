"""``make bench-replay``: a neuroshard replay table beside DeepMind's Reverb, in one run.

Both sides hold ``--items`` memories of 1 KiB payloads and are driven with batches of 256 from
one client process: inserts/s, prioritized samples/s with payloads (alpha 0.6) and p50/p99 of
one sample call, priority updates/s. Rounds are interleaved (Reverb, ours, Reverb, ours, ...),
each on a fresh table; the report gives the medians and the ratio ours / Reverb.

Ours: a local cluster of 3 worker processes and a coordinator (``LocalCluster``), replication
factor 2, the workers' default ``fsync: always`` (every insert and priority update is on two
workers and in both journals, fsynced, before its acknowledgement); a table of capacity
``4 * items`` with FIFO removal. Reverb: one server process (tests/benchmarks/
replay_peer_reverb.py, run by the Reverb virtual environment's Python that the make target
creates), one copy in memory, no disk. Reverb's ``Client.sample`` is the call compared with our
``Sample`` (one call, one batch); its ``TrajectoryDataset`` rate (tf.data, many samples in flight)
is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

from shared.cli.local_cluster import LocalCluster
from shared.client import SyncClient

BATCH = 256
PAYLOAD_BYTES = 1024
ALPHA = 0.6
METRICS = [
    ("inserts_per_s", "inserts/s", True),
    ("samples_per_s", "prioritized samples/s (one call of 256, payloads)", True),
    ("sample_p50_s", "sample call p50, ms", False),
    ("sample_p99_s", "sample call p99, ms", False),
    ("updates_per_s", "priority updates/s (calls of 256)", True),
]


def ours_round(client: SyncClient, table: str, items: int, calls: int, seed: int) -> dict[str, Any]:
    """Measure one round on a fresh table of the cluster behind ``client``."""
    client.create_table(table, capacity=4 * items, eviction="fifo")
    try:
        rng = np.random.default_rng(seed)
        payload = rng.integers(0, 256, PAYLOAD_BYTES, dtype=np.uint8).tobytes()
        priorities = (rng.random(items) + 1e-3).astype(np.float32).clip(0, 1)
        ids = np.arange(1, items + 1, dtype=np.uint64)
        t0 = time.perf_counter()
        for s in range(0, items, BATCH):
            client.upsert(
                ids[s : s + BATCH],
                priorities[s : s + BATCH],
                [payload] * len(ids[s : s + BATCH]),
                table=table,
            )
        insert_s = time.perf_counter() - t0
        sample_s: list[float] = []
        drawn = ids[:BATCH]
        for k in range(calls):
            t = time.perf_counter()
            b = client.sample(BATCH, alpha=ALPHA, seed=seed * 100_000 + k, table=table)
            sample_s.append(time.perf_counter() - t)
            drawn = b.ids
        if len(drawn) != BATCH or len(b.payloads[0] or b"") != PAYLOAD_BYTES:
            raise SystemExit("ours: a sample lacks its draws or payloads")
        update_s: list[float] = []
        for _ in range(calls):
            new = (rng.random(BATCH) + 1e-3).astype(np.float32).clip(0, 1)
            t = time.perf_counter()
            client.update_strengths(drawn, new, table=table)
            update_s.append(time.perf_counter() - t)
    finally:
        client.drop_table(table)
    return {
        "inserts_per_s": items / insert_s,
        "samples_per_s": BATCH * calls / sum(sample_s),
        "sample_p50_s": float(np.percentile(sample_s, 50)),
        "sample_p99_s": float(np.percentile(sample_s, 99)),
        "updates_per_s": BATCH * calls / sum(update_s),
    }


def reverb_round(python: str, items: int, calls: int, seed: int) -> dict[str, Any]:
    """Run the Reverb side once in its own virtual environment; return its JSON."""
    peer = Path(__file__).with_name("replay_peer_reverb.py")
    out = subprocess.run(
        [
            python,
            str(peer),
            "--items",
            str(items),
            "--calls",
            str(calls),
            "--seed",
            str(seed),
            "--alpha",
            str(ALPHA),
            "--batch",
            str(BATCH),
            "--payload-bytes",
            str(PAYLOAD_BYTES),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"reverb side failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(ours: list[dict[str, Any]], theirs: list[dict[str, Any]], items: int, calls: int) -> str:
    """Return the Markdown table of medians and ratios."""
    lines = [
        f"### Replay: {items:,} items of {PAYLOAD_BYTES} B, batches of {BATCH}, alpha {ALPHA}, "
        f"{calls} calls per measure, {len(ours)} interleaved rounds (medians)",
        "",
        f"| metric | neuroshard (3 workers, RF 2, fsync always) | Reverb {theirs[0]['version']} "
        "(1 server, 1 copy, memory) | ours / Reverb |",
        "|---|---:|---:|---:|",
    ]
    for key, label, higher in METRICS:
        a, b = median(r[key] for r in ours), median(r[key] for r in theirs)
        scale = 1000.0 if key.endswith("_s") and not key.endswith("per_s") else 1.0
        ratio = a / b if higher else b / a
        lines.append(
            f"| {label} | {a * scale:,.1f} | {b * scale:,.1f} | {ratio:.2f}x"
            f"{' (higher is better)' if higher else ' (speed: Reverb time / ours)'} |"
        )
    ds = median(r["dataset_samples_per_s"] for r in theirs)
    lines += [
        "",
        f"Reverb's TrajectoryDataset (tf.data, batches of {BATCH} with many samples in flight): "
        f"{ds:,.0f} samples/s.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Run the interleaved rounds and print (and with --out, write) the report."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reverb-python", required=True, help="the Reverb venv's python")
    p.add_argument("--items", type=int, default=100_000)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args(argv)
    ours: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        cluster = LocalCluster(3, data_dir=Path(tmp) / "cluster", log_dir=Path(tmp) / "logs")
        cluster.start(120.0)
        try:
            with SyncClient(cluster.address, timeout_s=60) as client:
                client.wait_ready(120)
                for r in range(a.rounds):
                    theirs.append(reverb_round(a.reverb_python, a.items, a.calls, r))
                    ours.append(ours_round(client, f"bench{r}", a.items, a.calls, r))
                    print(f"round {r}: reverb {theirs[-1]}\n         ours {ours[-1]}", flush=True)
        finally:
            cluster.stop()
    text = report(ours, theirs, a.items, a.calls)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
