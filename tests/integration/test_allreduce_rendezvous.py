"""An allreduce generation's rendezvous against a peer that reaches its ports (issue 19, 3).

The attack, during a real job on an in-process cluster (workers advertise 127.0.0.1): at the
moment rank 0's store is up and holds rank 0's keys, and before the other rank is told where
it is, an outsider (a) dials every port rank 0's training process listens on (store and gloo)
at this machine's non-loopback addresses, and (b) connects to the store on the advertised
host, as a local process could, lists its keys, reads them, and writes keys under the names
the group would use without the secret. Nothing of it may reach the group: every socket is
bound to 127.0.0.1, the keys it reads are sealed, and the job ends equal to its
single-process reference in one generation.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from coordinator.training.allreduce_generation import Generation
from shared.client import Client
from shared.proto import worker_pb2, worker_pb2_grpc
from tests.integration.test_allreduce import _max_diff, _spec, reference_params
from worker.allreduce.rendezvous_store import interface_addresses

pytestmark = pytest.mark.integration

Address = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


def _children(name: str = "worker.allreduce.allreduce_child") -> list[int]:
    """Pids of this process's children running ``name`` (the in-process workers' children)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and name.encode() in cmdline:
            found.append(int(entry.name))
    return found


def _listening(pid: int) -> list[Address]:
    """The (address, port) of every TCP socket ``pid`` listens on (/proc/net/tcp, tcp6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found: list[Address] = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            host_hex, port_hex = local.split(":")
            raw = bytes.fromhex(host_hex)
            # the kernel prints the address as 32-bit words in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((ipaddress.ip_address(raw), int(port_hex, 16)))
    return found


def _external_addresses() -> list[str]:
    """This machine's IPv4 addresses that are not loopback (may be none)."""
    return [
        str(a)
        for addresses in interface_addresses().values()
        for a in addresses
        if a.version == 4 and not a.is_loopback and not a.is_link_local
    ]


def _outsider(port: int) -> dict[str, Any]:
    """What a peer without the secret gets from the store at 127.0.0.1:port."""
    seen: dict[str, Any] = {"refused": []}
    for host in _external_addresses():
        with socket.socket() as s:
            s.settimeout(5)
            try:
                s.connect((host, port))
                seen["refused"].append(False)
            except ConnectionRefusedError:
                seen["refused"].append(True)
    store = TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
    deadline = time.monotonic() + 30
    while not store.list_keys() and time.monotonic() < deadline:
        time.sleep(0.02)  # rank 0 writes its keys as it starts its group
    seen["keys"] = store.list_keys()
    seen["values"] = [store.get(k) for k in seen["keys"]]
    # Keys under the names torch gives them, as an outsider without the secret would write.
    for guess in ("0", "1", "default_pg/0//cpu//0/1", "default_pg/0//cpu//1/0", "gen0/0"):
        store.set(guess, "127.0.0.1:1")
    return seen


async def test_outsider_reaches_no_socket_and_reads_no_key_of_a_generation(
    make_cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = await make_cluster(workers=2)  # a loopback cluster as `neuroshard up` runs it
    await _attack_during_a_job(cluster.client(), monkeypatch)


async def test_same_on_a_cluster_with_mutual_tls_and_tokens(
    secure, material, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = await secure(workers=2)  # as `neuroshard up --secure` runs it
    admin = material.client(material.token("admin"))
    await _attack_during_a_job(Client(cluster.address, security=admin), monkeypatch)


async def _attack_during_a_job(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run a 2-worker job; attack its generation's rendezvous; assert nothing reached it."""
    # Arrange: a spy on the coordinator's rendezvous attacks at the moment rank 0's store
    # is up, before rank 1 is told where it is.
    spec = _spec(2)
    attacks: list[dict[str, Any]] = []
    rendezvous = Generation._rendezvous_rank0

    async def spy(self: Generation) -> int | None:
        port = await rendezvous(self)
        assert port is not None
        sockets = [a for pid in _children() for a in _listening(pid)]
        attack = await asyncio.to_thread(_outsider, port)
        attacks.append({"port": port, "sockets": sockets, **attack})
        return port

    monkeypatch.setattr(Generation, "_rendezvous_rank0", spy)

    async with client:
        # Act
        final = await client.wait((await client.submit(spec)).job_id)

    # Assert: every listening socket on the advertised host, none on all interfaces ...
    (attack,) = attacks
    assert attack["port"] in [port for _, port in attack["sockets"]]
    assert len(attack["sockets"]) >= 2  # the store and rank 0's gloo listener
    assert {str(host) for host, _ in attack["sockets"]} == {"127.0.0.1"}
    assert all(attack["refused"])  # [] when the machine has no other address
    # ... the keys it read are hashed names and sealed values, not torch's keys ...
    assert attack["keys"] and all(len(k) == 64 and "/" not in k for k in attack["keys"])
    assert not any(b"127.0.0.1" in v or b"cpu" in v for v in attack["values"])
    # ... and what it wrote reached nobody: one generation, equal to the reference.
    assert final.state == "SUCCEEDED", final.error
    assert final.result["generations"] == 1
    assert _max_diff(final.result["model_path"], reference_params(spec)) < 1e-5


@pytest.mark.parametrize(
    ("secret", "got"), [("", "got 0 characters"), ("zz" * 32, "got 64"), ("ab" * 8, "got 16")]
)
async def test_generation_without_a_proper_secret_is_refused_before_any_child(
    make_cluster, secret: str, got: str
) -> None:
    # Arrange: a caller (plaintext loopback cluster) opens a generation with a bad secret.
    cluster = await make_cluster(workers=1)
    header = worker_pb2.AllreduceHeader(
        job_id="no-secret",
        spec_json=json.dumps(_spec(1)),
        world_size=1,
        rendezvous_secret=secret,
    )
    async with grpc.aio.insecure_channel(cluster.workers[0].address) as channel:
        call = worker_pb2_grpc.WorkerStub(channel).RunAllreduce(
            iter([worker_pb2.AllreduceInput(header=header)]), timeout=30
        )
        # Act
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass

    # Assert: refused, naming the field; no training process was started.
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "rendezvous_secret: expected at least 32 hex digits" in (err.value.details() or "")
    assert got in (err.value.details() or "")
    assert _children() == []
