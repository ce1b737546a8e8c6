"""A data set larger than a worker's memory trains: peak RSS of every process against its limit.

A directory of ``.npy`` (``x`` uint8 [N, 1024] images, ``y`` int64 labels) of at least 1.5x
a worker's memory limit is uploaded with ``neuroshard data put`` (a directory streamed as an
uncompressed ``.npz``), then a 2-worker sync job trains on it: the coordinator maps the
archive's members and serves each worker its shard's rows (half the set each), the workers
stream them into their shard caches, map them and convert a batch at a time. A second job on
the same data then fetches nothing.

The limit: each worker process is moved into its own cgroup (v1 ``memory`` controller, or
v2) with the limit set (``memory.limit_in_bytes`` / ``memory.max``), so going over it would
get the worker OOM-killed, and the kernel's ``VmHWM`` (peak resident set, from
``/proc/PID/status``) of each process is read at the end and compared with the limit.
RLIMIT_AS is not used: torch reserves far more virtual address space than it touches (and
the mapped cache files count against it too), so an address-space limit says nothing about
memory use. Without a usable cgroup (not root, no controller) the peaks are only compared
with the stated limit. Not collected by pytest; ``make bench-data`` (about 2 minutes on 2
cores).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from shared.cli.local_cluster import LocalCluster
from shared.client import SyncClient

MiB = 1 << 20
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")


def write_set(root: Path, rows: int, features: int) -> int:
    """Write ``x`` uint8 [rows, features] and ``y`` int64 labels a block at a time; bytes."""
    root.mkdir(parents=True)
    x = np.lib.format.open_memmap(root / "x.npy", "w+", np.uint8, (rows, features))
    y = np.lib.format.open_memmap(root / "y.npy", "w+", np.int64, (rows,))
    rng = np.random.default_rng(0)
    for a in range(0, rows, 65536):
        b = min(rows, a + 65536)
        block = rng.integers(0, 256, size=(b - a, features), dtype=np.uint8)
        x[a:b] = block
        y[a:b] = (block[:, :8].astype(np.int64).sum(axis=1) > 8 * 127).astype(np.int64)
    x.flush()
    y.flush()
    del x, y
    return sum(f.stat().st_size for f in root.iterdir())


def vm_hwm(pid: int) -> int:
    """Peak resident set of a process (``VmHWM``), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def rss_parts(pid: int) -> tuple[int, int]:
    """A process's resident anonymous and file-backed memory now (RssAnon, RssFile), bytes."""
    parts = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("RssAnon", "RssFile"):
            parts[key] = int(line.split()[1]) * 1024
    return parts.get("RssAnon", 0), parts.get("RssFile", 0)


