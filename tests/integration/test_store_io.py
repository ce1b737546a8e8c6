"""``memory export`` / ``memory import`` against real in-process clusters: a round trip
between two clusters equals the original, a bad file writes nothing, roles are enforced."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from shared.cli.main import main
from shared.client import NeuroshardError
from tests.conftest import wait_until
from tests.integration.security_helpers import Material, worker_state

pytestmark = pytest.mark.integration

SLOTS = 16
N = 3_000
# Cluster A exports in tiny pieces (issue 20 #4): batches of about 100 memories (one slot
# of ~190 each), 1 KiB MemoryChunk messages (several per batch) and 1 KiB SlotData messages
# from the primaries (several per slot), so a piece dropped anywhere fails the round trip.
TINY_EXPORT: dict[str, object] = {"export_batch_memories": 100, "chunk_bytes": 1024}
TINY_DUMPS: dict[str, object] = {"chunk_bytes": 1024}


def _store(seed: int = 5) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
    rng = np.random.default_rng(seed)
    ids = rng.choice(1 << 40, size=N, replace=False).astype(np.uint64)
    strengths = rng.random(N, dtype=np.float32)
    payloads = [f"memory {i}".encode() if i % 4 == 0 else b"" for i in range(N)]
    return ids, strengths, payloads


def _read(path: Path) -> dict[int, tuple[float, bytes]]:
    """id -> (strength, payload) of an export file, read with plain NumPy."""
    with np.load(path, allow_pickle=False) as d:
        ids, s = d["ids"].tolist(), d["strengths"].tolist()
        if "payload_offsets" not in d.files:
            return {i: (v, b"") for i, v in zip(ids, s, strict=True)}
        o, data = d["payload_offsets"].tolist(), d["payload_bytes"]
    return {
        i: (v, data[o[k] : o[k + 1]].tobytes()) for k, (i, v) in enumerate(zip(ids, s, strict=True))
    }


def _line(out: str, start: str) -> str:
    """The CLI's line that starts with ``start`` (the in-process daemons log to stdout too)."""
    return next(line for line in out.splitlines() if line.startswith(start))


async def _second_cluster(make_cluster, tmp_path: Path, workers: int = 3):
    """Another cluster beside the first (its own coordinator dir and worker names)."""
    b = await make_cluster(workers=0, slots=SLOTS, data_dir=str(tmp_path / "coord-b"))
    for i in range(workers):
        await b.add_worker(f"b-{i}")
    await b.wait_alive(workers)
    return b


