"""A local cluster of real processes: one coordinator and N workers on loopback.

Used by ``neuroshard up`` and ``neuroshard demo``, and by tests and benchmarks. Every process
is stopped (SIGTERM, then SIGKILL after a grace period) when the cluster stops.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from shared.client import NeuroshardError, SyncClient
from shared.security.dev import SecureSetup, prepare
from shared.security.transport import ChannelSecurity


class ClusterStartError(RuntimeError):
    """A daemon exited or the cluster did not become ready in time."""


class LocalCluster:
    """Start with ``start()`` (or ``with LocalCluster(3) as c:``); ``c.address`` is the
    coordinator's ``host:port``."""

    def __init__(
        self,
        workers: int,
        port: int = 0,
        data_dir: str | Path | None = None,
        log_dir: str | Path | None = None,
        coordinator_args: list[str] | None = None,
        worker_args: list[str] | None = None,
        secure: bool = False,
    ) -> None:
        """``secure``: mutual TLS and token auth with material generated under the data dir
        (``shared.security.dev``; each worker gets a worker token for its name);
        ``self.security`` is then the admin's client security."""
        self.n_workers = workers
        self.port = port
        self._tmp = tempfile.TemporaryDirectory(prefix="neuroshard-") if data_dir is None else None
        self.data_dir = Path(data_dir or self._tmp.name)  # type: ignore[union-attr]
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
        self._logs: list[IO[Any]] = []
        self.address = ""

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        out: IO[Any] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (closed in stop())
            self._logs.append(out)
        cmd = [sys.executable, "-m", "shared.cli", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(cmd, stdout=out, stderr=out, env=env, stdin=subprocess.DEVNULL)

    def start(self, timeout_s: float = 60.0) -> str:
        """Start every process and wait until all workers are ALIVE; return the address.

        Raises:
            ClusterStartError: a process exited early or the deadline passed.
        """
        deadline = time.monotonic() + timeout_s
        self.address = self._start_coordinator(self.port, deadline)
        for i in range(self.n_workers):
            self.add_worker(f"worker-{i}")
        self.wait_workers(self.n_workers, deadline)
        if self.secure is not None:
            self.secure.write_env(self.address)
        return self.address

    def _start_coordinator(self, port: int, deadline: float) -> str:
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
                *self._coordinator_args,
            ],
        )
        while not ready.exists() or not ready.read_text():
            self._check_alive(deadline)
            time.sleep(0.05)
        return ready.read_text().strip()

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator (no shutdown at all) and wait for it."""
        assert self.coordinator is not None
        self.coordinator.kill()
        self.coordinator.wait()

    def restart_coordinator(self, timeout_s: float = 60.0) -> None:
        """Start a new coordinator on the same port and data dir."""
        port = int(self.address.rpartition(":")[2])
        self.address = self._start_coordinator(port, time.monotonic() + timeout_s)

    def kill_all(self) -> None:
        """SIGKILL every process of the cluster (a power cut, as far as processes go)."""
        for p in [self.coordinator, *self.workers]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()

    def restart_all(self, timeout_s: float = 120.0) -> None:
        """Start the coordinator and workers again with the same port, names and data dirs."""
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

    def add_worker(self, name: str, extra: list[str] | None = None) -> subprocess.Popen[bytes]:
        """Start one more worker process named ``name`` (its data dir is under data_dir)."""
        proc = self._spawn(
            name,
            [
                "worker",
                "--coordinator",
                self.address,
                "--listen",
                "127.0.0.1:0",
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
        """Poll the coordinator until ``n`` workers are ALIVE."""
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
        for proc in [self.coordinator, *self.workers]:
            if proc is not None and proc.poll() is not None and proc.returncode != -9:
                raise ClusterStartError(
                    f"{' '.join(map(str, proc.args[3:5]))} exited with code "  # type: ignore[index]
                    f"{proc.returncode}"
                )
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
        procs = [p for p in [*self.workers, self.coordinator] if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in self._logs:
            f.close()
        self._logs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
