"""Worker server lifecycle.

Reload slot data, serve, register with the coordinator, heartbeat, drain, stop.
"""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import replace
from pathlib import Path

from grpc import aio

from shared import rpc
from shared.config import WorkerConfig
from shared.logging import get_logger
from shared.metrics import Metrics
from shared.proto import coordinator_pb2, coordinator_pb2_grpc, worker_pb2_grpc
from shared.rpc.daemon_server import DaemonServer
from shared.rpc.interceptors import auth_interceptor, server_interceptors
from shared.rpc.peers import WorkerClients
from shared.security.exposure import check_listen, local_host
from shared.security.transport import DaemonSecurity
from shared.training.controls import resolve_device
from worker.allreduce.allreduce_servicer import AllreduceServicer
from worker.allreduce.allreduce_sessions import AllreduceSessions
from worker.memory.memory_node import MemoryNode
from worker.memory.memory_servicer import MemoryServicer
from worker.memory.node_holder import NodeHolder
from worker.memory.peers import PeerLinks
from worker.registration import Registration, RegistrationRefused
from worker.store import kernels
from worker.store.journal import Journal, lock_data_dir, recover
from worker.store.journal_format import JournalError
from worker.store.store import SlotStore
from worker.store.store_metrics import StoreMetrics
from worker.training.shard_cache import ShardCache
from worker.training.shards import ShardFetcher
from worker.training.training_servicer import TrainingServicer
from worker.training.training_sessions import TrainingSessions
from worker.worker_servicer import WorkerServicer

log = get_logger(__name__)
SERVICE_NAME = "neuroshard.v1.Worker"


