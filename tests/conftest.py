"""Shared fixtures: in-process coordinators and workers on port 0, stopped on teardown."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import settings

from coordinator.server import CoordinatorServer
from shared.client import Client
from shared.config import CoordinatorConfig, WorkerConfig
from worker.server import WorkerServer

# Hypothesis's default 200 ms deadline per example is a timing goal, and timing goals live in
# benchmarks: under CI's load a correct example can take longer (a compile, a busy core).
settings.register_profile("neuroshard", deadline=None)
settings.load_profile("neuroshard")


async def wait_until(
    predicate: Callable[[], object], timeout_s: float = 20.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` (sync or async) until truthy, failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


@dataclass
class InProcessCluster:
    """A coordinator and workers served by this test's event loop."""

    root: Path
    coordinator: CoordinatorServer
    address: str
    workers: list[WorkerServer] = field(default_factory=list)
    worker_overrides: dict[str, object] = field(default_factory=dict)
    # Overrides that depend on the worker's name (e.g. its own certificate).
    per_worker: Callable[[str], dict[str, object]] | None = None

    async def add_worker(self, name: str | None = None, **overrides: object) -> WorkerServer:
        name = name or f"worker-{len(self.workers)}"
        fields: dict[str, object] = dict(
            coordinator=self.address,
            listen="127.0.0.1:0",
            name=name,
            data_dir=str(self.root / name),
        )
        own = self.per_worker(name) if self.per_worker is not None else {}
        cfg = WorkerConfig(**(fields | self.worker_overrides | own | overrides))  # type: ignore[arg-type]
        w = WorkerServer(cfg)
        await w.start()
        self.workers.append(w)
        return w

    def alive(self) -> int:
        return len(self.coordinator.cluster.membership.alive())

    async def wait_alive(self, n: int) -> None:
        await wait_until(lambda: self.alive() == n, what=f"{n} alive workers")

    def client(self) -> Client:
        return Client(self.address, timeout_s=30.0)

    async def stop(self) -> None:
        for w in self.workers:
            await w.stop()
        await self.coordinator.stop()


@pytest.fixture
async def make_cluster(tmp_path: Path) -> AsyncIterator[Callable[..., object]]:
    """Factory: ``await make_cluster(workers=3, **coordinator_overrides)``."""
    clusters: list[InProcessCluster] = []

    async def make(
        workers: int = 3,
        worker_overrides: dict[str, object] | None = None,
        per_worker: Callable[[str], dict[str, object]] | None = None,
        **overrides: object,
    ) -> InProcessCluster:
        opts: dict[str, object] = dict(
            listen="127.0.0.1:0", data_dir=str(tmp_path / "coord"), metrics_port=None, grace_s=0.5
        )
        opts.update(overrides)
        server = CoordinatorServer(CoordinatorConfig(**opts))
        address = await server.start()
        c = InProcessCluster(
            tmp_path,
            server,
            address,
            worker_overrides=dict(grace_s=0.5, **(worker_overrides or {})),
            per_worker=per_worker,
        )
        clusters.append(c)
        for _ in range(workers):
            await c.add_worker()
        await c.wait_alive(workers)
        return c

    yield make
    for c in clusters:
        await c.stop()
