"""What the CLI shows: progress bars, tables, and the ``up``/``demo`` local clusters."""

from __future__ import annotations

import json
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from shared.client import JobInfo, SyncClient

if TYPE_CHECKING:
    from shared.dev_security import SecureSetup

TERMINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")
err_console = Console(stderr=True)
out_console = Console()


def _describe(progress: dict[str, Any]) -> str:
    parts = []
    if "epoch" in progress:
        parts.append(f"epoch {progress['epoch']}/{progress.get('epochs', '?')}")
    if "loss" in progress:
        parts.append(f"loss {progress['loss']:.4f}")
    acc = progress.get("test_accuracy")
    if isinstance(acc, float) and acc == acc:
        parts.append(f"acc {acc:.3f}")
    if "samples_per_s" in progress:
        parts.append(f"{progress['samples_per_s']:.0f} samples/s")
    if "iteration_ms" in progress:
        parts.append(f"{progress['iteration_ms']:.1f} ms/iter")
    if progress.get("phase") == "load":  # a memory job upserting before its iterations
        parts.append(f"loading {progress.get('loaded', 0)}/{progress.get('memories', '?')}")
    return "  ".join(parts)


def follow_job(client: SyncClient, job: JobInfo, as_json: bool) -> JobInfo:
    """Show a progress bar (on stderr, when it is a terminal) until the job ends.

    Prints the final JSON document (``--json``) or a short summary on stdout.
    """
    final = job
    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=err_console, disable=not err_console.is_terminal) as bar:
        task = bar.add_task(f"{job.job_id} QUEUED", total=None, info="")
        for final, progress in client.watch(job.job_id):
            total = progress.get("steps") or progress.get("iterations")
            done = progress.get("step") or progress.get("iteration") or 0
            bar.update(
                task,
                total=total,
                completed=done,
                info=_describe(progress),
                description=f"{final.job_id} {final.state}",
            )
    if final.state not in TERMINAL_STATES:  # the stream ended early: ask for the final state
        final = client.get_job(job.job_id)
    if as_json:
        print(json.dumps(final.summary()))
    else:
        print_result(final)
    return final


def print_result(job: JobInfo) -> None:
    """A human summary of a finished job."""
    if job.state != "SUCCEEDED":
        print(f"{job.job_id} {job.state}: {job.error}")
        return
    print(f"{job.job_id} SUCCEEDED")
    for key, value in (job.result or {}).items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif isinstance(value, dict | list):
            value = json.dumps(value)
        print(f"  {key}: {value}")


def print_status(status: dict[str, Any]) -> None:
    table = Table(title="workers")
    for col in ("name", "address", "state", "device", "memories", "primary", "replica"):
        table.add_column(col)
    for w in status["workers"]:
        table.add_row(
            w["name"],
            w["address"],
            w["state"],
            w["device"],
            str(w["memories"]),
            str(w["slots_primary"]),
            str(w["slots_replica"]),
        )
    out_console.print(table)
    jobs = ", ".join(f"{k.lower()} {v}" for k, v in status["jobs"].items() if v) or "none"
    out_console.print(f"jobs: {jobs}")
    if status.get("slots"):
        out_console.print(
            f"slots: {status['slots']}  epoch {status['slot_map_epoch']}  replication factor "
            f"{status['replication_factor']}  under-replicated {status['under_replicated_slots']}"
        )


def print_jobs(jobs: list[JobInfo]) -> None:
    table = Table()
    for col in ("job", "kind", "state", "workers", "error"):
        table.add_column(col)
    for j in jobs:
        table.add_row(j.job_id, j.kind, j.state, ",".join(j.workers), j.error)
    out_console.print(table)


def run_up(workers: int, port: int, data_dir: str | None, secure: bool = False) -> int:
    """``neuroshard up``: a local cluster in the foreground until Ctrl-C or SIGTERM; with
    ``secure``, mutual TLS and tokens (files under the data dir, settings printed)."""
    from shared.local_cluster import LocalCluster

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    cluster = LocalCluster(workers, port=port, data_dir=data_dir, secure=secure)
    try:
        address = cluster.start()
        err_console.print(
            f"neuroshard: coordinator at {address} with {workers} workers "
            f"({'mutual TLS, token auth' if secure else 'plaintext, no auth'}); "
            "Ctrl-C stops the cluster"
        )
        if cluster.secure is not None:
            print_secure_settings(cluster.secure, address)
        print(address, flush=True)
        while True:
            for p in [cluster.coordinator, *cluster.workers]:
                if p is not None and p.poll() is not None:
                    err_console.print(f"neuroshard: a daemon exited with code {p.returncode}")
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        cluster.stop()


def print_secure_settings(setup: SecureSetup, address: str) -> None:
    """Tell people how to reach a secure local cluster (on stderr)."""
    err_console.print(
        f"client settings: . {setup.env_file}\n"
        f"  or: --coordinator {address} {setup.client_flags()}\n"
        f"  (writer token: submit and cancel own jobs, write memories)\n"
        f"  admin token (every job, decay the whole store, drain workers): "
        f"{setup.admin_token_file}",
        highlight=False,
        soft_wrap=True,
    )


def run_demo(workers: int, job_path: str, as_json: bool, secure: bool = False) -> int:
    """``neuroshard demo``: start a local cluster, run one job, print the result, stop."""
    import tempfile

    from shared.cli import read_job_spec
    from shared.local_cluster import LocalCluster

    spec = read_job_spec(job_path)
    spec["workers"] = min(int(spec.get("workers", workers)), workers) or workers
    with tempfile.TemporaryDirectory(prefix="neuroshard-demo-") as tmp:
        err_console.print(
            f"neuroshard demo: starting a coordinator and {workers} workers (logs in {tmp}/logs)"
        )
        with LocalCluster(workers, data_dir=tmp, log_dir=f"{tmp}/logs", secure=secure) as cluster:
            with SyncClient(cluster.address, security=cluster.security) as client:
                job = client.submit(spec)
                err_console.print(f"submitted {job_path} as {job.job_id}")
                final = follow_job(client, job, as_json=as_json)
        ok = final.state == "SUCCEEDED"
        if not ok:
            for log in sorted((__import__("pathlib").Path(tmp) / "logs").glob("*.log")):
                sys.stderr.write(f"--- {log.name} (last lines)\n")
                sys.stderr.writelines(log.read_text().splitlines(True)[-20:])
    return 0 if ok else 1
