"""Coordinator server lifecycle: build, bind, start, wait, drain, stop."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import torch

from coordinator.cluster import Cluster
from coordinator.coordinator_servicer import CoordinatorServicer
from coordinator.dashboard.http_server import DashboardServer
from coordinator.dashboard.http_server import check_exposure as check_dashboard_exposure
from coordinator.data_servicer import DataServicer
from shared import rpc
from shared.config import CoordinatorConfig
from shared.logging import get_logger
from shared.metrics import Metrics
from shared.private_files import private_dir
from shared.proto import coordinator_pb2_grpc
from shared.rpc.daemon_server import DaemonServer
from shared.rpc.interceptors import auth_interceptor, server_interceptors
from shared.security.exposure import check_listen, local_host
from shared.security.transport import DaemonSecurity

log = get_logger(__name__)
SERVICE_NAME = "neuroshard.v1.Coordinator"


class CoordinatorServer:
    """One coordinator: ``await start()`` returns the bound address; ``await stop()``."""

    def __init__(self, cfg: CoordinatorConfig) -> None:
        """Build the gRPC server, its servicers and the cluster state; nothing listens yet.

        Raises:
            ExposureRefused: a non-loopback ``listen`` (or ``dashboard_host`` with a
                dashboard) without mutual TLS and tokens, and not ``insecure`` (the process
                exits 2).
        """
        self.cfg = cfg
        check_listen(
            "coordinator", cfg.listen, cfg.tls is not None, cfg.auth is not None, cfg.insecure
        )
        if cfg.dashboard_port is not None:  # before the data dir and the cluster exist
            check_dashboard_exposure(cfg)
        self.metrics = Metrics()
        self.security = DaemonSecurity.from_config(
            cfg.tls, cfg.auth, "coordinator", coordinator=True
        )
        # The coordinator's own calls (to the workers) count their bytes in its metrics.
        self.security.channel = replace(self.security.channel, wire=self.metrics)
        torch.set_num_threads(cfg.torch_threads)  # process-wide: the parameter server's ops
        self.cluster = Cluster(cfg, self.metrics, self.security.channel)
        servicer = CoordinatorServicer(
            self.cluster,
            DataServicer(self.cluster),
            self.security.data_token_minter(cfg.auth.data_token_ttl_s if cfg.auth else 0),
        )
        self.rpc = DaemonServer(
            SERVICE_NAME,
            servicer,
            coordinator_pb2_grpc.add_CoordinatorServicer_to_server,
            self.security,
            interceptors=server_interceptors(self.metrics, auth_interceptor(self.security)),
            max_message_bytes=cfg.max_message_bytes,
            max_concurrent_streams=cfg.max_concurrent_streams,
        )
        self.address = ""
        private_dir(Path(cfg.data_dir))  # 0700: specs, models, checkpoints, data sets
        self.metrics_port: int | None = None
        self._background: asyncio.Task[None] | None = None
        self.dashboard: DashboardServer | None = None
        if cfg.dashboard_port is not None:
            self.dashboard = DashboardServer(
                self.cluster, cfg, self.security.public_key, self.security.revoked
            )

    async def start(self) -> str:
        """Bind, start serving and the background tasks; return ``host:port`` actually bound."""
        host, _, _ = self.cfg.listen.rpartition(":")
        port = await self.rpc.start(self.cfg.listen, self.cfg.probe_port)
        self.address = f"{local_host(host)}:{port}"
        if self.cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.cfg.metrics_port, self.cfg.metrics_host)
        if self.dashboard is not None:
            await self.dashboard.start()
        self._background = asyncio.create_task(self.cluster.run_background(), name="background")
        await self.rpc.set_serving(True)
        log.info(
            "coordinator_started",
            address=self.address,
            metrics_port=self.metrics_port,
            data_dir=self.cfg.data_dir,
            transport=self.security.transport,
            auth=self.security.auth,
            probe_port=self.rpc.probe_port,
            dashboard=self.dashboard.url if self.dashboard is not None else None,
        )
        return self.address

    async def stop(self) -> None:
        """Health NOT_SERVING, drain RPCs for ``grace_s``, cancel background tasks."""
        await self.rpc.begin_stop()
        # Jobs cancelled by this shutdown stay RUNNING on disk: the next coordinator resumes them.
        self.cluster.jobs.on_change = None
        if self.dashboard is not None:
            await self.dashboard.stop()
        if self._background is not None:
            self._background.cancel()
            # Bounded: a stop must never hang. Seen in tests: a test failing right after
            # start left the cancelled background task never finishing, and the fixture's
            # teardown waited until pytest-timeout (cause not found; the task vanished
            # from asyncio.all_tasks).
            done, _ = await asyncio.wait({self._background}, timeout=self.cfg.grace_s + 1.0)
            if not done:
                log.warning("background_tasks_not_stopped", timeout_s=self.cfg.grace_s + 1.0)
        await self.rpc.stop(self.cfg.grace_s)
        self.metrics.close()
        self.cluster.state.mark_clean_stop()
        await self.cluster.close()
        log.info("coordinator_stopped", address=self.address)


async def serve(cfg: CoordinatorConfig, ready_file: str | None = None) -> None:
    """Run a coordinator until SIGTERM or SIGINT, then shut down gracefully."""
    server = CoordinatorServer(cfg)
    await rpc.write_ready_file(ready_file, await server.start())
    await rpc.wait_for_stop_signal()
    log.info("coordinator_stopping")
    await server.stop()
