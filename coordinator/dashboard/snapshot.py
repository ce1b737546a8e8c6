"""The dashboard's JSON snapshot of the cluster, built from ``Cluster`` without any HTTP.

One snapshot has: ``workers`` (the fields of ``GetClusterStatus``), ``slots`` (every slot's
primary and replica as indices into ``slots.workers``, the epoch, the under-replicated slots),
``jobs`` (state, progress, per train job its epoch history, per memory job its recent
iteration latencies and strength histogram), ``store`` (count, mean, 10-bin histogram,
top-10, polled by ``StorePoller``) and ``events`` (the cluster's event log, newest first).

A snapshot is built for one viewer: jobs, their counts and the events about jobs are only
those the viewer may see (``may_see``, the rule GetJob and ListJobs apply: an admin sees
all, others their own jobs); workers, slots and the store are everyone's to read.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from coordinator.cluster import Cluster
from coordinator.jobs.jobs import JobRecord
from coordinator.memory.memory_ops import BulkOpError
from shared.logging import get_logger

log = get_logger(__name__)

LATENCY_POINTS = 120  # iteration latencies kept per memory job
JOBS_SHOWN = 20  # the most recent jobs in a snapshot
EVENTS_SHOWN = 50
TOP_K = 10


def _finite(x: Any) -> Any:
    """JSON has no NaN or infinity: None stands for them (the page shows a dash)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


