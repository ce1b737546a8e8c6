"""Reverb's side of ``make bench-replay``: run by the Reverb virtual environment's Python.

DeepMind's Reverb (``dm-reverb`` 0.14 with the tensorflow 2.15 it pins) does not install beside
torch 2.13 and our numpy, so ``make bench-replay`` makes a separate virtual environment for it
and runs this file there; it imports nothing from neuroshard and prints one JSON document.

The server runs in its own process (a Reverb client in the server's process reads the table
directly, without gRPC, which would not be a service). One table: prioritized sampler
(``priority_exponent`` = alpha), FIFO remover, ``max_size`` larger than what is inserted,
``MinSize(1)`` rate limiter. Items are 1 KiB ``uint8`` payloads. Measured, from one client:

- inserts/s: items written in batches of ``batch`` with a ``TrajectoryWriter`` (one item per
  step, ``flush`` after each batch so the batch is on the server);
- sample call: ``Client.sample(table, num_samples=batch)`` read to the end (payloads and
  ``SampleInfo.probability``), per call latency (p50/p99 seconds) and samples/s;
- priority updates/s: ``Client.mutate_priorities`` of ``batch`` keys per call.

Reverb keeps one copy in memory on one server and does not write to disk unless a checkpoint is
asked for (none here).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

import numpy as np


def _serve(port_q: mp.Queue, stop_q: mp.Queue, alpha: float, max_size: int) -> None:
    import reverb

    table = reverb.Table(
        name="t",
        sampler=reverb.selectors.Prioritized(alpha),
        remover=reverb.selectors.Fifo(),
        max_size=max_size,
        rate_limiter=reverb.rate_limiters.MinSize(1),
    )
    server = reverb.Server(tables=[table])
    port_q.put(server.port)
    stop_q.get()
    server.stop()


def _version() -> str:
    from importlib.metadata import version

    return version("dm-reverb")


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _dataset_rate(port: int, a: argparse.Namespace) -> float:
    """Samples/s through ``TrajectoryDataset`` batched by ``a.batch`` (Reverb's training path)."""
    import reverb
    import tensorflow as tf

    ds = reverb.TrajectoryDataset(
        server_address=f"localhost:{port}",
        table="t",
        dtypes=(tf.uint8,),
        shapes=(tf.TensorShape([a.payload_bytes]),),
        max_in_flight_samples_per_worker=2 * a.batch,
    ).batch(a.batch)
    it = iter(ds)
    next(it)  # warm-up: graph building
    t0 = time.perf_counter()
    for _ in range(a.calls):
        batch = next(it)
    elapsed = time.perf_counter() - t0
    if batch.data[0].shape != (a.batch, a.payload_bytes):
        raise SystemExit(f"reverb: unexpected dataset batch {batch.data[0].shape}")
    return a.batch * a.calls / elapsed


def main() -> None:
    """Measure and print one JSON document (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--items", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--payload-bytes", type=int, default=1024)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--calls", type=int, default=300, help="sample and update calls measured")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    import reverb

    ctx = mp.get_context("spawn")
    port_q: mp.Queue = ctx.Queue()
    stop_q: mp.Queue = ctx.Queue()
    server = ctx.Process(target=_serve, args=(port_q, stop_q, a.alpha, 4 * a.items), daemon=True)
    server.start()
    try:
        port = port_q.get(timeout=120)
        client = reverb.Client(f"localhost:{port}")
        rng = np.random.default_rng(a.seed)
        payload = rng.integers(0, 256, a.payload_bytes, dtype=np.uint8)
        priorities = rng.random(a.items) + 1e-3

        t0 = time.perf_counter()
        with client.trajectory_writer(num_keep_alive_refs=1) as writer:
            for start in range(0, a.items, a.batch):
                for i in range(start, min(start + a.batch, a.items)):
                    writer.append({"payload": payload})
                    writer.create_item(
                        "t", priority=float(priorities[i]), trajectory=writer.history["payload"][-1]
                    )
                writer.flush()
        insert_s = time.perf_counter() - t0

        sample_s: list[float] = []
        keys: list[int] = []
        for _ in range(a.calls):
            t = time.perf_counter()
            got = list(client.sample("t", num_samples=a.batch, emit_timesteps=False))
            sample_s.append(time.perf_counter() - t)
            keys = [int(s.info.key) for s in got]
        if len(got) != a.batch or got[0].data[0].nbytes != a.payload_bytes:
            raise SystemExit(f"reverb: unexpected sample {got[0]}")
        dataset_per_s = _dataset_rate(port, a)

        update_s: list[float] = []
        for _ in range(a.calls):
            updates = {k: float(v) for k, v in zip(keys, rng.random(len(keys)) + 1e-3, strict=True)}
            t = time.perf_counter()
            client.mutate_priorities("t", updates=updates)
            update_s.append(time.perf_counter() - t)

        print(
            json.dumps(
                {
                    "peer": "reverb",
                    "version": _version(),
                    "items": a.items,
                    "batch": a.batch,
                    "payload_bytes": a.payload_bytes,
                    "inserts_per_s": a.items / insert_s,
                    "sample_p50_s": _percentile(sample_s, 50),
                    "sample_p99_s": _percentile(sample_s, 99),
                    "samples_per_s": a.batch * len(sample_s) / sum(sample_s),
                    "dataset_samples_per_s": dataset_per_s,
                    "updates_per_s": a.batch * len(update_s) / sum(update_s),
                    "update_p50_s": _percentile(update_s, 50),
                }
            )
        )
    finally:
        stop_q.put(None)
        server.join(timeout=30)
        if server.is_alive():
            server.kill()


if __name__ == "__main__":
    main()