class Sampler:
    """Samples RssAnon and RssFile of processes every ``interval_s``; keeps each one's peak."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.1) -> None:
        self.pids, self.interval_s = pids, interval_s
        self.peaks = {name: [0, 0] for name in pids}
        self.phase = "start"
        self.by_phase: dict[str, dict[str, list[int]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for name, pid in self.pids.items():
                with contextlib.suppress(OSError):
                    anon, file = rss_parts(pid)
                    for peak in (
                        self.peaks[name],
                        self.by_phase.setdefault(self.phase, {}).setdefault(name, [0, 0]),
                    ):
                        peak[0], peak[1] = max(peak[0], anon), max(peak[1], file)

    def stop(self) -> dict[str, dict[str, int]]:
        self._stop.set()
        self._thread.join()
        return {n: {"anon": a, "file": f} for n, (a, f) in self.peaks.items()}


class MemoryLimit:
    """A cgroup with a memory limit that processes are moved into (v1 or v2), if usable."""

    def __init__(self, name: str, limit: int) -> None:
        self.path: Path | None = None
        self.version = 0
        for version, base, key in (
            (1, CGROUP_V1, "memory.limit_in_bytes"),
            (2, CGROUP_V2, "memory.max"),
        ):
            if version == 2 and not (base / "cgroup.controllers").exists():
                continue
            try:
                path = base / name
                path.mkdir(exist_ok=True)
                if version == 1:  # charges made before the move stay behind where unsupported
                    with contextlib.suppress(OSError):
                        (path / "memory.move_charge_at_immigrate").write_text("1")
                (path / key).write_text(str(limit))
                self.path, self.version = path, version
                return
            except OSError:
                continue

    def add(self, pid: int) -> None:
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(pid))

    def stats(self) -> dict[str, Any]:
        """The cgroup's peak usage (page cache included) and OOM kills."""
        if self.path is None:
            return {}
        if self.version == 1:
            oom = (self.path / "memory.oom_control").read_text()
            kills = [
                int(line.split()[1]) for line in oom.splitlines() if line.startswith("oom_kill ")
            ]
            return {
                "cgroup_max_usage_bytes": int(
                    (self.path / "memory.max_usage_in_bytes").read_text()
                ),
                "oom_kills": kills[0] if kills else 0,
            }
        events = dict(
            line.split() for line in (self.path / "memory.events").read_text().splitlines()
        )
        return {"oom_kills": int(events.get("oom_kill", 0))}

    def remove(self) -> None:
        if self.path is not None:
            try:
                self.path.rmdir()
            except OSError:
                pass


def put(address: str, directory: Path, name: str) -> tuple[float, int]:
    """``neuroshard data put DIR``; return its seconds and its peak RSS (VmHWM), bytes.

    VmHWM is polled until the process exits (rusage's ru_maxrss of a child can be its
    parent's at the fork).
    """
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "shared.cli", "data", "put", str(directory), "--name", name]
    proc = subprocess.Popen([*cmd, "--coordinator", address], stdout=subprocess.DEVNULL)
    peak = 0
    while proc.poll() is None:
        with contextlib.suppress(OSError, RuntimeError):
            peak = max(peak, vm_hwm(proc.pid))
        time.sleep(0.05)
    if proc.returncode != 0:
        raise RuntimeError(f"data put exited {proc.returncode}")
    return time.perf_counter() - t0, peak


