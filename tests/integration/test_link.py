"""Emulated links end to end: gRPC through the proxy, ``neuroshard link``, ``up --links``."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.cli.local_cluster import LocalCluster
from shared.client import SyncClient
from shared.net.link_proxy import LinkProxy, LinkSettings
from tests.integration.cli_helpers import CLI, REPO, processes_mentioning, run_cli

pytestmark = pytest.mark.integration


async def test_grpc_health_check_through_a_slow_link(health_server: int) -> None:
    proxy = LinkProxy(
        "127.0.0.1", 0, "127.0.0.1", health_server, LinkSettings(latency_ms=10, jitter_ms=2)
    )
    port = await proxy.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)  # connects
            start = time.perf_counter()
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            elapsed_ms = (time.perf_counter() - start) * 1e3
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert elapsed_ms >= 2 * (10 - 2)  # one round trip through the link at least
        assert proxy.counters.connections == 1 and proxy.counters.bytes_to_client > 0
    finally:
        await proxy.stop()


async def test_grpc_sees_unavailable_when_the_link_resets(health_server: int) -> None:
    proxy = LinkProxy(
        "127.0.0.1", 0, "127.0.0.1", health_server, LinkSettings(reset_every_mb=0.001)
    )
    port = await proxy.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(aio.AioRpcError) as err:
                for _ in range(50):  # ~100 bytes per check, plus the HTTP/2 preface
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert proxy.counters.resets >= 1
    finally:
        await proxy.stop()


async def test_link_command_prints_its_port_relays_and_stops_on_sigterm(
    health_server: int,
) -> None:
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        *["link", "--listen", "127.0.0.1:0", "--target", f"127.0.0.1:{health_server}"],
        *["--latency-ms", "5", "--bandwidth-mbit", "100"],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        address = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
        host, _, port = address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
        async with aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, stderr
    assert b'"event": "link_stopped"' in stderr and b'"connections": 1' in stderr


def test_local_cluster_workers_register_their_links_address(tmp_path: Path) -> None:
    links: list[LinkSettings | None] = [LinkSettings(latency_ms=5), None]
    with LocalCluster(2, data_dir=tmp_path / "data", log_dir=tmp_path / "logs", links=links) as c:
        with SyncClient(c.address, timeout_s=10) as client:
            workers = {w["name"]: w["address"] for w in client.status()["workers"]}
            # Memories land on both workers: the data plane goes through worker-0's link.
            ids = np.arange(1, 201, dtype=np.uint64)
            assert client.upsert(ids, np.full(200, 0.5, dtype=np.float32)) == 200
            found, strengths, _ = client.get(ids)
        worker_port, proxy = c.link_addresses["worker-0"]
    assert workers["worker-0"] == proxy != f"127.0.0.1:{worker_port}"
    assert "worker-1" not in c.link_addresses and workers["worker-1"] != proxy
    assert found.all() and (strengths == 0.5).all()
    log = (tmp_path / "logs" / "link-worker-0.log").read_text()
    stopped = json.loads(next(ln for ln in log.splitlines() if "link_stopped" in ln))
    assert stopped["connections"] >= 1 and stopped["bytes_to_target"] > 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- {latency_ms: 1}\n- {latency_ms: -1}\n", "links[1].latency_ms: Input should be"),
        ("- null\n- {bandwidth: 5}\n", "links[1].bandwidth: Extra inputs are not permitted"),
        ("latency_ms: 5\n", "links: expected a list"),
    ],
)
def test_up_refuses_an_invalid_links_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "links.yaml"
    path.write_text(text)
    result = run_cli("up", "--links", str(path), "--port", "0", timeout=30)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {message}" or message in result.stderr


def test_up_wants_one_link_per_worker(tmp_path: Path) -> None:
    result = run_cli("up", "--workers", "2", "--links", str(REPO / "configs/links-wan.yaml"))
    assert result.returncode == 2
    assert "4 entries for 2 workers" in result.stderr


def test_up_with_links_prints_the_coordinator_and_each_link(tmp_path: Path) -> None:
    links = tmp_path / "links.yaml"
    links.write_text("- {latency_ms: 2, bandwidth_mbit: 100}\n")
    proc = subprocess.Popen(
        [*CLI, "up", "--links", str(links), "--port", "0", "--data-dir", str(tmp_path / "d")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()  # once every worker is ALIVE
        with SyncClient(address, timeout_s=10) as client:
            (worker,) = client.status()["workers"]
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert f"worker-0: advertised at {worker['address']} -> 127.0.0.1:" in stderr
    assert "(2 ms, 100 Mbit/s)" in stderr
    assert processes_mentioning(str(tmp_path / "d")) == []
