"""Emulated links end to end: gRPC through the proxy, ``neuroshard link``, ``up --links``."""

from __future__ import annotations

import asyncio
import contextlib
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
from shared.netem.link_proxy import LinkProxy, LinkSettings
from tests.conftest import wait_until
from tests.integration.cli_helpers import CLI, REPO, processes_mentioning, run_cli, start_link

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
    proc, address = await start_link(health_server, "--latency-ms", "5", "--bandwidth-mbit", "100")
    try:
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


# --- exposure and the connection cap (issue 19, finding 15) -----------------------------------


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0", "192.0.2.2:0"])
def test_link_refuses_to_listen_beyond_loopback_without_insecure(listen: str) -> None:
    # Act: a link that would publish a plaintext loopback target to the network.
    run = run_cli("link", "--listen", listen, "--target", "127.0.0.1:1", timeout=60)

    # Assert: refused with the flag that allows it named; it never listened.
    assert run.returncode == 2, run.stderr
    assert f"--listen: {listen} is reachable from other machines" in run.stderr
    assert "pass --insecure to accept the risk" in run.stderr
    assert run.stdout == "" and "link_started" not in run.stderr


def test_link_refuses_a_cap_below_one() -> None:
    run = run_cli("link", "--listen", "127.0.0.1:0", "--target", "127.0.0.1:1",
                  "--max-connections", "0", timeout=60)  # fmt: skip
    assert run.returncode == 2
    assert "max_connections: Input should be greater than or equal to 1" in run.stderr
    assert run.stdout == ""


async def _refused(port: int) -> bool:
    """Connect to 127.0.0.1:port; True when the proxy resets the connection on arrival."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionResetError:  # reset before the handshake was seen to complete
        return True
    try:
        return await asyncio.wait_for(reader.read(1), 10) == b""
    except ConnectionResetError:
        return True
    finally:
        await _close(writer)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def test_cap_refuses_the_connection_past_max_connections(health_server: int) -> None:
    # Arrange: a link relaying at most 2 connections, both held open.
    proxy = LinkProxy("127.0.0.1", 0, "127.0.0.1", health_server, LinkSettings(max_connections=2))
    port = await proxy.start()
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    try:
        await wait_until(lambda: proxy.counters.connections == 2, what="2 relayed connections")

        # Act: a third connection.
        refused = await _refused(port)

        # Assert: reset on arrival, counted, never relayed to the target.
        assert refused
        assert proxy.counters.refused_over_cap == 1
        assert proxy.counters.connections == 2
        # A connection that ends makes room for the next one.
        await _close(held.pop()[1])
        await wait_until(lambda: len(proxy._tasks) == 1, what="the closed connection to end")
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        await wait_until(lambda: proxy.counters.connections == 3, what="a new relayed connection")
        await _close(writer)
    finally:
        for _, w in held:
            await _close(w)
        await proxy.stop()


async def test_insecure_link_listens_openly_warns_and_keeps_its_cap(health_server: int) -> None:
    # Arrange: the operator accepts the risk of a link on every interface, capped at 1.
    proc, address = await start_link(
        health_server, "--listen", "0.0.0.0:0", "--insecure", "--max-connections", "1"
    )
    try:
        port = int(address.rpartition(":")[2])
        assert address.startswith("0.0.0.0:")
        # Act: one connection relayed (a health check), a second one while it is open.
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            refused = await _refused(port)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), 20)

    # Assert: served, the second connection reset, a warning at start, counts at the end.
    assert reply.status == health_pb2.HealthCheckResponse.SERVING and refused
    assert proc.returncode == 0, stderr
    events = [json.loads(line) for line in stderr.decode().splitlines() if line.startswith("{")]
    warning = next(e for e in events if e["event"] == "insecure_listen")
    assert warning["level"] == "warning" and warning["daemon"] == "link"
    stopped = next(e for e in events if e["event"] == "link_stopped")
    assert stopped["connections"] == 1 and stopped["refused_over_cap"] == 1
