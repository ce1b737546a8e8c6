"""The coordinator's domain state in one place: membership, jobs, scheduler, worker clients.

Servicers call these methods; background tasks (failure detection, scheduling) run from
``run_background``. No gRPC server code here.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coordinator.datasets.dataset_store import UploadGate, remove_stale_uploads
from coordinator.events import EventLog
from coordinator.forget import WorkerUnknown
from coordinator.jobs.admission import admit
from coordinator.jobs.jobs import JobNotFound, JobQuotaExceeded, JobRecord, JobStore
from coordinator.jobs.pacing import check_paced, grant
from coordinator.jobs.scheduler import Scheduler
from coordinator.memory.capped_inserts import CappedInserts
from coordinator.memory.memory_job import MemoryJob
from coordinator.memory.memory_ops import MemoryOps
from coordinator.memory.sampling import Sampler
from coordinator.memory.tables import Tables
from coordinator.network.link_probe import LinkProbe
from coordinator.network.link_stats import LinkStats
from coordinator.persistence import CRASHED_TWICE, StateStore
from coordinator.placement.failure_detector import FailureDetector, ReportLimiter
from coordinator.placement.membership import Membership, WorkerRecord
from coordinator.placement.readmission import Readmission
from coordinator.placement.rebalance import Rebalancer
from coordinator.placement.slot_map import WireLimits
from coordinator.training.allreduce_job import AllreduceJob
from coordinator.training.diloco import DilocoSteps
from coordinator.training.prioritized import PriorityStore, left_tables
from coordinator.training.saved_models import check_init, model_file
from coordinator.training.sync import SyncSteps
from coordinator.training.train_job import StepScheme, TrainJob
from coordinator.training.train_sets import TrainSets
from shared.client.memory import MemoryRouter
from shared.config import ConfigError, CoordinatorConfig, InitSpec, JobSpec, TrainJobSpec
from shared.logging import get_logger
from shared.metrics import Metrics
from shared.proto import common_pb2
from shared.rpc.peers import WorkerClients
from shared.security.auth import may_see_job
from shared.security.transport import ChannelSecurity

# The strategies that run the parameter-server loop, and their steps (``StepScheme``).
PARAMETER_SERVER_STEPS: dict[str, Callable[[TrainJobSpec, int], StepScheme]] = {
    "sync": SyncSteps,
    "diloco": DilocoSteps,
}

log = get_logger(__name__)


class Cluster:
    """Everything the coordinator knows and decides."""

    def __init__(
        self, cfg: CoordinatorConfig, metrics: Metrics, security: ChannelSecurity | None = None
    ) -> None:
        """Build the domain objects and restore what a previous process saved.

        Args:
            cfg: the coordinator's config.
            metrics: where gauges and counters are set.
            security: TLS and token for channels to the workers; None for plaintext.
        """
        self.cfg = cfg
        self.metrics = metrics
        self.membership = Membership(
            cfg.heartbeat_timeout_s,
            holddown_base_s=2 * cfg.heartbeat_interval_s,
            holddown_max_s=cfg.readmit_holddown_max_s,
        )
        self.events = EventLog()  # what happened, for people (the dashboard's event log)
        self._seen_states: dict[str, str] = {}  # worker -> state last told in ``events``
        self.jobs = JobStore()
        self.jobs.on_state = self._job_event
        self.train_sets = TrainSets()  # running train jobs' data, for their workers' FetchShard
        stale = remove_stale_uploads(cfg.dataset_roots()[0])
        if stale:
            log.info("stale_uploads_removed", files=len(stale))
        # `data put`: uploads in progress and the first data root's bytes, bounded
        self.uploads = UploadGate(
            cfg.dataset_roots()[0], cfg.max_concurrent_uploads, cfg.max_data_root_bytes
        )
        self.clients = WorkerClients(cfg.max_message_bytes, security)
        # A DEAD worker registers again only once reachable, after its hold-down; the check
        # may take a heartbeat timeout, the time a worker has to show it is alive.
        self.readmission = Readmission(
            self.membership, self.clients, metrics, cfg.heartbeat_timeout_s
        )
        self.links = LinkStats()  # per-worker RTT, step times, health (train jobs, probes)
        self.link_probe = LinkProbe(
            self.links,
            self.membership.alive,
            self.clients,
            metrics,
            cfg.heartbeat_interval_s,
            cfg.probe_timeout_s,
        )
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
            WireLimits(
                cfg.max_payload_bytes, cfg.max_batch_items, cfg.topk_max, cfg.max_sample_batch
            ),
            copy_chunk_memories=cfg.copy_chunk_memories,
            copy_pause_factor=cfg.copy_pause_factor,
        )
        self.failures = FailureDetector(
            self.membership,
            self.rebalancer,
            self.clients,
            metrics,
            cfg.heartbeat_interval_s,
            cfg.heartbeat_timeout_s,
            cfg.probe_timeout_s,
            on_dead=self._on_membership_change,
        )
        # Clients' failure reports: 10 at once, then report_rate_per_s a second per caller.
        self.reports = ReportLimiter(cfg.report_rate_per_s, burst=10)
        self.rebalancer.events = self.events
        self.state = StateStore(cfg.data_dir)
        self.tables = Tables(self.rebalancer, cfg.max_payload_bytes)
        self._restore()
        self.memory = MemoryOps(
            self.rebalancer,
            self.membership,
            self.clients,
            cfg.rpc_timeout_s,
            # long enough for a dead primary to be declared and its replicas promoted
            retry_budget_s=3 * cfg.heartbeat_timeout_s + 5.0,
        )
        self.sampler = Sampler(
            self.rebalancer,
            self.membership,
            self.clients,
            cfg.rpc_timeout_s,
            retry_budget_s=3 * cfg.heartbeat_timeout_s + 5.0,
        )
        self._insert_router = MemoryRouter(
            self._wire_map, cfg.rpc_timeout_s, cfg.max_message_bytes, security=security
        )
        self.inserts = CappedInserts(self.tables, self.memory, self._insert_router)

    def _restore(self) -> None:
        """Load the slot map, workers and jobs saved by a previous coordinator process."""
        saved = self.state.load_slot_map(self.cfg.slots)
        if saved is not None:
            self.rebalancer.current = saved[0]
            self.rebalancer.trust.load_doc(saved[1])
            self.metrics.slot_map_epoch.set(saved[0].epoch)
        for w in self.state.load_workers():
            rec, _, _ = self.membership.register(
                w.name, w.address, w.device, w.process_id, w.train_device
            )
            rec.slot_map_epoch = self.rebalancer.current.epoch
            rec.restored = True  # until its process registers or heartbeats here
        jobs = self.state.load_jobs()
        self.jobs.restore(jobs)
        for job_id in self.state.crashed_twice:
            log.warning("job_failed", job_id=job_id, error=CRASHED_TWICE)
        self.rebalancer.persist = self.state.save_slot_map
        tables = self.state.load_tables()
        if tables is not None:
            self.tables.load_doc(tables)
        self.tables.persist = self.state.save_tables
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
        self, name: str, address: str, device: str, process_id: str = "", train_device: str = "cpu"
    ) -> WorkerRecord:
        """Add or refresh a worker.

        A new process under a known name (or a new name) gets no slot map until whatever its
        data dir holds is checked against the other holders.

        Args:
            name: the worker's unique name.
            address: ``host:port`` of its gRPC server.
            device: its memory kernels' device, ``cpu`` or ``cuda[:N]``.
            process_id: the worker process's random id; a new one means a restart.
            train_device: its training device, ``cpu`` or ``cuda[:N]``.
        """
        new = self.membership.get(name) is None
        rec, changed, restarted = self.membership.register(
            name, address, device, process_id, train_device
        )
        log.info(
            "worker_registered",
            worker=name,
            address=address,
            device=device,
            train_device=train_device,
            restarted=restarted,
        )
        self.state.save_worker(name, address, device, process_id, train_device)
        if restarted or new:  # whatever its data dir holds is checked before it gets a map
            self.rebalancer.worker_restarted(name)
        if restarted:
            self.events.add("worker_restarted", f"{name} restarted", worker=name)
        if changed:
            self._on_membership_change()
        self.link_probe.soon(rec)  # its RTT from the start, not from the next round
        return rec

    def heartbeat(
        self, name: str, memories: int, epoch: int = 0, held: dict[int, int] | None = None
    ) -> bool:
        """Record a heartbeat; False tells the worker to register again.

        Args:
            name: the worker's name.
            memories: memories it holds as primary.
            epoch: the slot-map epoch it has applied.
            held: slot -> memories it holds there (either role); None leaves the last known.
        """
        rec = self.membership.heartbeat(name, memories, epoch)
        if rec is not None and held is not None:
            rec.slot_memories = held
        return rec is not None

    def report_failure(
        self, reporter: str, worker: str, reason: str, slots: list[int] | None = None
    ) -> None:
        """Stop trusting the copies a primary could not update, re-plan, and probe the worker.

        See ``FailureDetector.report_failure``.

        Raises:
            NotSlotPrimary: ``reporter`` is not the primary of some of ``slots``
                (FAILED_PRECONDITION).
        """
        self.failures.report_failure(reporter, worker, reason, slots)

    def drain(self, name: str) -> bool:
        """Start (or check) the drain of a worker; return whether it holds no slot any more.

        Raises:
            WorkerUnknown: unknown worker (NOT_FOUND).
        """
        if self.membership.get(name) is None:
            raise WorkerUnknown(f"no worker named {name!r}")
        if not [w for w in self.membership.alive() if w.name != name]:
            return True  # nobody to hand over to: keep the data where it is
        if self.membership.set_draining(name):
            log.info("worker_draining", worker=name)
            self._on_membership_change()
        held = sum(self.rebalancer.current.counts().get(name, (0, 0)))
        return held == 0 and self.rebalancer.settled.is_set()

    def _on_membership_change(self) -> None:
        self._note_membership()
        self._update_gauges()
        self.rebalancer.trigger()
        self.scheduler.wake()

    # -- jobs -----------------------------------------------------------------------------

    async def submit(self, spec_json: str, owner: str = "") -> JobRecord:
        """Admit and queue a job spec for ``owner`` (a token subject; "" without auth).

        Admission (``coordinator.jobs.admission.admit``) runs in a thread: it may read file
        headers and build the model on the meta device to count its parameters.

        A train spec's ``init`` must name a job the caller may see with a saved model, or an
        uploaded state dict, that fits the spec's model
        (``coordinator.training.saved_models.check_init``).

        Raises:
            ConfigError: invalid spec, naming the field, or an ``init`` that is unknown or
                does not fit (names the first misfit tensor) (INVALID_ARGUMENT).
            PathRefused: a path (or ``init.dataset``) outside the data roots
                (INVALID_ARGUMENT).
            EntryPointRefused: a model entry not in ``allowed_models`` (PERMISSION_DENIED).
            LimitExceeded: over an admission cap (RESOURCE_EXHAUSTED).
            JobQuotaExceeded: ``owner`` has ``max_jobs_per_client`` unfinished jobs
                (RESOURCE_EXHAUSTED).
        """
        spec: JobSpec = await asyncio.to_thread(admit, spec_json, self.cfg)
        if isinstance(spec, TrainJobSpec) and spec.init is not None:
            if spec.init.job is not None:
                self._check_init_job(spec.init)
            await asyncio.to_thread(check_init, spec, self.cfg)
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
        self.events.add("job_submitted", f"{job.job_id} submitted", job_id=job.job_id)
        self.scheduler.wake()
        self._update_gauges()
        return job

    async def run_epochs(self, job: JobRecord, epochs: int) -> int:
        """Grant a paced job ``epochs`` more epochs (``coordinator.jobs.pacing``), saved.

        Returns:
            The epochs granted in all.

        Raises:
            BadGrant: ``epochs`` < 1 (INVALID_ARGUMENT).
            PacingRefused: not a paced job, ended, finishing, or past its spec's ``epochs``
                (FAILED_PRECONDITION).
        """
        granted = grant(job, epochs)
        self.state.save_pacing(job.job_id, granted, job.finish_requested)
        await self.jobs.update(job)  # wakes the job waiting at its epoch boundary
        return granted

    async def finish(self, job: JobRecord) -> None:
        """Ask a paced job to end SUCCEEDED at its next epoch boundary; saved.

        The running epoch and the epochs granted are run first; an ended job is left as it is.

        Raises:
            PacingRefused: not a paced job (FAILED_PRECONDITION).
        """
        if job.state.terminal:
            return
        check_paced(job)
        job.finish_requested = True
        self.state.save_pacing(job.job_id, job.epochs_granted, True)
        await self.jobs.update(job)

    def _check_init_job(self, init: InitSpec) -> None:
        """Refuse an ``init.job`` the caller may not see (``may_see_job``) or without that model.

        Raises:
            ConfigError: an unknown job, another subject's, or one without that saved model
                (the same answer for the first two: no existence oracle) (INVALID_ARGUMENT).
        """
        assert init.job is not None
        try:
            job = self.jobs.get(init.job)
        except JobNotFound:
            job = None
        if job is None or not may_see_job(job.owner):
            raise ConfigError(f"init.job: no job {init.job!r}")
        if (
            job.kind != "train"
            or not model_file(self.cfg.data_dir, job.job_id, init.best).is_file()
        ):
            which = "best" if init.best else "final"
            raise ConfigError(f"init.job: job {init.job!r} has no saved {which} model")

    def _job_event(self, job: JobRecord) -> None:
        """Tell ``events`` a job's new state (``JobStore.on_state``)."""
        state = job.state.value.lower()
        why = f": {job.error}" if job.error and job.state.terminal else ""
        self.events.add(f"job_{state}", f"{job.job_id} {state}{why}", job_id=job.job_id)

    def _note_membership(self) -> None:
        """Tell ``events`` every worker whose state changed since the last call."""
        words = {"ALIVE": "joined", "DEAD": "died", "DRAINING": "is draining"}
        for w in self.membership.all():
            state = w.state.value
            if self._seen_states.get(w.name) != state:
                self._seen_states[w.name] = state
                kind = f"worker_{'alive' if state == 'ALIVE' else state.lower()}"
                self.events.add(kind, f"{w.name} {words[state]}", worker=w.name)

    async def _run_memory(self, job: JobRecord, workers: list[WorkerRecord]) -> dict[str, Any]:
        # The job uses every primary through the slot map, not just the workers it was given.
        return await MemoryJob(
            job,
            self.cfg,
            self.jobs,
            self.rebalancer,
            self.memory,
            self.clients.security,
            state=self.state,  # progress saved there: a restart resumes the job
            metrics=self.metrics,
        ).run()

    async def _run_train(self, job: JobRecord, workers: list[WorkerRecord]) -> dict[str, Any]:
        """Run a train job by its ``strategy``: the coordinator's one dispatch on it."""
        assert isinstance(job.spec, TrainJobSpec)
        args = (job, workers, self.cfg, self.clients, self.jobs, self.metrics)
        if job.spec.strategy == "allreduce":  # DDP in the workers' processes
            return await AllreduceJob(
                *args,
                alive=self.membership.alive,
                train_sets=self.train_sets,
                store=self._priority_store(),
            ).run()
        # sync and diloco: the parameter-server loop (which measures the links), their steps
        return await TrainJob(
            *args,
            PARAMETER_SERVER_STEPS[job.spec.strategy],
            alive=self.membership.alive,
            train_sets=self.train_sets,
            links=self.links,
            store=self._priority_store(),
        ).run()

    def _priority_store(self) -> PriorityStore:
        """The memory store as a ``sampling: prioritized`` train job keeps its table in it."""
        return PriorityStore(
            self.tables,
            self.sampler,
            self.memory,
            self._insert_router,
            self.rebalancer,
            self.cfg.max_sample_batch,
            self.cfg.queue_timeout_s,
        )

    # -- status ---------------------------------------------------------------------------

    def link_figures(self, name: str) -> dict[str, Any]:
        """A worker's link figures for ``WorkerInfo`` (0 where not measured yet).

        rtt_ms, bandwidth_mbit (megabits/s), step_ms: EWMAs of ``LinkStats``; health in
        [0, 1] among the ALIVE workers; excluded and excluded_reason from the running train
        jobs' probation.
        """
        doc = self.links.get(name).to_doc(
            self.links.median_step_s([w.name for w in self.membership.alive()])
        )
        reason = self.links.excluded.get(name)
        return {
            "rtt_ms": doc["rtt_ms"] or 0.0,
            "bandwidth_mbit": doc["bandwidth_mbit"] or 0.0,
            "step_ms": doc["step_ms"] or 0.0,
            "health": doc["health"],
            "excluded": reason is not None,
            "excluded_reason": reason or "",
        }

    def slot_summary(self) -> dict[str, Any]:
        """Cluster-wide slot figures and per-worker slot counts (``Rebalancer.slot_summary``)."""
        return self.rebalancer.slot_summary()

    def _update_gauges(self) -> None:
        for state, n in self.membership.counts().items():
            self.metrics.workers.labels(state).set(n)
        for state, n in self.jobs.counts().items():
            self.metrics.jobs.labels(state).set(n)

    async def run_background(self) -> None:
        """Failure detection, scheduling and gauges; runs until cancelled."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.failures.run(), name="failure-detector")
            tg.create_task(self.link_probe.run(), name="link-probe")
            tg.create_task(self.scheduler.run(), name="scheduler")
            tg.create_task(self.rebalancer.run(), name="rebalancer")
            tg.create_task(self._refresh_gauges(), name="gauges")
            tg.create_task(self.drop_left_priority_tables(), name="left-priority-tables")

    async def drop_left_priority_tables(self) -> list[str]:
        """Drop the priority tables of prioritized train jobs that ended; return their names.

        Run once when the coordinator starts (``left_tables``); a failed drop is logged.
        """
        ended = [
            j.job_id
            for j in self.jobs.list()
            if j.state.terminal
            and isinstance(j.spec, TrainJobSpec)
            and j.spec.sampling.name == "prioritized"
        ]
        dropped = []
        for name in left_tables((t.name for t in self.tables.specs()), ended):
            try:
                await self.tables.drop(name)
                dropped.append(name)
            except Exception as exc:
                log.warning("priority_table_not_dropped", table=name, error=str(exc))
        return dropped

    async def _refresh_gauges(self) -> None:
        while True:
            self.prune_jobs()
            self._update_gauges()
            await asyncio.sleep(1.0)

    def prune_jobs(self, now: float | None = None) -> list[str]:
        """Apply ``job_retention``; return the ids pruned.

        Old finished jobs are forgotten in memory and in SQLite, and their checkpoint files
        and TensorBoard run directories deleted.

        Args:
            now: wall-clock seconds to measure ages against; None for ``time.time()``.
        """
        keep = self.cfg.job_retention
        dropped = self.jobs.prune(keep.max_jobs, keep.max_age_s, now)
        if dropped:
            self.state.delete_jobs(dropped)
            for job_id in dropped:
                (Path(self.cfg.data_dir) / "checkpoints" / f"{job_id}.ckpt").unlink(missing_ok=True)
                shutil.rmtree(self.cfg.tensorboard_dir() / job_id, ignore_errors=True)
            log.info("jobs_pruned", jobs=len(dropped))
        return dropped

    async def _wire_map(self) -> common_pb2.SlotMap:
        """The current map as ``GetSlotMap`` returns it (the capped inserts route with it)."""
        return self.rebalancer.wire_map()

    async def close(self) -> None:
        """Close worker channels and the state database."""
        await self._insert_router.close()
        await self.clients.close()
        self.state.close()