class StorePoller:
    """The store's quality figures and top-10, refreshed at most every ``interval_s``.

    Polls (``MemoryOps.quality`` and ``topk``: one fan-out each over the primaries) only
    when the workers' heartbeats report memories, so an empty cluster costs nothing.
    """

    def __init__(
        self, cluster: Cluster, interval_s: float = 3.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """Poll ``cluster``'s store.

        Args:
            cluster: the coordinator's state.
            interval_s: seconds between two polls, at least.
            clock: monotonic seconds (injected by tests).
        """
        self._cluster = cluster
        self._interval_s = interval_s
        self._clock = clock
        self._last = -math.inf
        self._lock = asyncio.Lock()
        self.latest: dict[str, Any] = {"polled": False}

    async def refresh(self) -> dict[str, Any]:
        """Poll the store if ``interval_s`` has passed and it holds memories; return the latest.

        A failed fan-out (a primary just died) keeps the previous figures and says why.
        """
        async with self._lock:
            if self._clock() - self._last < self._interval_s:
                return self.latest
            self._last = self._clock()
            if sum(w.memories for w in self._cluster.membership.alive()) == 0:
                self.latest = {"polled": True, "count": 0, "mean": 0.0, "histogram": [0] * 10}
                self.latest["top"] = []
                return self.latest
            try:
                q = await self._cluster.memory.quality()
                ids, strengths = await self._cluster.memory.topk(TOP_K)
            except BulkOpError as exc:
                self.latest = self.latest | {"error": str(exc)}
                return self.latest
            self.latest = {
                "polled": True,
                "count": q.count,
                "mean": q.mean,
                "min": q.min,
                "max": q.max,
                "histogram": list(q.histogram),
                "top": [
                    {"id": str(int(i)), "strength": float(s)}
                    for i, s in zip(ids, strengths, strict=True)
                ],
            }
            return self.latest


class SnapshotBuilder:
    """Builds snapshots; keeps the recent iteration latencies of each memory job between them."""

    def __init__(self, cluster: Cluster) -> None:
        """Describe ``cluster``."""
        self._cluster = cluster
        self.events = cluster.events
        self._latency_ms: dict[str, deque[tuple[int, float]]] = {}

    def build(
        self,
        store: dict[str, Any] | None = None,
        may_see: Callable[[str], bool] | None = None,
    ) -> dict[str, Any]:
        """One JSON-ready snapshot of the cluster (see the module docstring).

        Args:
            store: ``StorePoller.latest``; None when not polled.
            may_see: tells whether the viewer may see a job of the owner given (a token's
                subject); None: every job (no auth).
        """
        c = self._cluster
        summary = c.slot_summary()
        jobs = [j for j in c.jobs.list() if may_see is None or may_see(j.owner)]
        by_state = {s: 0 for s in c.jobs.counts()}
        for j in jobs:
            by_state[j.state.value] += 1
        visible = {j.job_id for j in jobs}
        # Events about a job only for its viewers (a pruned job's: nobody but no-auth viewers)
        events = [
            e
            for e in c.events.recent(c.events.capacity)
            if may_see is None or "job_id" not in e or e["job_id"] in visible
        ][:EVENTS_SHOWN]
        doc: dict[str, Any] = _finite(
            {
                "time": time.time(),
                "workers": self.workers(summary),
                "slots": self.slot_grid(summary),
                "jobs": [self.job(j) for j in jobs[-JOBS_SHOWN:]][::-1],
                "jobs_by_state": by_state,
                "memories": sum(w.memories for w in c.membership.alive()),
                "store": store or {"polled": False},
                "events": events,
            }
        )
        return doc

    def workers(self, summary: dict[str, Any]) -> list[dict[str, Any]]:
        """Every known worker with the figures of ``GetClusterStatus``, by name."""
        c = self._cluster
        per_worker = summary["per_worker"]
        return [
            {
                "name": w.name,
                "address": w.address,
                "state": w.state.value,
                "device": w.device,
                "train_device": w.train_device,
                "heartbeat_age_s": c.membership.heartbeat_age_s(w),
                "readmit_holddown_s": c.membership.readmit_wait_s(w.name),
                "memories": w.memories,
                "slots_primary": per_worker.get(w.name, (0, 0))[0],
                "slots_replica": per_worker.get(w.name, (0, 0))[1],
                **c.link_figures(w.name),
            }
            for w in sorted(c.membership.all(), key=lambda w: w.name)
        ]

    def slot_grid(self, summary: dict[str, Any]) -> dict[str, Any]:
        """The current map: ``primary``/``replica`` [S] indices into ``workers`` (-1: none)."""
        current = self._cluster.rebalancer.current
        names = sorted({n for n in current.primary + current.replica if n})
        index = {n: i for i, n in enumerate(names)}
        alive = {w.name for w in self._cluster.membership.alive()}
        want = min(2, len(alive))
        under = [
            s
            for s, (p, r) in enumerate(zip(current.primary, current.replica, strict=True))
            if sum(1 for h in (p, r) if h and h in alive) < want
        ]
        return {
            "epoch": summary["epoch"],
            "count": summary["slots"],
            "replication_factor": summary["replication_factor"],
            "under_replicated": summary["under_replicated_slots"],
            "under_replicated_slots": under,
            "workers": names,
            "primary": [index.get(n, -1) for n in current.primary],
            "replica": [index.get(n, -1) for n in current.replica],
        }

    def job(self, job: JobRecord) -> dict[str, Any]:
        """A job's state and progress, with what its charts need."""
        p = job.progress
        doc: dict[str, Any] = {
            "job_id": job.job_id,
            "kind": job.kind,
            "name": getattr(job.spec, "name", "") or "",
            "state": job.state.value,
            "error": job.error,
            "workers": job.workers,
            "created_at": job.created_at,
            "started_at": job.started_at,
            "finished_at": job.finished_at,
            "fraction": _fraction(job),
        }
        if job.kind == "train":
            history = p.get("history", [])
            if not history and job.result is not None:
                history = job.result.get("history", [])
            doc |= {
                "epoch": p.get("epoch"),
                "epochs": p.get("epochs"),
                "loss": p.get("loss"),
                "test_accuracy": p.get("test_accuracy"),
                "samples_per_s": p.get("samples_per_s"),
                "history": [_history_entry(h) for h in history],
                # L_0 / L_e per epoch (``coordinator.training.epoch_figures``)
                "convergence": [
                    [h["epoch"], h["convergence"]]
                    for h in history
                    if isinstance(h.get("convergence"), float) and math.isfinite(h["convergence"])
                ],
                # a prioritized job's priority table's strengths, when its progress has them
                "histogram": p.get("histogram", []),
            }
        else:
            series = self._latency_ms.setdefault(job.job_id, deque(maxlen=LATENCY_POINTS))
            it, ms = p.get("iteration"), p.get("iteration_ms")
            if it is not None and ms is not None and (not series or series[-1][0] != it):
                series.append((int(it), float(ms)))
            doc |= {
                "iteration": it,
                "iterations": p.get("iterations"),
                "iteration_ms": ms,
                "latency_ms": [[i, m] for i, m in series],
                "histogram": p.get("histogram", []),
                "mean_strength": p.get("mean_strength"),
            }
        return doc


def _fraction(job: JobRecord) -> float:
    """How far the job is, in [0, 1]: steps (train) or iterations (memory) done."""
    if job.state.value == "SUCCEEDED":
        return 1.0
    p = job.progress
    done, total = (
        (p.get("step"), p.get("steps"))
        if job.kind == "train"
        else (
            p.get("iteration"),
            p.get("iterations"),
        )
    )
    if not done or not total:
        return 0.0
    return min(1.0, float(done) / float(total))


def _history_entry(h: dict[str, Any]) -> dict[str, Any]:
    """One epoch of a train job's history: the figures the curves plot."""
    return {
        "epoch": h.get("epoch"),
        "train_loss": h.get("train_loss", h.get("loss")),
        "test_loss": h.get("test_loss"),
        "test_accuracy": h.get("test_accuracy"),
        "samples_per_s": h.get("samples_per_s"),
        "convergence": h.get("convergence"),
    }
