"""Prometheus metrics of both daemons (names ``neuroshard_*`` with unit suffixes).

Each daemon builds one ``Metrics`` on its own ``CollectorRegistry`` so several daemons can live
in one process (tests, ``neuroshard up`` runs them as processes anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


@dataclass
class Metrics:
    """Every metric of both daemons, registered on ``registry``.

    A metric a daemon does not touch stays at zero there (workers export no job gauges,
    the coordinator no memory-op histograms).

    Attributes:
        registry: the registry the metrics are registered on (one per daemon).
        workers: ``neuroshard_workers{state}``, workers known to the coordinator.
        jobs: ``neuroshard_jobs{state}``, jobs by state.
        train_steps: ``neuroshard_train_steps_total``, training steps completed.
        step_seconds: ``neuroshard_train_step_seconds{role}``, duration of a step.
        rpc_sent_bytes: ``neuroshard_rpc_sent_bytes_total{method}``, serialized responses.
        rpc_received_bytes: ``neuroshard_rpc_received_bytes_total{method}``, requests.
        rpc_client_sent_bytes: ``neuroshard_rpc_client_sent_bytes_total{method}``, serialized
            requests of the daemon's own calls (``shared.channel_bytes.CountingChannel``).
        rpc_client_received_bytes: ``neuroshard_rpc_client_received_bytes_total{method}``,
            the responses to them.
        rpcs: ``neuroshard_rpcs_total{method,code}``, RPCs served by status.
        memories: ``neuroshard_memories{role}``, memories a worker holds as primary or
            replica.
        memory_ops: ``neuroshard_memory_ops_total{op}``, store operations applied.
        memory_op_seconds: ``neuroshard_memory_op_seconds{op}``, their durations.
        slot_map_epoch: ``neuroshard_slot_map_epoch``, the current slot-map epoch.
        train_pieces: ``neuroshard_train_pieces_total{outcome}``, pieces of sync steps by
            outcome: accepted, rejected (non-finite or outlier gradient), dropped (late,
            ``straggler.mode: drop``), backup (copies launched, ``backup``).
        train_transfer_bytes: ``neuroshard_train_transfer_bytes_total{direction}``, bytes of
            training calls to and from the workers.
        worker_rtt_seconds: ``neuroshard_worker_rtt_seconds{worker}``, EWMA round trip.
        worker_bandwidth: ``neuroshard_worker_bandwidth_bytes_per_second{worker}``, EWMA of
            observed transfer rates.
        worker_step_seconds: ``neuroshard_worker_step_seconds{worker}``, EWMA of a training
            call's wall time.
        worker_health: ``neuroshard_worker_health{worker}``, health score in [0, 1].
        readmissions_refused: ``neuroshard_readmissions_refused_total``, registrations of a
            worker declared DEAD refused (in its hold-down, or unreachable).
        suspicions_unconfirmed: ``neuroshard_worker_suspicions_unconfirmed_total``, clients'
            reports of an unreachable worker that the coordinator's probes did not confirm.
        slot_copy_requests: ``neuroshard_slot_copy_requests_total``, CopySlots requests the
            rebalancer's copies got answered.
        shard_rows: ``neuroshard_shard_rows_total{source}``, training rows of file data sets
            a worker came to hold: fetched from the coordinator, or found in its shard cache.
        shard_fetched_bytes: ``neuroshard_shard_fetched_bytes_total``, bytes of training rows
            a worker fetched from the coordinator.
        convergence_ratio: ``neuroshard_convergence_ratio{job_id}``, a memory job's convergence
            after its last iteration (``shared.memory.stats.convergence_ratio``), a train
            job's after its last epoch (``coordinator.training.epoch_figures``); labelled
            ``job_id``, not ``job``, which Prometheus sets on every scraped series.
    """

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        """Create and register every metric."""
        r = self.registry
        self._http: WSGIServer | None = None
        self.workers = Gauge(
            "neuroshard_workers",
            "Workers known to the coordinator, by state.",
            ["state"],
            registry=r,
        )
        self.jobs = Gauge("neuroshard_jobs", "Jobs by state.", ["state"], registry=r)
        self.train_steps = Counter(
            "neuroshard_train_steps_total", "Training steps completed.", registry=r
        )
        self.step_seconds = Histogram(
            "neuroshard_train_step_seconds",
            "Duration of one training step, seconds.",
            ["role"],
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.rpc_sent_bytes = Counter(
            "neuroshard_rpc_sent_bytes_total",
            "Serialized bytes of RPC responses sent.",
            ["method"],
            registry=r,
        )
        self.rpc_received_bytes = Counter(
            "neuroshard_rpc_received_bytes_total",
            "Serialized bytes of RPC requests received.",
            ["method"],
            registry=r,
        )
        self.rpc_client_sent_bytes = Counter(
            "neuroshard_rpc_client_sent_bytes_total",
            "Serialized bytes of the requests of this daemon's own RPCs (as a client).",
            ["method"],
            registry=r,
        )
        self.rpc_client_received_bytes = Counter(
            "neuroshard_rpc_client_received_bytes_total",
            "Serialized bytes of the responses to this daemon's own RPCs (as a client).",
            ["method"],
            registry=r,
        )
        self.rpcs = Counter(
            "neuroshard_rpcs_total",
            "RPCs served, by method and status code.",
            ["method", "code"],
            registry=r,
        )
        self.memories = Gauge(
            "neuroshard_memories", "Memories held by this worker, by role.", ["role"], registry=r
        )
        self.memory_ops = Counter(
            "neuroshard_memory_ops_total", "Memory store operations applied.", ["op"], registry=r
        )
        self.memory_op_seconds = Histogram(
            "neuroshard_memory_op_seconds",
            "Duration of memory store operations, seconds.",
            ["op"],
            registry=r,
            buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5),
        )
        self.slot_map_epoch = Gauge(
            "neuroshard_slot_map_epoch", "Current slot-map epoch.", registry=r
        )
        self.train_pieces = Counter(
            "neuroshard_train_pieces_total",
            "Pieces of sync training steps, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.train_transfer_bytes = Counter(
            "neuroshard_train_transfer_bytes_total",
            "Bytes of training calls, by direction (to_workers, from_workers).",
            ["direction"],
            registry=r,
        )
        self.worker_rtt_seconds = Gauge(
            "neuroshard_worker_rtt_seconds",
            "EWMA round trip to a worker, seconds.",
            ["worker"],
            registry=r,
        )
        self.worker_bandwidth = Gauge(
            "neuroshard_worker_bandwidth_bytes_per_second",
            "EWMA of a worker's observed transfer rate, bytes per second.",
            ["worker"],
            registry=r,
        )
        self.worker_step_seconds = Gauge(
            "neuroshard_worker_step_seconds",
            "EWMA wall time of a worker's training call, seconds.",
            ["worker"],
            registry=r,
        )
        self.worker_health = Gauge(
            "neuroshard_worker_health",
            "A worker's health score in [0, 1] (see the README's formula).",
            ["worker"],
            registry=r,
        )
        self.readmissions_refused = Counter(
            "neuroshard_readmissions_refused_total",
            "Registrations of a worker declared DEAD refused: in its hold-down, or unreachable.",
            registry=r,
        )
        self.suspicions_unconfirmed = Counter(
            "neuroshard_worker_suspicions_unconfirmed_total",
            "Clients' reports of an unreachable worker that the coordinator's probes did not "
            "confirm.",
            registry=r,
        )
        self.slot_copy_requests = Counter(
            "neuroshard_slot_copy_requests_total",
            "CopySlots requests answered during rebalancing.",
            registry=r,
        )
        self.shard_rows = Counter(
            "neuroshard_shard_rows_total",
            "Training rows of file data sets a worker came to hold, by source (coordinator, "
            "cache).",
            ["source"],
            registry=r,
        )
        self.shard_fetched_bytes = Counter(
            "neuroshard_shard_fetched_bytes_total",
            "Bytes of training rows a worker fetched from the coordinator.",
            registry=r,
        )
        self.convergence_ratio = Gauge(
            "neuroshard_convergence_ratio",
            "A job's convergence: a memory job's after its last iteration (mean strength of "
            "the memories accessed in that iteration over the table's mean strength), a train "
            "job's after its last epoch (L_0 / L_e, mean per-sample training losses).",
            ["job_id"],
            registry=r,
        )

    def client_bytes(self, method: str) -> tuple[Callable[[int], None], Callable[[int], None]]:
        """``(count sent, count received)`` of this daemon's calls of ``method`` (``WireBytes``).

        Args:
            method: the RPC's short name, e.g. ``Sweep``.
        """
        return (
            self.rpc_client_sent_bytes.labels(method).inc,
            self.rpc_client_received_bytes.labels(method).inc,
        )

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` over HTTP from a daemon thread; return the port bound.

        The daemons keep the port returned (``metrics_port``), so a test can pass 0 and point
        a scraper at the port actually bound.

        Args:
            port: the port; 0 picks a free one.
            host: the daemon's ``metrics_host``: loopback unless the operator sets another.
        """
        self._http, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def close(self) -> None:
        """Stop serving ``/metrics`` (if ``serve`` was called) and free its port."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