class WorkerServer:
    """One worker: ``await start()`` serves and registers; ``await stop()``."""

    def __init__(self, cfg: WorkerConfig) -> None:
        """Build the server and its parts from ``cfg``; nothing listens before ``start``."""
        self.cfg = cfg
        self.name = cfg.name or socket.gethostname()
        _, self.device = kernels.get_xp(cfg.device)
        # Where this worker trains (torch), independent of the memory kernels' ``device``.
        self.train_device = str(resolve_device("auto"))
        self.metrics = Metrics()
        check_listen("worker", cfg.listen, cfg.tls is not None, cfg.auth is not None, cfg.insecure)
        self.security = DaemonSecurity.from_config(cfg.tls, cfg.auth, self.name)
        # The worker's own calls (heartbeats, replication, copies) count their bytes.
        self.security.channel = replace(self.security.channel, wire=self.metrics)
        self.coordinator_channel = rpc.channel(
            cfg.coordinator, cfg.max_message_bytes, self.security.channel
        )
        self.coordinator = coordinator_pb2_grpc.CoordinatorStub(self.coordinator_channel)
        # File data sets' rows come from the coordinator over its channel (no shared disk).
        self.shard_cache = ShardCache(Path(cfg.data_dir) / "shard_cache", cfg.shard_cache_bytes)
        fetcher = ShardFetcher(
            self.coordinator, self.name, cfg.rpc_timeout_s, self.shard_cache, self.metrics
        )
        self.sessions = TrainingSessions(
            cfg.torch_threads, cfg.allowed_models, self.name, fetcher, cfg.allowed_losses
        )
        listen_host, _, _ = cfg.listen.rpartition(":")
        self.advertise_host = cfg.advertise_host or local_host(listen_host)
        # strategy allreduce: one child process per job, which joins the job's process group
        # (its gloo traffic goes to this host directly, never through advertise_address)
        self.allreduce = AllreduceSessions(
            cfg.torch_threads,
            cfg.allowed_models,
            self.name,
            fetcher,
            self.advertise_host,
            cfg.allowed_losses,
        )
        self.peers = WorkerClients(cfg.max_message_bytes, self.security.channel)
        self.links = PeerLinks(self.peers, cfg.chunk_bytes, cfg.rpc_timeout_s)
        self.data_dir = Path(cfg.data_dir)
        self.nodes = NodeHolder(self._new_node, self.data_dir, cfg.coordinator)
        self.store_metrics = StoreMetrics(self.metrics)
        self.store_metrics.report_memories(self._memories_by_role)
        self.servicer = WorkerServicer(
            MemoryServicer(
                self.nodes,
                self.links.send_slots,
                cfg.chunk_bytes,
                cfg.max_message_bytes,
                cfg.max_receive_slots_bytes,
            ),
            TrainingServicer(self.sessions, cfg.chunk_bytes),
            AllreduceServicer(self.allreduce, cfg.chunk_bytes),
        )
        self.rpc = DaemonServer(
            SERVICE_NAME,
            self.servicer,
            worker_pb2_grpc.add_WorkerServicer_to_server,
            self.security,
            interceptors=server_interceptors(
                self.metrics, auth_interceptor(self.security), self.name, cfg.max_batch_items
            ),
            max_message_bytes=cfg.max_message_bytes,
            max_concurrent_streams=cfg.max_concurrent_streams,
        )
        self.address = ""
        self._data_lock = -1  # fd holding the data dir's lock until a journal owns it
        self.registration: Registration | None = None
        self._tasks: asyncio.Task[None] | None = None
        self.failed = asyncio.Event()  # set when this worker cannot go on (see ``error``)
        self.port = 0  # the gRPC port bound by start()
        self.metrics_port: int | None = None  # the /metrics port bound (cfg's 0: a free one)
        self.error = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unhealthy: asyncio.Task[None] | None = None
        self.storage_failure = ""  # why the journal failed (this worker is NOT_SERVING), if it did

    async def start(self) -> str:
        """Reload, bind and serve, then register in the background; return the address.

        The slot data of a previous run is reloaded from the data dir first; the address
        returned is the one advertised to the coordinator.

        Raises:
            JournalError: the data dir is in use by another worker or corrupt.
        """
        self._loop = asyncio.get_running_loop()
        self._data_lock = lock_data_dir(self.data_dir)
        try:
            await asyncio.to_thread(self._reload)
        except BaseException:
            self._release_data_dir()
            raise
        port = self.port = await self.rpc.start(self.cfg.listen, self.cfg.probe_port)
        # advertise_address (e.g. a link proxy in front of us) is registered verbatim.
        self.address = self.cfg.advertise_address or f"{self.advertise_host}:{port}"
        if self.cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.cfg.metrics_port, self.cfg.metrics_host)
        self.registration = Registration(
            self.coordinator,
            self.name,
            self.address,
            self.device,
            memories=self._memories,
            rpc_timeout_s=self.cfg.rpc_timeout_s,
            on_register=self._on_register,
            epoch=self._epoch,
            train_device=self.train_device,
            held_memories=self._held_memories,
        )
        self._tasks = asyncio.create_task(self.registration.run(), name="registration")
        self._tasks.add_done_callback(self._registration_ended)
        if not self.storage_failure:  # a journal failed during the reload stays unhealthy
            await self.rpc.set_serving(True)
        log.info(
            "worker_started",
            worker=self.name,
            address=self.address,
            coordinator=self.cfg.coordinator,
            device=self.device,
            train_device=self.train_device,
            transport=self.security.transport,
            auth=self.security.auth,
            probe_port=self.rpc.probe_port,
            metrics_port=self.metrics_port,
        )
        return self.address

    def _reload(self) -> None:
        """Rebuild the store from the data dir (snapshot + log), if it holds any."""
        rec = recover(self.data_dir, self._new_store)
        if rec is None:
            return
        journal = self._open_journal(rec.store.slots, rec.next_gen, rec.log_bytes)
        self.nodes.install(
            MemoryNode(
                self.name,
                rec.store,
                self.links.forward,
                self._report_failure,
                journal,
                rec.requests,
                self.store_metrics,
            )
        )
        log.info(
            "worker_reloaded",
            worker=self.name,
            data_dir=str(self.data_dir),
            memories=len(rec.store),
            slots_held=int((rec.store.slot_counts() > 0).sum()),
            log_records=rec.records,
            seconds=round(rec.seconds, 3),
        )

    def _new_store(self, slots: int, max_payload_bytes: int | None = None) -> SlotStore:
        return SlotStore(
            slots=slots,
            device=self.cfg.device,
            max_payload_bytes=self.cfg.max_payload_bytes
            if max_payload_bytes is None
            else max_payload_bytes,
            k_max=1 << 31,
        )

    def _open_journal(self, slots: int, gen: int = 0, log_bytes: int = 0) -> Journal:
        lock, self._data_lock = self._data_lock, -1
        return Journal(
            self.data_dir,
            lock,
            slots,
            gen,
            self.cfg.fsync,
            self.cfg.fsync_interval_s,
            self.cfg.snapshot_log_bytes,
            log_bytes,
            on_failure=self._storage_failed,
        )

    def _storage_failed(self, reason: str) -> None:
        """The journal failed (from its thread): report this worker NOT_SERVING from now on.

        Writes are refused by the journal itself; health tells probes and clients why.
        """
        self.storage_failure = reason
        log.error("worker_storage_failed", worker=self.name, reason=reason)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._set_not_serving)

    def _set_not_serving(self) -> None:
        self._unhealthy = asyncio.ensure_future(self.rpc.set_serving(False))

    def _release_data_dir(self) -> None:
        if self._data_lock >= 0:
            os.close(self._data_lock)
            self._data_lock = -1

    def _on_register(self, reply: coordinator_pb2.RegisterWorkerResponse) -> None:
        self.nodes.ensure(reply.slot_map)

    def _new_node(self, slots: int, max_payload_bytes: int) -> MemoryNode:
        """Create the memory store once the cluster's slot count is known.

        From the registration reply or the first pushed slot map, whichever comes first.
        """
        return MemoryNode(
            self.name,
            self._new_store(slots, max_payload_bytes),
            self.links.forward,
            self._report_failure,
            self._open_journal(slots),
            ops=self.store_metrics,
        )

    def _registration_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and isinstance(task.exception(), RegistrationRefused):
            self.error = str(task.exception())
            log.error("worker_refused", worker=self.name, error=self.error)
            self.failed.set()

    async def _report_failure(self, worker: str, slots: list[int], reason: str) -> None:
        """Tell the coordinator that this primary stops updating ``worker``'s copies of ``slots``.

        Raises:
            grpc.aio.AioRpcError: the coordinator did not take the report.
        """
        log.warning(
            "replica_failed", worker=self.name, replica=worker, slots=len(slots), reason=reason
        )
        await self.coordinator.ReportFailure(
            coordinator_pb2.ReportFailureRequest(
                reporter=self.name, worker=worker, reason=reason, slots=slots
            ),
            timeout=self.cfg.rpc_timeout_s,
        )

    def _epoch(self) -> int:
        node = self.nodes.current
        return 0 if node is None else node.epoch

    def _memories_by_role(self) -> dict[str, int]:
        """Memories held per role (``neuroshard_memories``, read at each scrape)."""
        node = self.nodes.current
        return {} if node is None else node.memories_by_role()

    def _held_memories(self) -> tuple[list[int], list[int]]:
        """Memories per held slot (reported in heartbeats; ``MemoryNode.held_memories``)."""
        node = self.nodes.current
        return ([], []) if node is None else node.held_memories()

    def _memories(self) -> int:
        """Memories held as primary (reported in heartbeats)."""
        node = self.nodes.current
        return 0 if node is None else node.primary_memories()

    async def drain(self) -> bool:
        """Hand this worker's slots to the others before leaving (SIGTERM, Kubernetes preStop).

        Ask the coordinator to drain it and poll until it holds no slot, serving meanwhile.

        Returns:
            True when drained; False after ``drain_timeout_s`` or if the coordinator is down.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.drain_timeout_s
        log.info("worker_draining", worker=self.name)
        while loop.time() < deadline:
            try:
                reply = await self.coordinator.DrainWorker(
                    coordinator_pb2.DrainWorkerRequest(name=self.name), timeout=5.0
                )
            except aio.AioRpcError as exc:
                log.warning(
                    "drain_failed", worker=self.name, code=exc.code().name, details=exc.details()
                )
                return False
            if reply.drained:
                log.info("worker_drained", worker=self.name)
                return True
            await asyncio.sleep(0.1)
        log.warning("drain_timeout", worker=self.name, timeout_s=self.cfg.drain_timeout_s)
        return False

    async def stop(self) -> None:
        """Health NOT_SERVING, stop heartbeating, drain RPCs, close channels."""
        await self.rpc.begin_stop()
        if self._tasks is not None:
            self._tasks.cancel()
            # Bounded, as the coordinator's stop: a stop must never hang.
            done, _ = await asyncio.wait({self._tasks}, timeout=self.cfg.grace_s + 1.0)
            if not done:
                log.warning("background_tasks_not_stopped", timeout_s=self.cfg.grace_s + 1.0)
        await self.rpc.stop(self.cfg.grace_s)
        self.metrics.close()
        await self.coordinator_channel.close()
        await self.peers.close()
        self.sessions.close()
        await self.allreduce.close()
        if self.nodes.current is not None:
            self.nodes.current.close()
        self._release_data_dir()
        log.info("worker_stopped", worker=self.name)


async def serve(cfg: WorkerConfig, ready_file: str | None = None) -> None:
    """Run a worker until SIGTERM or SIGINT, then shut down gracefully.

    Raises:
        SystemExit: the data dir cannot be used, or the coordinator's cluster has another
            slot count than the data dir (one line naming the problem).
    """
    server = WorkerServer(cfg)
    try:
        address = await server.start()
    except JournalError as exc:
        raise SystemExit(f"worker: {exc}") from None
    await rpc.write_ready_file(ready_file, address)
    await rpc.wait_for_stop_signal(server.failed)
    if server.failed.is_set():
        await server.stop()
        raise SystemExit(f"worker: {server.error}")
    log.info("worker_stopping", worker=server.name)
    if server.nodes.current is not None:
        await server.drain()
    await server.stop()
