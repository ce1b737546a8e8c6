"""The daemons ``bench_learner`` measures: real processes, or in-process servers for ``--quick``.

Both give the coordinator's address, what each daemon counted of the bytes it sent and
received over gRPC (``WireTotals``: the serialized messages of the RPCs it served,
``neuroshard_rpc_sent_bytes_total`` / ``_received_bytes_total``, and of its own calls,
``neuroshard_rpc_client_sent_bytes_total`` / ``_received_bytes_total``), CPU seconds and peak
RSS per process, and a way to kill one worker as ``kill -9`` would.

- ``ProcessDaemons``: a ``LocalCluster`` (one process per daemon, each with its own
  Prometheus port); CPU from ``/proc/PID/stat`` (utime + stime), peak RSS from
  ``/proc/PID/status`` (VmHWM), the kill is SIGKILL.
- ``InProcessDaemons``: a coordinator and workers served by this process's event loop (the
  tests' ``InProcessCluster``); the byte counters are read from their registries, per-process
  figures are this one process's, and the kill stops serving and heartbeating at once.
"""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from coordinator.server import CoordinatorServer
from shared.cli.local_cluster import LocalCluster
from shared.config import CoordinatorConfig
from tests.conftest import InProcessCluster

FAMILIES = {  # WireTotals field: counter family
    "served_sent": "neuroshard_rpc_sent_bytes",
    "served_received": "neuroshard_rpc_received_bytes",
    "client_sent": "neuroshard_rpc_client_sent_bytes",
    "client_received": "neuroshard_rpc_client_received_bytes",
}
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcStat:
    """One process's CPU seconds (user + system) and peak resident set (VmHWM), bytes."""

    cpu_s: float
    peak_rss_bytes: int


def proc_stat(pid: int) -> ProcStat:
    """Read ``/proc/PID/stat`` (utime, stime in clock ticks) and ``/proc/PID/status`` (VmHWM).

    Raises:
        OSError: the process is gone.
    """
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    hwm_kib = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("VmHWM:")
    )
    return ProcStat((utime + stime) / CLK_TCK, hwm_kib * 1024)


@dataclass(frozen=True)
class WireTotals:
    """Bytes daemons counted, summed over methods: of RPCs served, and of their own calls.

    Every RPC is served by exactly one daemon, so ``served_sent + served_received`` over all
    daemons is every message on the wire; ``sent`` is what the daemons themselves sent.
    """

    served_sent: float = 0.0
    served_received: float = 0.0
    client_sent: float = 0.0
    client_received: float = 0.0

    @property
    def sent(self) -> float:
        """Bytes the daemons sent: responses to the calls they served, requests of their own."""
        return self.served_sent + self.client_sent

    @property
    def on_the_wire(self) -> float:
        """Every message of every RPC a daemon served (requests and responses)."""
        return self.served_sent + self.served_received

    def __add__(self, o: WireTotals) -> WireTotals:
        return WireTotals(*(a + b for a, b in zip(_fields(self), _fields(o), strict=True)))

    def __sub__(self, o: WireTotals) -> WireTotals:
        return WireTotals(*(a - b for a, b in zip(_fields(self), _fields(o), strict=True)))


def _fields(t: WireTotals) -> tuple[float, ...]:
    return (t.served_sent, t.served_received, t.client_sent, t.client_received)


def byte_totals(families: Iterable[Metric]) -> WireTotals:
    """The four byte counters of one daemon, summed over every method's series."""
    names = {family: field for field, family in FAMILIES.items()}
    totals = dict.fromkeys(FAMILIES, 0.0)
    for f in families:
        if f.name in names:
            totals[names[f.name]] += sum(s.value for s in f.samples if s.name.endswith("_total"))
    return WireTotals(**totals)


