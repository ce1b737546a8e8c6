"""Worker server lifecycle: serve, register with the coordinator, heartbeat, drain, stop."""

from __future__ import annotations

import asyncio
import signal
import socket
from pathlib import Path

import numpy as np
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared import rpc
from shared.config import WorkerConfig
from shared.logging import get_logger
from shared.metrics import Metrics
from shared.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc, worker_pb2_grpc
from shared.worker_clients import WorkerClients
from worker import kernels
from worker.memory_node import MemoryNode
from worker.registration import Registration
from worker.store import SlotStore
from worker.training import TrainingSessions
from worker.worker_servicer import WorkerServicer

log = get_logger("worker.server")
SERVICE_NAME = "neuroshard.v1.Worker"


class WorkerServer:
    """One worker: ``await start()`` serves and registers; ``await stop()``."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.name = cfg.name or socket.gethostname()
        _, self.device = kernels.get_xp(cfg.device)
        self.metrics = Metrics()
        self.sessions = TrainingSessions(cfg.torch_threads)
        self.health = health.aio.HealthServicer()
        self.server = aio.server(
            interceptors=[rpc.MetricsInterceptor(self.metrics)],
            options=rpc.message_options(cfg.max_message_bytes),
        )
        self.peers = WorkerClients(cfg.max_message_bytes)
        self.servicer = WorkerServicer(
            self.sessions, cfg.chunk_bytes, self.peers, cfg.rpc_timeout_s
        )
        self.servicer.ensure_node = self.ensure_node
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.coordinator_channel = rpc.channel(cfg.coordinator, cfg.max_message_bytes)
        self.address = ""
        Path(cfg.data_dir).mkdir(parents=True, exist_ok=True)
        self.registration: Registration | None = None
        self._tasks: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Bind and serve, then register in the background; return the advertised address."""
        host, _, _ = self.cfg.listen.rpartition(":")
        port = self.server.add_insecure_port(self.cfg.listen)
        adv = self.cfg.advertise_host or ("127.0.0.1" if host in ("0.0.0.0", "[::]") else host)
        self.address = f"{adv}:{port}"
        await self.server.start()
        if self.cfg.metrics_port is not None:
            self.metrics.serve(self.cfg.metrics_port)
        self.registration = Registration(
            coordinator_pb2_grpc.CoordinatorStub(self.coordinator_channel),
            self.name,
            self.address,
            self.device,
            memories=self._memories,
            rpc_timeout_s=self.cfg.rpc_timeout_s,
            on_register=self._on_register,
        )
        self.registration.epoch = self._epoch
        self._tasks = asyncio.create_task(self.registration.run(), name="registration")
        for svc in ("", SERVICE_NAME):
            await self.health.set(svc, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "worker_started",
            worker=self.name,
            address=self.address,
            coordinator=self.cfg.coordinator,
            device=self.device,
            transport="plaintext",
        )
        return self.address

    def _on_register(self, reply: coordinator_pb2.RegisterWorkerResponse) -> None:
        self.ensure_node(reply.slot_map)

    def ensure_node(self, slot_map: common_pb2.SlotMap) -> MemoryNode:
        """Create the memory store once the cluster's slot count is known (from the
        registration reply or the first pushed slot map, whichever comes first)."""
        if self.servicer.node_or_none is None:
            store = SlotStore(
                slots=slot_map.slots or 1024,
                device=self.cfg.device,
                max_payload_bytes=slot_map.max_payload_bytes,
                k_max=1 << 31,
            )
            self.servicer.node_or_none = MemoryNode(
                self.name, store, self.servicer.forward, self._report_failure
            )
        return self.servicer.node_or_none

    async def _report_failure(self, worker: str, reason: str) -> None:
        """Tell the coordinator a copy on ``worker`` failed (raises grpc.aio.AioRpcError)."""
        log.warning("replica_failed", worker=self.name, replica=worker, reason=reason)
        stub = coordinator_pb2_grpc.CoordinatorStub(self.coordinator_channel)
        await stub.ReportFailure(
            coordinator_pb2.ReportFailureRequest(reporter=self.name, worker=worker,
                                                 reason=reason),
            timeout=self.cfg.rpc_timeout_s,
        )

    def _epoch(self) -> int:
        node = self.servicer.node_or_none
        return 0 if node is None else node.roles.epoch

    def _memories(self) -> int:
        """Memories held as primary (reported in heartbeats)."""
        node = self.servicer.node_or_none
        if node is None:
            return 0
        return int(node.store.count(np.flatnonzero(node.roles.primary)))

    async def drain(self) -> bool:
        """Hand this worker's slots to the others before leaving (SIGTERM, Kubernetes preStop):
        ask the coordinator to drain it and poll until it holds no slot, serving meanwhile.

        Returns:
            True when drained; False after ``drain_timeout_s`` or if the coordinator is down.
        """
        stub = coordinator_pb2_grpc.CoordinatorStub(self.coordinator_channel)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.drain_timeout_s
        log.info("worker_draining", worker=self.name)
        while loop.time() < deadline:
            try:
                reply = await stub.DrainWorker(
                    coordinator_pb2.DrainWorkerRequest(name=self.name), timeout=5.0
                )
            except aio.AioRpcError as exc:
                log.warning("drain_failed", worker=self.name, code=exc.code().name,
                            details=exc.details())
                return False
            if reply.drained:
                log.info("worker_drained", worker=self.name)
                return True
            await asyncio.sleep(0.1)
        log.warning("drain_timeout", worker=self.name, timeout_s=self.cfg.drain_timeout_s)
        return False

    async def stop(self) -> None:
        """Health NOT_SERVING, stop heartbeating, drain RPCs, close channels."""
        await self.health.enter_graceful_shutdown()
        if self._tasks is not None:
            self._tasks.cancel()
            await asyncio.gather(self._tasks, return_exceptions=True)
        await self.server.stop(self.cfg.grace_s)
        await self.coordinator_channel.close()
        await self.peers.close()
        self.sessions.close()
        if self.servicer.node_or_none is not None:
            self.servicer.node_or_none.close()
        log.info("worker_stopped", worker=self.name)


async def serve(cfg: WorkerConfig, ready_file: str | None = None) -> None:
    """Run a worker until SIGTERM or SIGINT, then shut down gracefully."""
    server = WorkerServer(cfg)
    address = await server.start()
    if ready_file:
        await asyncio.to_thread(Path(ready_file).write_text, address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("worker_stopping", worker=server.name)
    if server.servicer.node_or_none is not None:
        await server.drain()
    await server.stop()
