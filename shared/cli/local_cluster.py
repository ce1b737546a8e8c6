"""A local cluster of real processes: one coordinator and N workers on loopback.

Used by ``neuroshard up`` and ``neuroshard demo``, and by tests and benchmarks. Every process
is stopped (SIGTERM, then SIGKILL after a grace period) when the cluster stops. A worker
may sit behind an emulated link: a ``neuroshard link`` process in front of it, whose address
the worker advertises, so the coordinator and peers reach it through the link.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from shared.client import NeuroshardError, SyncClient
from shared.netem.link_settings import LinkSettings
from shared.security.dev import SecureSetup, prepare
from shared.security.transport import ChannelSecurity


class ClusterStartError(RuntimeError):
    """A daemon exited, or the cluster did not become ready in time; the message says which."""


class LocalCluster:
    """A coordinator and N workers as child processes on 127.0.0.1.

    Start it with ``start()`` or ``with LocalCluster(3) as c:``; ``c.address`` is then the
    coordinator's ``host:port``. The processes run ``python -m shared.cli`` with the same
    interpreter; their output goes to ``log_dir``, or else to this process's stdout and stderr.
    """

    def __init__(
        self,
        workers: int,
        port: int = 0,
        data_dir: str | Path | None = None,
        log_dir: str | Path | None = None,
        coordinator_args: list[str] | None = None,
        worker_args: list[str] | None = None,
        secure: bool = False,
        links: list[LinkSettings | None] | None = None,
        dashboard: bool = False,
    ) -> None:
        """Describe the cluster; nothing starts before ``start()``.

        Args:
            workers: number of worker processes, named ``worker-0`` ... ``worker-{N-1}``.
            port: the coordinator's port; 0 picks a free one.
            data_dir: holds every daemon's data dir; None uses a temporary directory that
                ``stop()`` removes.
            log_dir: where each daemon writes ``NAME.log``; None leaves their output on
                this process's stdout and stderr.
            coordinator_args: extra flags of ``neuroshard coordinator``.
            worker_args: extra flags of every ``neuroshard worker``.
            secure: mutual TLS and token auth with material generated under the data dir
                (``shared.security.dev``; each worker gets a worker token for its name);
                ``self.security`` is then the admin's client security.
            links: the link of worker i is ``links[i]`` (None, or past the list's end: a
                direct link). A worker with a link listens on a free port picked up front,
                behind a ``neuroshard link`` process on another; it advertises the proxy's
                address (``link_addresses``).
            dashboard: serve the coordinator's web dashboard on a free port picked up front
                (kept across coordinator restarts); ``dashboard_url`` is then its page.

        Raises:
            ValueError: more links than workers.
        """
        if links is not None and len(links) > workers:
            raise ValueError(f"{len(links)} links for {workers} workers")
        self.n_workers = workers
        self.links = list(links or [])
        self.port = port
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="neuroshard-")
            data_dir = self._tmp.name
        self.data_dir = Path(data_dir)
        self.log_dir = Path(log_dir) if log_dir else None
        self._coordinator_args = coordinator_args or []
        self._worker_args = worker_args or []
        self.secure: SecureSetup | None = None
        self.security: ChannelSecurity | None = None
        if secure:
            self.secure = prepare(self.data_dir)
            self.security = self.secure.client_security(admin=True)
            self._coordinator_args += self.secure.coordinator_args()
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        self.proxies: list[subprocess.Popen[bytes]] = []
        # worker name -> (its listen port, its proxy's address), kept across restarts
        self.link_addresses: dict[str, tuple[int, str]] = {}
        self._logs: list[IO[Any]] = []
        self._names: dict[int, str] = {}  # pid -> the process's name, for messages
        self.address = ""
        self.dashboard_port: int | None = _free_port() if dashboard else None

    @property
    def dashboard_url(self) -> str | None:
        """The dashboard's page (HTTPS for a secure cluster), or None without a dashboard."""
        if self.dashboard_port is None:
            return None
        scheme = "https" if self.secure is not None else "http"
        return f"{scheme}://127.0.0.1:{self.dashboard_port}/"

    def _spawn(
        self, name: str, args: list[str], share_stdout: bool = True
    ) -> subprocess.Popen[bytes]:
        """Start ``python -m shared.cli ARGS`` as ``name``, its output in ``NAME.log``.

        Without a log dir its output goes to ours, but for ``share_stdout=False``: its
        stdout is dropped (a link prints its address there, which would pass for the
        coordinator's that ``up`` prints for scripts).
        """
        out: IO[Any] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (closed in stop())
            self._logs.append(out)
        cmd = [sys.executable, "-m", "shared.cli", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        stdout = out if out is not None or share_stdout else subprocess.DEVNULL
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=out, env=env, stdin=subprocess.DEVNULL)
        self._names[proc.pid] = name
        return proc

    def start(self, timeout_s: float = 60.0) -> str:
        """Start every process and wait until all workers are ALIVE; return the address.

        What started is stopped again when this fails (a chaos run under load once left a
        cluster running after its start timed out).

        Raises:
            ClusterStartError: a process exited early or the deadline passed.
        """
        deadline = time.monotonic() + timeout_s
        try:
            self.address = self._start_coordinator(self.port, deadline)
            for i in range(self.n_workers):
                link = self.links[i] if i < len(self.links) else None
                self.add_worker(f"worker-{i}", link=link)
            self.wait_workers(self.n_workers, deadline)
        except BaseException:
            self.stop()
            raise
        if self.secure is not None:
            self.secure.write_env(self.address)
        return self.address

    def _start_coordinator(self, port: int, deadline: float) -> str:
        """Start the coordinator and wait for its ready file; return its address."""
        ready = self.data_dir / "coordinator.addr"
        ready.unlink(missing_ok=True)
        self.coordinator = self._spawn(
            "coordinator",
            [
                "coordinator",
                "--listen",
                f"127.0.0.1:{port}",
                "--data-dir",
                str(self.data_dir / "coordinator"),
                "--metrics-port",
                "0",
                "--ready-file",
                str(ready),
                *(
                    ["--dashboard-port", str(self.dashboard_port)]
                    if self.dashboard_port is not None
                    else []
                ),
                *self._coordinator_args,
            ],
        )
        return self._wait_ready(ready, deadline)

    def _wait_ready(self, ready: Path, deadline: float) -> str:
        """Poll every 0.05 s until a daemon wrote its address to ``ready``; return it."""
        while not ready.exists() or not ready.read_text():
            self._check_alive(deadline)
            time.sleep(0.05)
        return ready.read_text().strip()

    def _start_link(self, name: str, link: LinkSettings, deadline: float) -> tuple[int, str]:
        """Start a ``neuroshard link`` in front of worker ``name``; return its ports' record.

        Returns:
            The port the worker must listen on (free when picked; the window until the
            worker binds it is short) and the proxy's ``host:port``, which it advertises.
        """
        worker_port = _free_port()
        ready = self.data_dir / f"link-{name}.addr"
        ready.unlink(missing_ok=True)
        self.proxies.append(
            self._spawn(
                f"link-{name}",
                [
                    "link",
                    "--listen",
                    "127.0.0.1:0",
                    "--target",
                    f"127.0.0.1:{worker_port}",
                    "--ready-file",
                    str(ready),
                    *link.cli_args(),
                ],
                share_stdout=False,
            )
        )
        return worker_port, self._wait_ready(ready, deadline)

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator (no shutdown at all) and wait for it."""
        assert self.coordinator is not None
        self.coordinator.kill()
        self.coordinator.wait()

    def restart_coordinator(self, timeout_s: float = 60.0) -> None:
        """Start a new coordinator on the same port and data dir (after ``kill_coordinator``).

        Raises:
            ClusterStartError: it exited, or wrote no address within ``timeout_s`` seconds.
        """
        port = int(self.address.rpartition(":")[2])
        self.address = self._start_coordinator(port, time.monotonic() + timeout_s)

    def kill_all(self) -> None:
        """SIGKILL every process of the cluster (a power cut, as far as processes go)."""
        for p in [self.coordinator, *self.workers]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()

    def restart_all(self, timeout_s: float = 120.0) -> None:
        """Start the coordinator and workers again with the same port, names and data dirs.

        Raises:
            ClusterStartError: a process exited, or the workers were not all ALIVE within
                ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        self.restart_coordinator(timeout_s)
        names = [f"worker-{i}" for i in range(len(self.workers))]
        self.workers = []
        for name in names:
            self.add_worker(name)
        self.wait_workers(len(names), deadline)

    def kill_worker(self, index: int) -> subprocess.Popen[bytes]:
        """SIGKILL one worker process and wait for it; return the dead process."""
        proc = self.workers[index]
        proc.kill()
        proc.wait()
        return proc

    def add_worker(
        self,
        name: str,
        extra: list[str] | None = None,
        link: LinkSettings | None = None,
        timeout_s: float = 30.0,
    ) -> subprocess.Popen[bytes]:
        """Start one more worker process named ``name``, without waiting for it.

        Args:
            name: the worker's name; its data dir is ``DATA_DIR/NAME``.
            extra: flags added after the cluster's own.
            link: put the worker behind a new link proxy with these settings (waiting up to
                ``timeout_s`` for the proxy); a worker restarted under the same name keeps
                its proxy and port whatever ``link`` says.
            timeout_s: seconds to wait for a new proxy's address.

        Returns:
            The process.

        Raises:
            ClusterStartError: the proxy exited or wrote no address in time.
        """
        listen, advertise = "127.0.0.1:0", []
        if link is not None and name not in self.link_addresses:
            self.link_addresses[name] = self._start_link(name, link, time.monotonic() + timeout_s)
        if name in self.link_addresses:
            port, proxy_address = self.link_addresses[name]
            listen, advertise = f"127.0.0.1:{port}", ["--advertise-address", proxy_address]
        proc = self._spawn(
            name,
            [
                "worker",
                "--coordinator",
                self.address,
                "--listen",
                listen,
                *advertise,
                "--name",
                name,
                "--data-dir",
                str(self.data_dir / name),
                *self._worker_args,
                *(self.secure.worker_args(name) if self.secure is not None else []),
                *(extra or []),
            ],
        )
        self.workers.append(proc)
        return proc

    def wait_workers(self, n: int, deadline: float) -> None:
        """Poll the coordinator every 0.1 s until at least ``n`` workers are ALIVE.

        Args:
            n: workers to wait for.
            deadline: ``time.monotonic()`` value to give up at.

        Raises:
            ClusterStartError: a process exited, or the deadline passed.
        """
        with SyncClient(self.address, timeout_s=5.0, security=self.security) as client:
            while True:
                self._check_alive(deadline)
                try:
                    alive = [w for w in client.status()["workers"] if w["state"] == "ALIVE"]
                except NeuroshardError:
                    alive = []
                if len(alive) >= n:
                    return
                time.sleep(0.1)

    def _check_alive(self, deadline: float) -> None:
        """Raise ClusterStartError if a process exited (not by SIGKILL) or time is up."""
        for proc in [self.coordinator, *self.workers, *self.proxies]:
            if proc is not None and proc.poll() is not None and proc.returncode != -9:
                name = self._names.get(proc.pid, "a daemon")
                raise ClusterStartError(f"{name} exited with code {proc.returncode}")
        if time.monotonic() > deadline:
            raise ClusterStartError("the local cluster did not become ready in time")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process, wait up to ``grace_s``, SIGKILL the rest. Idempotent."""
        deadline = time.monotonic() + grace_s
        # The coordinator first: workers then skip the hand-over of their slots (a drain
        # needs the coordinator) and the whole cluster stops at once.
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.send_signal(signal.SIGTERM)
            try:
                self.coordinator.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.coordinator.kill()
        _terminate([p for p in [*self.workers, self.coordinator] if p is not None], deadline)
        # The links last: a worker still stopping may be sending to a peer through one.
        _terminate(self.proxies, time.monotonic() + grace_s)
        for f in self._logs:
            f.close()
        self._logs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalCluster:
        """Start the cluster (``start`` stops what started if that fails) and return it."""
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop the cluster."""
        self.stop()


def _free_port() -> int:
    """A port free on 127.0.0.1 now (the window until a daemon binds it is short)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _terminate(procs: list[subprocess.Popen[bytes]], deadline: float) -> None:
    """SIGTERM the processes still running, wait for all until ``deadline``, SIGKILL the rest."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
