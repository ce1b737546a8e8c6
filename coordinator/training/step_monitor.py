"""What a ``sync`` or ``diloco`` job learns from its steps: telemetry, health, exclusion.

After every step the monitor feeds each answer's wall and compute seconds and bytes into the
cluster's ``LinkStats`` (also the late members' lower bounds and the rejected gradients),
keeps the window of healthy step times the next deadline is drawn from
(``straggler.step_deadline_s``), scores every member's health, runs the exclusion and
probation state machine (``straggler.Exclusion``), and publishes the gauges and counters.
"""

from __future__ import annotations

from typing import Any

from coordinator.network.link_probe import publish_link_gauges
from coordinator.network.link_stats import LinkStats
from coordinator.network.straggler import Exclusion, StepTimes, step_deadline_s
from coordinator.training.train_members import Members, StepOutcome
from shared.config import TrainJobSpec
from shared.logging import get_logger
from shared.metrics import Metrics

log = get_logger(__name__)
# The shortest step deadline, seconds: below it timer noise would launch needless backups.
DEADLINE_FLOOR_S = 0.02


class StepMonitor:
    """One job's view of its workers' links, and the counters its result reports."""

    def __init__(
        self,
        job_id: str,
        spec: TrainJobSpec,
        links: LinkStats,
        metrics: Metrics,
        step_timeout_s: float,
    ) -> None:
        """Start with no step observed.

        Args:
            job_id: the job, for logs.
            spec: its ``straggler``, ``health_threshold`` and ``probation_steps``.
            links: the cluster's per-worker telemetry (shared with ``status``).
            metrics: the piece and byte counters, the worker gauges.
            step_timeout_s: the coordinator's bound on a step's deadline, seconds.
        """
        self.job_id, self.spec, self.links = job_id, spec, links
        self._metrics, self._step_timeout_s = metrics, step_timeout_s
        self.exclusion = Exclusion(spec.health_threshold, spec.probation_steps)
        self.step_times = StepTimes()
        self.bytes = {"to_workers": 0, "from_workers": 0}
        self.rejected = self.backups = self.dropped_pieces = 0

    def deadline_s(self) -> float:
        """Seconds a step waits before backups (``backup``) or going on (``drop``)."""
        return step_deadline_s(
            self.step_times.values(),
            self.spec.straggler.deadline_factor,
            DEADLINE_FLOOR_S,
            self._step_timeout_s,
        )

    def observe(self, outcome: StepOutcome, step: int, members: Members) -> None:
        """Account one step's answers; update health, exclusion and ``members.excluded``."""
        healthy = [n for n in members.live if n not in members.excluded]
        for r in outcome.results.values():
            self.links.get(r.worker).observe_step(
                r.wall_s, r.compute_s, r.bytes_from_worker, r.bytes_to_worker, r.samples
            )
            if r.worker in healthy:
                self.step_times.add(r.wall_s)
            self._count_bytes(r.bytes_to_worker, r.bytes_from_worker)
        self._metrics.train_pieces.labels("accepted").inc(len(outcome.results))
        if outcome.backups:
            self._metrics.train_pieces.labels("backup").inc(outcome.backups)
        if outcome.dropped:
            self._metrics.train_pieces.labels("dropped").inc(len(outcome.dropped))
        for name, _piece, reason in outcome.rejected:
            self.reject(name, step, reason)
        for name, seconds in outcome.late.items():
            # A lower bound of its step time: enough for its health and share to fall.
            self.links.get(name).observe_step(seconds, 0.0, 0, 0, 0)
        self.backups += outcome.backups
        self.dropped_pieces += len(outcome.dropped)
        self._exclude(step, members, healthy)
        publish_link_gauges(self.links, self._metrics, healthy)

    def _count_bytes(self, to_worker: int, from_worker: int) -> None:
        self.bytes["to_workers"] += to_worker
        self.bytes["from_workers"] += from_worker
        self._metrics.train_transfer_bytes.labels("to_workers").inc(to_worker)
        self._metrics.train_transfer_bytes.labels("from_workers").inc(from_worker)

    def _exclude(self, step: int, members: Members, healthy: list[str]) -> None:
        """Score every live member and advance its exclusion state."""
        for name in sorted(members.live):
            score = self.links.health(name, healthy)
            others = len([n for n in members.live if n != name and not self.exclusion.excluded(n)])
            event = self.exclusion.update(
                name, score, step, others, self.links.get(name).describe()
            )
            if event is not None:
                log.warning(
                    f"train_worker_{event}",
                    job_id=self.job_id,
                    worker=name,
                    health=round(score, 3),
                    reason=self.exclusion.reason(name),
                )
        members.excluded = {n for n in members.live if self.exclusion.excluded(n)}
        for name in members.history:
            why = self.exclusion.reason(name) if name in members.excluded else None
            if why is not None:
                self.links.excluded[name] = why
            else:
                self.links.excluded.pop(name, None)

    def reject(self, worker: str, step: int, reason: str) -> None:
        """Count a rejected gradient against its worker (its health falls)."""
        self.links.get(worker).observe_rejected()
        self.rejected += 1
        self._metrics.train_pieces.labels("rejected").inc()
        log.warning(
            "train_gradient_rejected", job_id=self.job_id, worker=worker, step=step, reason=reason
        )

    def release(self, members: Members) -> None:
        """The job ended: its exclusions no longer show in ``status``."""
        for name in members.history:
            self.links.excluded.pop(name, None)

    def result_doc(self) -> dict[str, int]:
        """The job result's counters: rejected gradients, backups, drops, bytes each way."""
        return {
            "rejected_gradients": self.rejected,
            "backup_pieces": self.backups,
            "dropped_pieces": self.dropped_pieces,
            "bytes_to_workers": self.bytes["to_workers"],
            "bytes_from_workers": self.bytes["from_workers"],
        }

    def worker_docs(self, members: Members) -> dict[str, dict[str, Any]]:
        """Per worker: samples, steps and compute seconds of the job, link figures, health."""
        healthy = [n for n in members.live if n not in members.excluded]
        docs = members.summary()
        median = self.links.median_step_s(healthy)
        for name, doc in docs.items():
            link = self.links.get(name).to_doc(
                median, self.exclusion.excluded(name), self.exclusion.reason(name)
            )
            link["calls"] = link.pop("steps")  # training calls observed, all jobs
            doc.update({k: round(v, 3) if isinstance(v, float) else v for k, v in link.items()})
        return docs