def _registry_families(registry: CollectorRegistry) -> list[Metric]:
    return list(text_string_to_metric_families(generate_latest(registry).decode()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ProcessDaemons:
    """A coordinator and ``workers`` worker processes (``LocalCluster``) under a temp dir."""

    def __init__(self, workers: int, coordinator_yaml: str) -> None:
        """Describe the cluster; ``start`` starts it."""
        self._tmp = tempfile.TemporaryDirectory(prefix="neuroshard-learner-")
        root = Path(self._tmp.name)
        (root / "coordinator.yaml").write_text(coordinator_yaml)
        self._ports = {"coordinator": _free_port()}
        self.cluster = LocalCluster(
            0,
            data_dir=root / "cluster",
            log_dir=root / "logs",
            coordinator_args=[
                "--config",
                str(root / "coordinator.yaml"),
                "--metrics-port",
                str(self._ports["coordinator"]),
            ],
        )
        self.n_workers = workers
        self.address = ""
        self.kind = "processes"

    async def start(self, timeout_s: float = 300.0) -> None:
        """Start every daemon and wait until all workers are ALIVE."""

        def start() -> None:
            self.address = self.cluster.start(timeout_s)
            for i in range(self.n_workers):
                name = f"worker-{i}"
                self._ports[name] = _free_port()
                self.cluster.add_worker(name, extra=["--metrics-port", str(self._ports[name])])
            self.cluster.wait_workers(self.n_workers, time.monotonic() + timeout_s)

        await asyncio.to_thread(start)

    def pids(self) -> dict[str, int]:
        """Live daemons' pids by name (a killed worker is left out)."""
        assert self.cluster.coordinator is not None
        out = {"coordinator": self.cluster.coordinator.pid}
        for i, p in enumerate(self.cluster.workers):
            if p.poll() is None:
                out[f"worker-{i}"] = p.pid
        return out

    def proc_stats(self) -> dict[str, ProcStat]:
        """CPU seconds and peak RSS of every live daemon, by name."""
        return {name: proc_stat(pid) for name, pid in self.pids().items()}

    async def rpc_bytes(self) -> WireTotals:
        """The byte counters summed over every live daemon (scraped over HTTP)."""

        def scrape() -> WireTotals:
            total = WireTotals()
            for name in self.pids():
                url = f"http://127.0.0.1:{self._ports[name]}/metrics"
                with urllib.request.urlopen(url, timeout=10) as r:
                    total += byte_totals(text_string_to_metric_families(r.read().decode()))
            return total

        return await asyncio.to_thread(scrape)

    async def kill_worker(self, index: int) -> str:
        """SIGKILL worker ``index``; return its name."""
        await asyncio.to_thread(self.cluster.kill_worker, index)
        return f"worker-{index}"

    async def stop(self) -> None:
        """Stop every process and remove the temp dir."""
        await asyncio.to_thread(self.cluster.stop)
        self._tmp.cleanup()


class InProcessDaemons:
    """A coordinator and ``workers`` workers in this process (``--quick``, ``--inprocess``)."""

    def __init__(self, workers: int, coordinator: dict[str, object]) -> None:
        """Describe the cluster; ``start`` starts it."""
        self._tmp = tempfile.TemporaryDirectory(prefix="neuroshard-learner-")
        self._opts = coordinator
        self.n_workers = workers
        self.address = ""
        self.kind = "in-process"
        self.cluster: InProcessCluster | None = None
        self._killed: set[int] = set()
        self._coordinator: CoordinatorServer | None = None

    async def start(self, timeout_s: float = 120.0) -> None:
        """Start the coordinator and the workers; wait until all are ALIVE."""
        root = Path(self._tmp.name)
        opts: dict[str, object] = dict(
            listen="127.0.0.1:0",
            data_dir=str(root / "coord"),
            metrics_port=None,
            grace_s=0.5,
        )
        server = CoordinatorServer(CoordinatorConfig(**(opts | self._opts)))
        self.address = await server.start()
        self._coordinator = server
        self.cluster = InProcessCluster(
            root,
            server,
            self.address,
            worker_overrides={"grace_s": 0.5},
        )
        for _ in range(self.n_workers):
            await self.cluster.add_worker()
        await asyncio.wait_for(self.cluster.wait_alive(self.n_workers), timeout_s)

    def pids(self) -> dict[str, int]:
        """This process, which serves every daemon."""
        return {"this process (every daemon)": os.getpid()}

    def proc_stats(self) -> dict[str, ProcStat]:
        """This process's CPU seconds and peak RSS."""
        return {name: proc_stat(pid) for name, pid in self.pids().items()}

    async def rpc_bytes(self) -> WireTotals:
        """The byte counters summed over every live daemon's registry."""
        assert self.cluster is not None
        registries = [self.cluster.coordinator.metrics.registry] + [
            w.metrics.registry for i, w in enumerate(self.cluster.workers) if i not in self._killed
        ]
        total = WireTotals()
        for r in registries:
            total += byte_totals(_registry_families(r))
        return total

    async def kill_worker(self, index: int) -> str:
        """Stop worker ``index`` serving and heartbeating at once (no drain, no goodbye)."""
        assert self.cluster is not None
        w = self.cluster.workers[index]
        if w._tasks is not None:
            w._tasks.cancel()
        await w.rpc.server.stop(0)
        self._killed.add(index)
        return w.name

    async def stop(self) -> None:
        """Stop every daemon and remove the temp dir."""
        if self.cluster is not None:
            await self.cluster.stop()
        elif self._coordinator is not None:
            await self._coordinator.stop()
        self._tmp.cleanup()


Daemons = ProcessDaemons | InProcessDaemons
