"""``neuroshard up`` and ``neuroshard demo``: a local cluster of daemon processes."""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from shared.cli.common import read_job_spec
from shared.cli.local_cluster import LocalCluster
from shared.cli.output import err_console, follow_job
from shared.client import SyncClient
from shared.netem.link_settings import LinkSettings
from shared.security.dev import SecureSetup


def run_up(
    workers: int,
    port: int,
    data_dir: str | None,
    secure: bool = False,
    links: list[LinkSettings | None] | None = None,
    coordinator_config: str | None = None,
    worker_config: str | None = None,
) -> int:
    """Run ``neuroshard up``: a local cluster in the foreground until Ctrl-C or SIGTERM.

    Prints the coordinator's address on stdout (for scripts) once every worker is ALIVE.

    Args:
        workers: number of worker processes.
        port: the coordinator's port on 127.0.0.1.
        data_dir: the cluster's data dir; None uses a temporary one, removed at the end.
        secure: mutual TLS and tokens, with files under the data dir; the settings a client
            needs are printed on stderr.
        links: worker i's emulated link, or None for a direct one (``LocalCluster``); each
            worker's link is printed on stderr.
        coordinator_config: the coordinator's YAML config (``--config``), or None.
        worker_config: every worker's YAML config, or None.

    Returns:
        The exit code: 0 after Ctrl-C or SIGTERM, 1 when a daemon exited by itself.
    """

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    # SIGINT too: a shell without job control starts `neuroshard up ... &` with SIGINT
    # ignored, and Python then installs no KeyboardInterrupt for it (`kill -INT` did nothing).
    previous_int = signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    cluster = LocalCluster(
        workers,
        port=port,
        data_dir=data_dir,
        secure=secure,
        links=links,
        dashboard=True,
        coordinator_args=["--config", coordinator_config] if coordinator_config else None,
        worker_args=["--config", worker_config] if worker_config else None,
    )
    try:
        address = cluster.start()
        err_console.print(
            f"neuroshard: coordinator at {address} with {workers} workers "
            f"({'mutual TLS, token auth' if secure else 'plaintext, no auth'}); "
            "Ctrl-C stops the cluster"
        )
        err_console.print(f"dashboard: {cluster.dashboard_url}", highlight=False)
        if cluster.secure is not None:
            print_secure_settings(cluster.secure, address)
        if links:
            print_links(cluster)
        print(address, flush=True)
        while True:
            for p in [cluster.coordinator, *cluster.workers, *cluster.proxies]:
                if p is not None and p.poll() is not None:
                    err_console.print(f"neuroshard: a daemon exited with code {p.returncode}")
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, previous_int)
        cluster.stop()


def print_links(cluster: LocalCluster) -> None:
    """Tell people, on stderr, which link each worker of the cluster is behind."""
    for i in range(cluster.n_workers):
        name = f"worker-{i}"
        link = cluster.links[i] if i < len(cluster.links) else None
        if link is None or name not in cluster.link_addresses:
            err_console.print(f"  {name}: direct link", highlight=False)
            continue
        worker_port, proxy = cluster.link_addresses[name]
        err_console.print(
            f"  {name}: advertised at {proxy} -> 127.0.0.1:{worker_port} ({link.describe()})",
            highlight=False,
        )


def print_secure_settings(setup: SecureSetup, address: str) -> None:
    """Tell people, on stderr, how to reach a secure local cluster and with which tokens."""
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
    """Run ``neuroshard demo``: start a local cluster, run one job, print the result, stop.

    The job asks for at most ``workers`` workers. When it does not succeed, the last lines
    of every daemon's log are printed on stderr before the temporary directory goes.

    Args:
        workers: number of worker processes.
        job_path: the job YAML.
        as_json: print the result as one JSON document.
        secure: run the cluster with mutual TLS and tokens.

    Returns:
        The exit code: 0 when the job succeeded, else 1.

    Raises:
        CliError: the job YAML is invalid (exit code 2).
        ClusterStartError: the cluster did not start.
    """
    spec = read_job_spec(job_path)
    spec["workers"] = min(int(spec.get("workers", workers)), workers) or workers
    with tempfile.TemporaryDirectory(prefix="neuroshard-demo-") as tmp:
        err_console.print(
            f"neuroshard demo: starting a coordinator and {workers} workers (logs in {tmp}/logs)"
        )
        with LocalCluster(
            workers, data_dir=tmp, log_dir=f"{tmp}/logs", secure=secure, dashboard=True
        ) as cluster:
            err_console.print(f"dashboard: {cluster.dashboard_url}", highlight=False)
            with SyncClient(cluster.address, security=cluster.security) as client:
                job = client.submit(spec)
                err_console.print(f"submitted {job_path} as {job.job_id}")
                final = follow_job(client, job, as_json=as_json)
        ok = final.state == "SUCCEEDED"
        if not ok:
            for log in sorted((Path(tmp) / "logs").glob("*.log")):
                sys.stderr.write(f"--- {log.name} (last lines)\n")
                sys.stderr.writelines(log.read_text().splitlines(True)[-20:])
    return 0 if ok else 1
