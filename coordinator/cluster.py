"""The coordinator's domain state in one place: membership, jobs, scheduler, worker clients.

Servicers call these methods; background tasks (failure detection, scheduling) run from
``run_background``. No gRPC server code here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.admission import admit
from coordinator.dataset_store import remove_stale_uploads
from coordinator.jobs import JobQuotaExceeded, JobRecord, JobStore
from coordinator.membership import Membership, WorkerRecord, WorkerState
from coordinator.memory_ops import MemoryOps
from coordinator.persistence import CRASHED_TWICE, StateStore
from coordinator.rebalance import Rebalancer
from coordinator.scheduler import Scheduler
from coordinator.train_job import TrainJob
from coordinator.train_sets import TrainSets
from shared import rpc
from shared.config import CoordinatorConfig, JobSpec
from shared.logging import get_logger
from shared.metrics import Metrics
from shared.rpc.peers import WorkerClients
from shared.security.transport import ChannelSecurity

log = get_logger("coordinator.cluster")


class NotSlotPrimary(Exception):
    """A failure report from a worker that is not the reported slots' primary
    (FAILED_PRECONDITION)."""


class Cluster:
    """Everything the coordinator knows and decides."""

    def __init__(
        self, cfg: CoordinatorConfig, metrics: Metrics, security: ChannelSecurity | None = None
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.membership = Membership(cfg.heartbeat_timeout_s)
        self.jobs = JobStore()
        self.train_sets = TrainSets()  # running train jobs' data, for their workers' FetchShard
        stale = remove_stale_uploads(cfg.dataset_roots()[0])
        if stale:
            log.info("stale_uploads_removed", files=len(stale))
        self.clients = WorkerClients(cfg.max_message_bytes, security)
        self.scheduler = Scheduler(
            self.jobs,
            self.membership,
            {"train": self._run_train, "memory": self._run_memory},
            cfg.queue_timeout_s,
        )
        self.rebalancer = Rebalancer(
            cfg.slots,
            self.membership,
            self.clients,
            metrics,
            cfg.rpc_timeout_s,
            cfg.max_payload_bytes,
        )
        self._probing: set[str] = set()
        self.state = StateStore(cfg.data_dir)
        self._restore()
        self.memory = MemoryOps(self.rebalancer, self.membership, self.clients, cfg.rpc_timeout_s)

    def _restore(self) -> None:
        """Load the slot map, workers and jobs saved by a previous coordinator process."""
        saved = self.state.load_slot_map(self.cfg.slots)
        if saved is not None:
            self.rebalancer.current = saved[0]
            self.rebalancer.trust.load_doc(saved[1])
            self.metrics.slot_map_epoch.set(saved[0].epoch)
        for w in self.state.load_workers():
            rec, _, _ = self.membership.register(w.name, w.address, w.device, w.process_id)
            rec.extra["epoch"] = self.rebalancer.current.epoch
            rec.extra["restored"] = True  # until its process registers or heartbeats here
        jobs = self.state.load_jobs()
        self.jobs.restore(jobs)
        for job_id in self.state.crashed_twice:
            log.warning("job_failed", job_id=job_id, error=CRASHED_TWICE)
        self.rebalancer.persist = self.state.save_slot_map
        self.jobs.on_change = self.state.save_job
        if saved is not None or jobs:
            log.info(
                "coordinator_restored",
                epoch=self.rebalancer.current.epoch,
                workers=len(self.membership.all()),
                jobs=len(jobs),
            )
        self.rebalancer.trigger()

    # -- membership ------------------------------------------------------------------------

    def register_worker(
        self, name: str, address: str, device: str, process_id: str = ""
    ) -> WorkerRecord:
        """Add or refresh a worker; a new process under a known name is checked before it
        gets a map."""
        new = self.membership.get(name) is None
        rec, changed, restarted = self.membership.register(name, address, device, process_id)
        log.info(
            "worker_registered", worker=name, address=address, device=device, restarted=restarted
        )
        rec.extra["epoch"] = 0
        rec.extra.pop("restored", None)
        self.state.save_worker(name, address, device, process_id)
        if restarted or new:  # whatever its data dir holds is checked before it gets a map
            self.rebalancer.worker_restarted(name)
        if changed:
            self._on_membership_change()
        return rec

    def heartbeat(self, name: str, memories: int, epoch: int = 0) -> bool:
        """Record a heartbeat; False tells the worker to register again."""
        rec = self.membership.heartbeat(name, memories, epoch)
        if rec is not None:
            rec.extra.pop("restored", None)  # the process that registered before is back
        return rec is not None

    def report_failure(
        self, reporter: str, worker: str, reason: str, slots: list[int] | None = None
    ) -> None:
        """A primary stopped updating ``worker``'s copies of ``slots`` (None: all): stop
        trusting them (they get fresh copies) and re-plan. Called before the primary
        acknowledges writes; the worker's other copies stay in use (its heartbeats tell
        whether it is alive).

        Raises:
            NotSlotPrimary: ``reporter`` is not the primary of some of ``slots`` in the
                current map (FAILED_PRECONDITION): the write it applied is orphaned, so its
                own copies of those slots stop being trusted and the write must not be
                acknowledged.
        """
        current = self.rebalancer.current
        chosen = list(range(current.slots)) if not slots else sorted(set(slots))
        log.warning(
            "copy_failed", reporter=reporter, worker=worker, slots=len(chosen), reason=reason
        )
        orphaned = [s for s in chosen if current.primary[s] != reporter]
        if slots and orphaned:
            self.rebalancer.distrust(reporter, orphaned)
            raise NotSlotPrimary(
                f"{reporter} is not the primary of slot {orphaned[0]} at epoch "
                f"{current.epoch}; its write there is not acknowledged"
            )
        self.rebalancer.distrust(worker, chosen)
        if worker not in self._probing:
            self._probing.add(worker)
            task = asyncio.get_running_loop().create_task(self._probe(worker))
            task.add_done_callback(lambda _t: self._probing.discard(worker))

    async def _probe(self, name: str) -> None:
        """Ask a worker reported unreachable for its health at once: if it does not answer
        within ``probe_timeout_s`` it is declared DEAD now rather than after the heartbeat
        timeout, so its slots fail over in milliseconds instead of seconds."""
        rec = self.membership.get(name)
        if rec is None or rec.state is not WorkerState.ALIVE:
            return
        stub = health_pb2_grpc.HealthStub(self.clients.channel(name, rec.address))
        try:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.cfg.probe_timeout_s)
            return
        except Exception as exc:
            reason = rpc.error_message(exc)
        if self.membership.mark_dead(name):
            log.warning(
                "worker_dead", worker=name, address=rec.address, reason=reason, detected_by="probe"
            )
            self._on_membership_change()

    def drain(self, name: str) -> bool:
        """Start (or check) the drain of a worker; return whether it holds no slot any more.

        Raises:
            KeyError: unknown worker (NOT_FOUND).
        """
        if self.membership.get(name) is None:
            raise KeyError(f"no worker named {name!r}")
        if not [w for w in self.membership.alive() if w.name != name]:
            return True  # nobody to hand over to: keep the data where it is
        if self.membership.set_draining(name):
            log.info("worker_draining", worker=name)
            self._on_membership_change()
        held = sum(self.rebalancer.current.counts().get(name, (0, 0)))
        return held == 0 and self.rebalancer.settled.is_set()

    def _on_membership_change(self) -> None:
        self._update_gauges()
        self.rebalancer.trigger()
        self.scheduler.wake()

    async def _detect_failures(self) -> None:
        interval = min(self.cfg.heartbeat_interval_s, self.cfg.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            dead = self.membership.sweep()
            for rec in dead:
                log.warning(
                    "worker_dead",
                    worker=rec.name,
                    address=rec.address,
                    timeout_s=self.cfg.heartbeat_timeout_s,
                )
            if dead:
                self._on_membership_change()

    # -- jobs -----------------------------------------------------------------------------

    async def submit(self, spec_json: str, owner: str = "") -> JobRecord:
        """Admit and queue a job spec for ``owner`` (a token subject; "" without auth).

        Admission (``coordinator.admission.admit``) runs in a thread: it may read file
        headers and build the model on the meta device to count its parameters.

        Raises:
            ConfigError: invalid spec, naming the field (INVALID_ARGUMENT).
            PathRefused: a path outside the data roots (INVALID_ARGUMENT).
            ImportNotAllowed: an import not in ``allowed_imports`` (PERMISSION_DENIED).
            LimitExceeded: over an admission cap (RESOURCE_EXHAUSTED).
            JobQuotaExceeded: ``owner`` has ``max_jobs_per_client`` unfinished jobs
                (RESOURCE_EXHAUSTED).
        """
        spec: JobSpec = await asyncio.to_thread(admit, spec_json, self.cfg)
        limit = self.cfg.max_jobs_per_client
        if self.jobs.active(owner) >= limit:
            who = f"client {owner!r}" if owner else "unauthenticated clients"
            raise JobQuotaExceeded(
                f"{who} already has {limit} queued or running jobs (max_jobs_per_client); "
                "wait for one to finish or cancel one"
            )
        job = self.jobs.submit(spec, owner)
        log.info(
            "job_submitted",
            job_id=job.job_id,
            kind=job.kind,
            workers=spec.workers,
            owner=owner or None,
        )
        self.scheduler.wake()
        self._update_gauges()
        return job

    async def _run_memory(self, job: JobRecord, workers: list[WorkerRecord]) -> dict[str, Any]:
        from coordinator.memory_job import MemoryJob

        return await MemoryJob(job, self, workers).run()

    async def _run_train(self, job: JobRecord, workers: list[WorkerRecord]) -> dict[str, Any]:
        return await TrainJob(
            job,
            workers,
            self.cfg,
            self.clients,
            self.jobs,
            self.metrics,
            alive=self.membership.alive,
            train_sets=self.train_sets,
        ).run()

    # -- status ---------------------------------------------------------------------------

    def slot_summary(self) -> dict[str, Any]:
        """Cluster-wide slot figures and per-worker (primary, replica) slot counts."""
        current = self.rebalancer.current
        alive = {w.name for w in self.membership.alive()}
        return {
            "slots": current.slots,
            "epoch": current.epoch,
            "replication_factor": min(2, len(alive)),
            "under_replicated_slots": current.under_replicated(alive, 2),
            "per_worker": current.counts(),
        }

    def _update_gauges(self) -> None:
        for state, n in self.membership.counts().items():
            self.metrics.workers.labels(state).set(n)
        for state, n in self.jobs.counts().items():
            self.metrics.jobs.labels(state).set(n)

    async def run_background(self) -> None:
        """Failure detection, scheduling and gauges; runs until cancelled."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._detect_failures(), name="failure-detector")
            tg.create_task(self.scheduler.run(), name="scheduler")
            tg.create_task(self.rebalancer.run(), name="rebalancer")
            tg.create_task(self._refresh_gauges(), name="gauges")

    async def _refresh_gauges(self) -> None:
        while True:
            self.prune_jobs()
            self._update_gauges()
            await asyncio.sleep(1.0)

    def prune_jobs(self, now: float | None = None) -> list[str]:
        """Apply ``job_retention``: forget old finished jobs in memory, in SQLite and their
        checkpoint files; return the ids pruned."""
        keep = self.cfg.job_retention
        dropped = self.jobs.prune(keep.max_jobs, keep.max_age_s, now)
        if dropped:
            self.state.delete_jobs(dropped)
            for job_id in dropped:
                (Path(self.cfg.data_dir) / "checkpoints" / f"{job_id}.ckpt").unlink(missing_ok=True)
            log.info("jobs_pruned", jobs=len(dropped))
        return dropped

    async def close(self) -> None:
        """Close worker channels and the state database."""
        await self.clients.close()
        self.state.close()
