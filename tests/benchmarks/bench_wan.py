"""``make bench-wan``: sync training over slow, uneven and flaky links, side by side.

Two parts (``--parts``):

- wan: one local cluster of 4 workers, each behind a ``neuroshard link`` proxy from
  ``configs/links-wan.yaml`` (2 fast: 1 ms / 1000 Mbit; 1 slow: 100 ms / 20 Mbit; 1 flaky:
  50 ms, a connection reset every 4 MB). A digits MLP wide enough that transfer matters
  (hidden [512, 512]: 301,066 parameters, 1.2 MB of float32 each way per worker per step)
  trains for ``--epochs`` epochs with three specs, taking turns round by round for
  ``--repeats`` rounds: naive ``sync`` (fixed batches, wait, no compression), network-aware
  ``sync`` (proportional batches, backup, int8 or top-k with error feedback) and ``diloco``.
  Reported per runner (medians over the rounds): time to the target test accuracy (training
  seconds to the first epoch whose test accuracy reaches it), final test accuracy, bytes sent
  both ways, and the compute utilization of the two fast workers (their seconds of forward
  and backward over the job's wall seconds); and the per-round ratio of naive's time to
  the others'.
- compression: a 3-worker cluster on direct loopback links trains a 1.86M-parameter MLP
  (hidden [1024, 1024] on 784 synthetic features, 28x28-sized inputs) with each scheme;
  bytes per step both ways against float32, and test accuracy.

Not collected by pytest; run with ``python -m tests.benchmarks.bench_wan``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from shared.cli.local_cluster import LocalCluster
from shared.client import SyncClient
from shared.netem.link_settings import load_links

ROOT = Path(__file__).resolve().parents[2]
TARGET = 0.95


def wan_job(epochs: int, **extra: Any) -> dict[str, Any]:
    """The digits job of the wan part: 4 workers, a 301k-parameter MLP."""
    return {
        "kind": "train",
        "workers": 4,
        "model": {"name": "mlp", "hidden": [512, 512]},
        "data": "digits",
        "optimizer": {"name": "adam", "lr": 0.001},
        "epochs": epochs,
        "batch_size": 32,
        "seed": 0,
        **extra,
    }


def runners(epochs: int, scheme: str) -> dict[str, dict[str, Any]]:
    """The specs compared in the wan part, by name."""
    return {
        "naive sync": wan_job(epochs, health_threshold=0.0),
        "aware sync": wan_job(
            epochs,
            batch_policy="proportional",
            straggler={"mode": "backup", "deadline_factor": 2.0},
            compression={"name": scheme, "ratio": 0.01},
        ),
        # 12 inner steps: a whole epoch of a worker's shard (1437 rows / 4 / 32), so one
        # round trip per epoch; backups for the slow and the flaky worker's pieces.
        "diloco": wan_job(
            epochs,
            strategy="diloco",
            optimizer={"name": "adamw", "lr": 0.001},
            inner_steps=12,
            straggler={"mode": "backup", "deadline_factor": 2.0},
            compression={"name": scheme, "ratio": 0.01},
        ),
    }


def run(client: SyncClient, spec: dict[str, Any]) -> dict[str, Any]:
    """Submit, wait, and reduce the result to the figures of one row."""
    job = client.submit(spec)
    final = client.wait(job.job_id)
    if final.state != "SUCCEEDED":
        raise RuntimeError(f"{spec.get('strategy', 'sync')} job {final.state}: {final.error}")
    r = final.result
    tta = next(
        (e["seconds"] for e in r["history"] if e["test_accuracy"] >= TARGET),
        float("nan"),
    )
    fast = [r["workers"][w]["compute_s"] for w in ("worker-0", "worker-1") if w in r["workers"]]
    return {
        "tta_s": tta,
        "accuracy": r["test_accuracy"],
        "bytes": r["bytes_to_workers"] + r["bytes_from_workers"],
        "utilization": statistics.median(fast) / r["seconds"] if fast else float("nan"),
        "seconds": r["seconds"],
        "backups": r.get("backup_pieces", 0),
        "failures": r["worker_failures"],
    }


def wan_part(args: argparse.Namespace) -> None:
    """The wan part's table (medians over ``args.repeats`` rounds)."""
    links = load_links(ROOT / "configs" / "links-wan.yaml")
    specs = {
        n: s for n, s in runners(args.epochs, args.scheme).items() if n in args.runners.split(",")
    }
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in specs}
    with tempfile.TemporaryDirectory() as logs, LocalCluster(4, log_dir=logs, links=links) as c:
        client = SyncClient(c.address)
        client.wait_ready()
        for rnd in range(args.repeats):
            for name, spec in specs.items():
                rows[name].append(run(client, spec))
                print(f"round {rnd + 1} {name}: {rows[name][-1]}", flush=True)
        client.close()
    naive = rows.get("naive sync") or next(iter(rows.values()))
    print(
        f"\n| runner | time to {TARGET} (s) | speed-up vs naive | final accuracy | MB sent "
        "| fast workers' compute utilization | backups | worker failures |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, runs in rows.items():
        reached = [r for r in runs if r["tta_s"] == r["tta_s"]]  # NaN: target not reached
        ratios = [
            n["tta_s"] / r["tta_s"]
            for n, r in zip(naive, runs, strict=True)
            if r["tta_s"] == r["tta_s"] and n["tta_s"] == n["tta_s"]
        ]
        tta = f"{_median(reached, 'tta_s'):.1f}" if reached else "not reached"
        if len(reached) < len(runs):
            tta += f" ({len(reached)} of {len(runs)} rounds reached it)"
        speedup = f"{statistics.median(ratios):.2f}x" if ratios else "-"
        print(
            f"| {name} | {tta} | {speedup} "
            f"| {_median(runs, 'accuracy'):.4f} | {_median(runs, 'bytes') / 1e6:.1f} "
            f"| {_median(runs, 'utilization'):.2f} | {_median(runs, 'backups'):.0f} "
            f"| {_median(runs, 'failures'):.0f} |"
        )


def compression_part(args: argparse.Namespace) -> None:
    """Bytes per step and accuracy of each scheme on a 1.86M-parameter MLP."""
    base = {
        "kind": "train",
        "workers": 3,
        "model": {"name": "mlp", "hidden": [1024, 1024]},
        "data": {"name": "synthetic", "samples": 3000, "features": 784, "classes": 10},
        "optimizer": {"name": "adam", "lr": 0.0005},
        "epochs": args.compression_epochs,
        "batch_size": 32,
        "seed": 0,
    }
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as logs, LocalCluster(3, log_dir=logs) as c:
        client = SyncClient(c.address)
        client.wait_ready()
        for scheme in ("none", "fp16", "int8", "topk"):
            job = client.submit(base | {"compression": {"name": scheme, "ratio": 0.01}})
            final = client.wait(job.job_id)
            assert final.state == "SUCCEEDED", final.error
            r = final.result
            results[scheme] = {
                "up": r["bytes_from_workers"] / r["steps"],
                "down": r["bytes_to_workers"] / r["steps"],
                "accuracy": r["test_accuracy"],
            }
            print(f"{scheme}: {results[scheme]}", flush=True)
        client.close()
    none = results["none"]
    print(
        "\n| scheme | gradient bytes / step | x fewer | parameter bytes / step | x fewer "
        "| test accuracy |"
    )
    print("|---|---|---|---|---|---|")
    for scheme, r in results.items():
        print(
            f"| {scheme} | {r['up'] / 1e6:.2f} MB | {none['up'] / r['up']:.1f}x "
            f"| {r['down'] / 1e6:.2f} MB | {none['down'] / r['down']:.1f}x "
            f"| {r['accuracy']:.4f} |"
        )


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def main() -> None:
    """Parse the flags and run the parts."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="wan,compression")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--compression-epochs", type=int, default=3)
    p.add_argument("--scheme", default="int8", choices=["fp16", "int8", "topk"])
    p.add_argument("--runners", default="naive sync,aware sync,diloco")
    args = p.parse_args()
    parts = args.parts.split(",")
    if "wan" in parts:
        wan_part(args)
    if "compression" in parts:
        compression_part(args)


if __name__ == "__main__":
    main()
