"""Failure detection: heartbeat timeouts, failure reports, and probes.

A worker is declared DEAD when its heartbeats stop for ``heartbeat_timeout_s`` (a sweep runs
a few times per timeout), unless the coordinator itself was paused (a sweep woken more than
half a timeout late: a GC pause, CPU starvation, a suspended process): heartbeats it did not
process while paused are no evidence against a worker, so every live worker gets a fresh
timeout instead (Cassandra's gossiper does the same: it marks no node down after a local
pause, ``Gossiper.MAX_LOCAL_PAUSE_IN_MS``). Otherwise one pause longer than the timeout
declares every worker DEAD at once. A worker is also declared DEAD at once when it fails a
health probe within ``probe_timeout_s`` after a report: a primary's that it could not update
the worker's copies (``report_failure``), or a client's that it could not reach the worker
(``suspect``). A report alone never kills a worker: only the probe that follows it can.
Either way the coordinator re-plans (``on_dead``), so the dead worker's slots fail over.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from coordinator.placement.health_probe import probe_health
from coordinator.placement.membership import Membership, WorkerState
from coordinator.placement.rebalance import Rebalancer
from shared.logging import get_logger
from shared.metrics import Metrics
from shared.rpc.peers import WorkerClients

log = get_logger(__name__)


class NotSlotPrimary(Exception):
    """A failure report from a worker that is not the slots' primary (FAILED_PRECONDITION)."""


class TooManyReports(Exception):
    """A caller's failure reports passed ``report_rate_per_s`` (RESOURCE_EXHAUSTED)."""


class ReportLimiter:
    """Rate-limits failure reports per caller: a token bucket per subject.

    Each subject may report ``rate_per_s`` times a second on average, ``burst`` at once;
    the buckets of at most ``max_subjects`` callers are kept (the oldest are forgotten).
    """

    def __init__(self, rate_per_s: float, burst: int, max_subjects: int = 4096) -> None:
        """Allow ``rate_per_s`` reports a second per subject, ``burst`` at once."""
        self._rate, self._burst, self._max = rate_per_s, float(burst), max_subjects
        self._buckets: dict[str, tuple[float, float]] = {}  # subject -> (tokens, at)

    def allow(self, subject: str, now: float | None = None) -> bool:
        """Take one report from ``subject``'s bucket; False when it is empty."""
        now = time.monotonic() if now is None else now
        tokens, at = self._buckets.pop(subject, (self._burst, now))
        tokens = min(self._burst, tokens + (now - at) * self._rate)
        allowed = tokens >= 1.0
        self._buckets[subject] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._buckets) > self._max:
            del self._buckets[next(iter(self._buckets))]
        return allowed


