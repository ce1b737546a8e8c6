"""Per-rank memory of ``sharding: fsdp`` against DDP (``sharding: none``) on a wider MLP.

W processes form a gloo group on loopback and build the allreduce job's replica
(``worker.allreduce.ddp_replica.Replica`` or ``worker.allreduce.fsdp_replica.FsdpReplica``)
exactly as the job's child process does, then train a few steps with Adam on digits. Each
rank reports the bytes of parameters and optimizer state it holds between steps (its shards
under FSDP: ``resident_bytes``), and the largest block's full parameters, which FSDP gathers
for the length of that block's forward (and again for its backward) on top of them; the table
gives rank 0's (ranks differ by at most one row of a matrix) and the mean step time. Not
collected by pytest; ``make bench-fsdp`` (about 1 minute on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shared.config import TrainJobSpec
from shared.training.activation_checkpointing import find_blocks
from shared.training.data import load_dataset
from worker.allreduce.ddp_replica import Replica
from worker.allreduce.fsdp_replica import FsdpReplica, resident_bytes

MIB = 1 << 20


def _rank(rank: int, world: int, port: int, spec_json: str, steps: int, out: Any) -> None:
    torch.set_num_threads(1)
    spec = TrainJobSpec.model_validate_json(spec_json)
    ds = load_dataset(spec.data, spec.seed, spec.test_fraction)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    cls = FsdpReplica if spec.sharding == "fsdp" else Replica
    r = cls(spec, ds.x_train, ds.y_train, ds.num_classes, torch.device("cpu"))
    model = r.start_generation(rank, world, b"")
    r.train_step(model, rank, world)  # the optimizer's state exists after a first step
    t0 = time.perf_counter()
    for _ in range(steps):
        r.train_step(model, rank, world)
    seconds = (time.perf_counter() - t0) / steps
    held = resident_bytes(r.model, r.optimizer)
    block = max(
        sum(p.numel() * 4 for p in b.parameters()) for b in find_blocks(r.model) or [r.model]
    )
    if rank == 0:
        out.put({**held, "block": block, "step_s": seconds})
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(sharding: str, world: int, hidden: list[int], steps: int) -> dict[str, float]:
    """Rank 0's resident parameter and optimizer bytes and step time for one configuration."""
    spec = TrainJobSpec(
        kind="train",
        strategy="allreduce",
        workers=world,
        sharding=sharding,  # type: ignore[arg-type]
        model={"name": "mlp", "hidden": hidden},  # type: ignore[arg-type]
        optimizer={"name": "adam", "lr": 1e-3},  # type: ignore[arg-type]
        batch_size=32,
        steps=steps + 1,
    )
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(
        _rank,
        args=(world, _free_port(), spec.model_dump_json(), steps, out),
        nprocs=world,
        start_method="spawn",
    )
    return dict(out.get(timeout=10))


def main() -> None:
    """Print the table of DDP and FSDP per-rank bytes for each world size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,3", help="comma-separated world sizes")
    parser.add_argument("--hidden", default="2048,2048,2048", help="the MLP's hidden widths")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    hidden = [int(h) for h in args.hidden.split(",")]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    print(f"mlp hidden {hidden} on digits (64 -> 10), Adam, batch 32 per rank, gloo on loopback")
    print(
        "| ranks | sharding | params MiB/rank | optimizer MiB/rank | together MiB/rank "
        "| + largest block gathered MiB | step ms |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for world in (int(w) for w in args.worlds.split(",")):
        for sharding in ("none", "fsdp"):
            m = measure(sharding, world, hidden, args.steps)
            gathered = f"{m['block'] / MIB:.1f}" if sharding == "fsdp" else "-"
            print(
                f"| {world} | {sharding} | {m['params'] / MIB:.1f} | {m['optimizer'] / MIB:.1f} "
                f"| {(m['params'] + m['optimizer']) / MIB:.1f} | {gathered} "
                f"| {m['step_s'] * 1000:.0f} |"
            )


if __name__ == "__main__":
    main()
