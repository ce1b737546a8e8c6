"""Round-trip times to the workers, measured by the coordinator through their addresses.

Every ``interval_s`` the coordinator sends each ALIVE worker one gRPC health check (the
standard ``grpc.health.v1.Health/Check``, a few bytes each way:
``coordinator.placement.health_probe``) on the channel it trains and routes with, so the
time includes the worker's link as the coordinator sees it (a
``neuroshard link`` proxy in front of the worker included). The round trip feeds the worker's
EWMA in ``LinkStats``; the per-worker gauges are published from there on the same beat.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from coordinator.network.link_stats import LinkStats
from coordinator.placement.health_probe import probe_health
from coordinator.placement.membership import WorkerRecord
from shared.logging import get_logger
from shared.metrics import Metrics
from shared.rpc.peers import WorkerClients

log = get_logger(__name__)


class LinkProbe:
    """Measures RTTs to the ALIVE workers and publishes the link gauges."""

    def __init__(
        self,
        links: LinkStats,
        alive: Callable[[], list[WorkerRecord]],
        clients: WorkerClients,
        metrics: Metrics,
        interval_s: float,
        timeout_s: float,
    ) -> None:
        """Probe nothing until ``run``.

        Args:
            links: where round trips are recorded (the cluster's telemetry).
            alive: the ALIVE workers now.
            clients: channels to the workers.
            metrics: the ``neuroshard_worker_*`` gauges.
            interval_s: seconds between rounds (the heartbeat interval).
            timeout_s: deadline of one health check, seconds; a check that misses it
                records nothing (the failure detector judges liveness).
        """
        self._links, self._alive, self._clients = links, alive, clients
        self._metrics = metrics
        self._interval_s, self._timeout_s = interval_s, timeout_s
        self._pending: set[asyncio.Task[None]] = set()

    async def probe(self, w: WorkerRecord) -> float | None:
        """One round trip to ``w``, seconds; None when the check failed or timed out."""
        t0 = time.perf_counter()
        if await probe_health(self._clients, w.name, w.address, self._timeout_s) is not None:
            return None  # any failure: no sample; liveness is the failure detector's
        rtt_s = time.perf_counter() - t0
        self._links.get(w.name).observe_rtt(rtt_s)
        return rtt_s

    def soon(self, w: WorkerRecord) -> None:
        """Probe ``w`` in the background now (a worker that just registered), then publish.

        Needs a running event loop; without one (a synchronous caller) nothing happens and
        the next round measures it.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return

        async def probe_one() -> None:
            await self.probe(w)
            self.publish([w.name])

        task = loop.create_task(probe_one())
        self._pending.add(task)  # keep a reference until it is done
        task.add_done_callback(self._pending.discard)

    async def probe_all(self) -> None:
        """Probe every ALIVE worker concurrently, then publish the gauges."""
        workers = self._alive()
        await asyncio.gather(*(self.probe(w) for w in workers))
        self.publish([w.name for w in workers])

    def publish(self, names: list[str]) -> None:
        """Set the per-worker gauges of ``names`` (``publish_link_gauges``)."""
        publish_link_gauges(self._links, self._metrics, names)

    async def run(self) -> None:
        """Probe every ``interval_s`` until cancelled (then cancel the probes of ``soon``)."""
        try:
            while True:
                await self.probe_all()
                await asyncio.sleep(self._interval_s)
        finally:
            for task in list(self._pending):
                task.cancel()


def publish_link_gauges(links: LinkStats, metrics: Metrics, names: list[str]) -> None:
    """Set the ``neuroshard_worker_*`` gauges of ``names`` from the telemetry.

    Health is against the median step time of ``names``; unmeasured figures are left out.
    """
    for name in names:
        link = links.get(name)
        metrics.worker_health.labels(name).set(links.health(name, names))
        for gauge, value in (
            (metrics.worker_rtt_seconds, link.rtt_s),
            (metrics.worker_bandwidth, link.bandwidth_bps),
            (metrics.worker_step_seconds, link.step_s),
        ):
            if value is not None:
                gauge.labels(name).set(value)