async def test_export_then_import_into_a_fresh_cluster_equals_the_original(
    make_cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Arrange: a store with payloads on a quarter of the memories, and a second cluster
    a = await make_cluster(workers=3, slots=SLOTS, worker_overrides=TINY_DUMPS, **TINY_EXPORT)
    ids, strengths, payloads = _store()
    async with a.client() as client:
        await client.wait_ready()
        await client.upsert(ids, strengths, payloads)
        await client.reinforce(ids[:500], np.full(500, 0.25, np.float32))
        found, expected_s, expected_p = await client.get(ids, with_payloads=True)
    assert found.all()
    workers = a.coordinator.cluster.membership.alive
    await wait_until(  # batches are sized by the primaries' counts (none yet: one batch)
        lambda: sum(w.memories for w in workers()) == N, what="heartbeats' memory counts"
    )
    b = await _second_cluster(make_cluster, tmp_path)
    async with b.client() as client_b:
        await client_b.wait_ready()
    original, copy = tmp_path / "a.npz", tmp_path / "b.npz"

    # Act: export A with the client, import into B and export B through the CLI
    messages: list[int] = []
    async with a.client() as client:
        exported = await client.export_memories(original, lambda n, _: messages.append(n))
    imported = await asyncio.to_thread(
        main, ["memory", "import", str(original), "--batch", "700", "--coordinator", b.address]
    )
    out_import = _line(capsys.readouterr().out, "imported ")
    again = await asyncio.to_thread(
        main, ["memory", "export", str(copy), "--coordinator", b.address]
    )
    out_export = _line(capsys.readouterr().out, "exported ")

    # Assert
    assert (imported, again) == (0, 0)
    assert out_import.startswith(f"imported {N} memories with payloads from {original} in ")
    assert out_export.startswith(f"exported {N} memories, ")
    assert exported["memories"] == N and exported["slots"] == SLOTS
    assert len(messages) >= 2 * SLOTS  # a batch per slot, several messages per batch
    assert exported["payloads"] == sum(len(p) for p in payloads)
    want = {
        i: (s, p or b"")
        for i, s, p in zip(ids.tolist(), expected_s.tolist(), expected_p, strict=True)
    }
    assert _read(original) == want
    assert _read(copy) == want
    async with b.client() as client_b:
        found_b, s_b, p_b = await client_b.get(ids, with_payloads=True)
    assert found_b.all() and s_b.tobytes() == expected_s.tobytes() and p_b == expected_p


async def test_a_bad_file_is_refused_naming_the_field_and_writes_nothing(
    make_cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Arrange: a store, and files each wrong in one way
    cluster = await make_cluster(workers=2, slots=SLOTS)
    ids, strengths, _ = _store(7)
    good = {
        "format": np.array("neuroshard-memory-export"),
        "version": np.array(1, np.uint32),
        "ids": ids + np.uint64(1),  # other ids than the stored ones: a write would show
        "strengths": strengths,
    }
    bad = {
        "dtype": ({"ids": good["ids"].astype(np.int64)}, "ids: dtype int64, expected uint64"),
        "lengths": ({"strengths": strengths[:-1]}, "ids and strengths differ in length"),
        "above 1": ({"strengths": np.r_[strengths[:-1], np.float32(1.5)]}, "1.5 is outside"),
        "nan": ({"strengths": np.r_[np.float32(np.nan), strengths[1:]]}, "strengths[0]: nan"),
        "duplicate": ({"ids": np.r_[good["ids"][:-1], good["ids"][:1]]}, "ids: id "),
        "missing": ({"strengths": None}, "no array 'strengths'"),
        "pickle": (
            {"ids": good["ids"].astype(object)},
            "ids: dtype object (a pickled array) is refused",
        ),
    }
    async with cluster.client() as client:
        await client.wait_ready()
        await client.upsert(ids, strengths)
        before = [worker_state(w) for w in cluster.workers]
        for case, (change, message) in bad.items():
            arrays = {k: v for k, v in (good | change).items() if v is not None}
            path = tmp_path / f"{case}.npz"
            np.savez(path, **arrays)

            # Act
            with pytest.raises(NeuroshardError) as err:
                await client.import_memories(path)

            # Assert
            assert err.value.code.name == "INVALID_ARGUMENT", case
            assert str(err.value).startswith(f"{path}: ") and message in str(err.value), case
        with pytest.raises(NeuroshardError) as unreadable:
            await client.import_memories(tmp_path / "nowhere.npz")
        with pytest.raises(NeuroshardError) as unwritable:
            await client.export_memories(tmp_path / "no-dir" / "x.npz")
    capsys.readouterr()
    cli_exit = await asyncio.to_thread(
        main, ["memory", "import", str(tmp_path / "nan.npz"), "--coordinator", cluster.address]
    )
    cli_err = capsys.readouterr().err
    assert str(unreadable.value).endswith("nowhere.npz: cannot read it (No such file or directory)")
    assert unwritable.value.code.name == "INVALID_ARGUMENT"
    assert str(unwritable.value).startswith(f"{tmp_path / 'no-dir' / 'x.npz'}: cannot write it")
    assert cli_exit == 2  # a bad file is a usage error: nothing was sent
    assert cli_err == f"error: {tmp_path / 'nan.npz'}: strengths[0]: nan is not finite\n"
    assert [worker_state(w) for w in cluster.workers] == before


async def test_export_and_import_refuse_the_wrong_role_and_change_nothing(
    secure, material: Material, tmp_path: Path
) -> None:
    # Arrange: a secure cluster with a store and an export made by a reader
    cluster = await secure(workers=2, slots=SLOTS)
    ids, strengths, _ = _store(9)
    writer = material.client(material.token("writer"))
    reader = material.client(material.token("reader"))
    worker = material.daemon_client("worker-0")  # a worker's certificate, no token
    coordinator = material.daemon_client()  # the coordinator's certificate
    from shared.client import Client

    async with Client(cluster.address, security=writer) as client:
        await client.wait_ready()
        await client.upsert(ids, strengths)
    backup = tmp_path / "backup.npz"
    async with Client(cluster.address, security=reader) as client:
        await client.export_memories(backup)
    np.savez(backup, **(dict(np.load(backup)) | {"strengths": np.zeros(N, np.float32)}))
    before = [worker_state(w) for w in cluster.workers]

    # Act
    async with Client(cluster.address, security=worker) as client:
        with pytest.raises(NeuroshardError) as no_export:
            await client.export_memories(tmp_path / "stolen.npz")
    async with Client(cluster.address, security=coordinator) as client:
        with pytest.raises(NeuroshardError) as no_export_as_coordinator:
            await client.export_memories(tmp_path / "stolen-too.npz")
    async with Client(cluster.address, security=reader) as client:
        with pytest.raises(NeuroshardError) as no_import:
            await client.import_memories(backup)
    async with Client(cluster.address, security=writer) as client:
        with pytest.raises(NeuroshardError) as no_forget:
            await client.forget_worker("worker-1", confirm=True)

    # Assert
    assert no_export.value.code.name == "PERMISSION_DENIED"
    assert "worker 'worker-0' may not call ExportMemories" in str(no_export.value)
    assert no_export_as_coordinator.value.code.name == "PERMISSION_DENIED"
    assert "coordinator 'coordinator' may not call ExportMemories" in str(
        no_export_as_coordinator.value
    )
    assert not (tmp_path / "stolen.npz").exists()
    assert not (tmp_path / "stolen-too.npz").exists()
    leftovers = [p.name for p in tmp_path.iterdir() if p.suffix == ".npz" or "export" in p.name]  # noqa: ASYNC240
    assert leftovers == ["backup.npz"]  # no stolen file, no temporary one
    assert no_import.value.code.name == "PERMISSION_DENIED"
    assert "reader 'tester' may not call Upsert" in str(no_import.value)
    assert no_forget.value.code.name == "PERMISSION_DENIED"
    assert "writer 'tester' may not call ForgetWorker" in str(no_forget.value)
    assert [worker_state(w) for w in cluster.workers] == before
    assert cluster.alive() == 2