def run_job(client: SyncClient, spec: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """Run a job to its end; return its result (with ``job_id``) and its seconds."""
    t0 = time.perf_counter()
    job = client.submit(spec)
    final = client.wait(job.job_id)
    if final.state != "SUCCEEDED":
        raise RuntimeError(f"job {final.job_id} {final.state}: {final.error}")
    return final.result | {"job_id": final.job_id}, time.perf_counter() - t0


def fetched(log_dir: Path, job_id: str) -> tuple[int, int]:
    """Bytes the workers fetched for a job and rows they found cached (their JSON logs)."""
    got, cached = 0, 0
    for log in log_dir.glob("worker-*.log"):
        for line in log.read_text().splitlines():
            if '"shard_fetched"' in line and job_id in line:
                event = json.loads(line)
                got, cached = got + event["bytes"], cached + event["cached_rows"]
    return got, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-mib", type=int, default=1024, help="each worker's memory limit")
    parser.add_argument("--ratio", type=float, default=1.6, help="data set size / limit")
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    limit = args.limit_mib * MiB
    rows = int(args.ratio * limit / (args.features + 8)) + 1
    with tempfile.TemporaryDirectory(prefix="neuroshard-bench-data-") as tmp:
        base = Path(tmp)
        t0 = time.perf_counter()
        size = write_set(base / "local" / "big", rows, args.features)
        gen_s = time.perf_counter() - t0
        config = base / "coordinator.yaml"
        config.write_text(
            f"data_roots: [{base / 'root'}]\nmax_dataset_bytes: {4 * size}\n"
            f"max_data_root_bytes: {4 * size}\nrpc_timeout_s: 600\n"
        )
        worker_config = base / "worker.yaml"
        worker_config.write_text("rpc_timeout_s: 600\n")
        limits = [MemoryLimit(f"neuroshard-bench-w{i}", limit) for i in range(2)]
        cluster = LocalCluster(
            2,
            data_dir=base / "cluster",
            log_dir=base / "logs",
            coordinator_args=["--config", str(config)],
            worker_args=["--config", str(worker_config)],
        )
        try:
            cluster.start()
            for lim, proc in zip(limits, cluster.workers, strict=True):
                lim.add(proc.pid)
            assert cluster.coordinator is not None
            sampler = Sampler(
                {
                    "coordinator": cluster.coordinator.pid,
                    **{f"worker-{i}": p.pid for i, p in enumerate(cluster.workers)},
                }
            )
            sampler.phase = "put"
            put_s, put_rss = put(cluster.address, base / "local" / "big", "big")
            spec = {
                "kind": "train",
                "workers": 2,
                "data": {"path": "big.npz"},
                "model": {"name": "mlp", "hidden": [32]},
                "batch_size": 256,
                "steps": args.steps,
                "test_fraction": 0.01,
                "optimizer": {"name": "sgd", "lr": 0.001},
            }
            with SyncClient(cluster.address) as client:
                sampler.phase = "job"
                result, job_s = run_job(client, spec)
                sampler.phase = "job again"
                again, again_s = run_job(client, spec)
            first_fetch = fetched(base / "logs", result["job_id"])
            again_fetch = fetched(base / "logs", again["job_id"])
            sampled = sampler.stop()
            peaks = {
                "coordinator": vm_hwm(cluster.coordinator.pid),
                **{f"worker-{i}": vm_hwm(p.pid) for i, p in enumerate(cluster.workers)},
            }
            cgroups = [lim.stats() for lim in limits]
        finally:
            cluster.stop()
            for lim in limits:
                lim.remove()
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "data_set_bytes": size,
        "rows": rows,
        "worker_limit_bytes": limit,
        "ratio": round(size / limit, 2),
        "limit_by": f"cgroup v{limits[0].version}" if limits[0].path else "none (stated only)",
        "generate_s": round(gen_s, 1),
        "put_s": round(put_s, 1),
        "put_peak_rss_bytes": put_rss,
        "job_s": round(job_s, 1),
        "second_job_s": round(again_s, 1),
        "fetched_bytes_and_cached_rows": {"job": first_fetch, "job again": again_fetch},
        "test_accuracy": round(float(result["test_accuracy"]), 4),
        "peak_rss_bytes": peaks,
        "sampled_peaks_bytes": sampled,
        "sampled_peaks_by_phase_mib": {
            phase: {n: [a // MiB, f // MiB] for n, (a, f) in peaks_.items()}
            for phase, peaks_ in sampler.by_phase.items()
        },
        "cgroups": cgroups,
        "under_limit": all(v < limit for k, v in peaks.items() if k.startswith("worker")),
    }
    print(json.dumps(report, indent=2))
    print(
        f"\ndata set {size / MiB:.0f} MiB = {size / limit:.2f} x the worker limit "
        f"{limit // MiB} MiB ({report['limit_by']})"
    )
    for name, peak in peaks.items():
        anon, file = sampled[name]["anon"] / MiB, sampled[name]["file"] / MiB
        print(
            f"  {name:12s} peak RSS {peak / MiB:7.0f} MiB "
            f"(sampled peaks: anonymous {anon:.0f} MiB, file-backed {file:.0f} MiB)"
        )
    print(f"  data put     peak RSS {put_rss / MiB:7.0f} MiB, {put_s:.1f} s")
    print(
        f"  job {job_s:.1f} s (fetched {first_fetch[0]} bytes), the same job again "
        f"{again_s:.1f} s (fetched {again_fetch[0]} bytes, {again_fetch[1]} rows cached)"
    )


if __name__ == "__main__":
    main()