class FailureDetector:
    """Declares workers DEAD from silence, or from a failed probe after a failure report."""

    def __init__(
        self,
        membership: Membership,
        rebalancer: Rebalancer,
        clients: WorkerClients,
        metrics: Metrics,
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
        probe_timeout_s: float,
        on_dead: Callable[[], None],
    ) -> None:
        """Watch ``membership``; nothing runs until ``run`` or a failure report.

        Args:
            membership: the registry whose workers are declared DEAD.
            rebalancer: owner of the slot map; reported copies stop being trusted there.
            clients: channels to the workers (for health probes).
            metrics: ``neuroshard_worker_suspicions_unconfirmed_total`` counts the clients'
                reports its probes did not confirm.
            heartbeat_interval_s: seconds between a worker's heartbeats.
            heartbeat_timeout_s: seconds of silence after which a worker is DEAD.
            probe_timeout_s: seconds a reported worker has to answer a health probe.
            on_dead: called after workers were declared DEAD (re-plan, reschedule).
        """
        self._membership = membership
        self._rebalancer = rebalancer
        self._clients = clients
        self._unconfirmed = metrics.suspicions_unconfirmed
        self._interval_s = min(heartbeat_interval_s, heartbeat_timeout_s / 4)
        self._timeout_s = heartbeat_timeout_s
        self._probe_timeout_s = probe_timeout_s
        self._on_dead = on_dead
        self._heartbeat_interval_s = heartbeat_interval_s
        self._probing: set[str] = set()
        self.probes_total = 0  # probes started (tests and logs)

    def report_failure(
        self, reporter: str, worker: str, reason: str, slots: list[int] | None = None
    ) -> None:
        """Stop trusting the copies a primary could not update, re-plan, and probe the worker.

        A primary stopped updating ``worker``'s copies of ``slots``: they get fresh copies.
        Called before the primary acknowledges writes; the worker's other copies stay in use
        (its heartbeats tell whether it is alive), and it is probed at once.

        Args:
            reporter: the primary reporting.
            worker: the replica it could not update.
            reason: why, for the log.
            slots: the slots concerned; None or empty for all.

        Raises:
            NotSlotPrimary: ``reporter`` is not the primary of some of ``slots`` in the
                current map (FAILED_PRECONDITION): the write it applied is orphaned, so its
                own copies of those slots stop being trusted and the write must not be
                acknowledged.
        """
        current = self._rebalancer.current
        chosen = list(range(current.slots)) if not slots else sorted(set(slots))
        log.warning(
            "copy_failed", reporter=reporter, worker=worker, slots=len(chosen), reason=reason
        )
        orphaned = [s for s in chosen if current.primary[s] != reporter]
        if slots and orphaned:
            self._rebalancer.distrust(reporter, orphaned)
            raise NotSlotPrimary(
                f"{reporter} is not the primary of slot {orphaned[0]} at epoch "
                f"{current.epoch}; its write there is not acknowledged"
            )
        # A new probe re-plans when it ends, for the lost copies and, if the worker is dead,
        # its other slots too (a pass started now would plan with it still alive); with a
        # probe already running (maybe past its re-plan), re-plan now.
        self._rebalancer.distrust(worker, chosen, replan=worker in self._probing)
        self._probe_soon(worker)

    def suspect(self, worker: str, reason: str) -> None:
        """Probe a worker a client could not reach; DEAD only when its silence confirms it.

        Nothing else changes: its copies stay trusted, and a worker that answers the probe
        stays ALIVE whatever the report said. One failed probe is not enough, since a
        client's word is not a daemon's and a worker whose event loop is busy for a moment
        fails a probe too: the worker is DEAD only if it has also missed a heartbeat (no
        heartbeat for 1.5 intervals), or fails a second probe once a heartbeat would have
        been missed (suspicion and confirmation as in SWIM, Das et al. 2002).
        Reports of a worker already being probed, or not ALIVE, or unknown, add nothing.

        Args:
            worker: the worker reported.
            reason: why the reporter thinks it is down, for the log.
        """
        rec = self._membership.get(worker)
        if rec is None or rec.state is not WorkerState.ALIVE or worker in self._probing:
            return
        log.info("worker_suspected", worker=worker, reason=reason)
        self._probe_soon(worker, confirm=True)

    def _probe_soon(self, worker: str, confirm: bool = False) -> None:
        """Start a probe of ``worker`` unless one is running (``confirm``: a client's report)."""
        if worker not in self._probing:
            self._probing.add(worker)
            self.probes_total += 1
            probe = self._confirmed_probe(worker) if confirm else self._probe(worker)
            task = asyncio.get_running_loop().create_task(probe)
            task.add_done_callback(lambda _t: self._probing.discard(worker))

    def _missed_heartbeat(self, name: str) -> bool:
        """Whether worker ``name`` has been silent for more than 1.5 heartbeat intervals."""
        rec = self._membership.get(name)
        return rec is not None and (
            self._membership.heartbeat_age_s(rec) > 1.5 * self._heartbeat_interval_s
        )

    async def _confirmed_probe(self, name: str) -> None:
        """Probe a worker a client reported; DEAD only when the coordinator confirms it.

        Confirmed by a missed heartbeat right after a failed probe, or by a second failed
        probe once a heartbeat would have been missed (1.5 intervals after the last one): a
        worker the coordinator itself cannot reach twice over that span is unavailable
        whatever its heartbeats say (a one-way partition), while one busy for a moment
        answers the second probe.
        """
        for attempt in range(2):
            rec = self._membership.get(name)
            if rec is None or rec.state is not WorkerState.ALIVE:
                return
            reason = await probe_health(self._clients, name, rec.address, self._probe_timeout_s)
            if reason is None:
                if attempt:
                    self._unconfirmed.inc()
                    log.info("worker_suspicion_unconfirmed", worker=name)
                return
            if attempt or self._missed_heartbeat(name):
                if self._membership.mark_dead(name):
                    log.warning(
                        "worker_dead",
                        worker=name,
                        address=rec.address,
                        reason=reason,
                        detected_by="probes after a client's report",
                    )
                    self._on_dead()
                return
            # probe again once a heartbeat would have been missed
            age = self._membership.heartbeat_age_s(rec)
            await asyncio.sleep(max(0.0, 1.5 * self._heartbeat_interval_s - age) + 0.05)

    async def _probe(self, name: str) -> None:
        """Ask a worker reported unreachable for its health at once, then re-plan.

        If it does not answer within ``probe_timeout_s`` it is declared DEAD now rather than
        after the heartbeat timeout, so its slots fail over in milliseconds instead of seconds.
        If it answers, the rebalancer re-plans for the copies a report distrusted.
        """
        rec = self._membership.get(name)
        if rec is None or rec.state is not WorkerState.ALIVE:
            self._rebalancer.trigger()
            return
        reason = await probe_health(self._clients, name, rec.address, self._probe_timeout_s)
        if reason is None:
            self._rebalancer.trigger()
            return
        if self._membership.mark_dead(name):
            log.warning(
                "worker_dead", worker=name, address=rec.address, reason=reason, detected_by="probe"
            )
            self._on_dead()
        else:
            self._rebalancer.trigger()

    async def run(self) -> None:
        """Sweep for silent workers a few times per heartbeat timeout; runs until cancelled.

        A sweep woken more than half a timeout late excuses the silence instead (module
        docstring).
        """
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(self._interval_s)
            now = loop.time()
            late_s, last = now - last - self._interval_s, now
            if late_s > self._timeout_s / 2:
                log.warning("coordinator_paused", seconds=round(late_s, 3))
                self._membership.excuse_silence()
                continue
            dead = self._membership.sweep()
            for rec in dead:
                log.warning(
                    "worker_dead", worker=rec.name, address=rec.address, timeout_s=self._timeout_s
                )
            if dead:
                self._on_dead()
