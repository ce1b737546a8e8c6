"""Issue 19 #17: an export holds at most export_batch_bytes, and only
max_concurrent_exports run at once (real coordinator and workers in-process)."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

import coordinator.memory.store_export as store_export
from shared.proto import coordinator_pb2, coordinator_pb2_grpc
from shared.rpc import channel
from shared.rpc.chunking import memory_sizes
from tests.conftest import wait_until

pytestmark = pytest.mark.integration

MiB = 1 << 20


async def test_export_batches_are_cut_by_bytes(make_cluster, monkeypatch, tmp_path: Path) -> None:
    # Arrange: 2048 memories x 4 KiB payloads (8 MiB) over 16 slots; batches of 1 MiB.
    cluster = await make_cluster(workers=2, slots=16, export_batch_bytes=MiB)
    ids = np.arange(2048, dtype=np.uint64)
    held: list[int] = []
    real_cut = store_export.cut_chunks

    def cut(batch, chunk_bytes, slots_done):
        held.append(int(memory_sizes(batch.ids, batch.payloads).sum()))
        return real_cut(batch, chunk_bytes, slots_done)

    monkeypatch.setattr(store_export, "cut_chunks", cut)
    async with cluster.client() as client:
        await client.wait_ready()
        for part in np.array_split(ids, 16):
            await client.upsert(part, np.full(len(part), 0.5, np.float32), [b"z" * 4096] * 128)

        # Act
        summary = await client.export_memories(tmp_path / "out.npz")

    # Assert: everything exported, never more than 1 MiB held (was: the whole store at once).
    assert summary["memories"] == 2048
    assert sum(held) >= 8 * MiB and len(held) > 8
    assert max(held) <= MiB


async def test_exports_beyond_max_concurrent_exports_are_refused(make_cluster) -> None:
    # Arrange: one export open (its header read, the rest left unread).
    cluster = await make_cluster(workers=1, slots=16, max_concurrent_exports=1)
    async with cluster.client() as client:
        await client.wait_ready()
        await client.upsert(list(range(100)), [0.5] * 100)
    request = coordinator_pb2.ExportMemoriesRequest()
    async with channel(cluster.address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        first = stub.ExportMemories(request, timeout=30)
        assert (await first.read()).HasField("header")

        # Act
        second = stub.ExportMemories(request, timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await second.read()
        first.cancel()
        del first

        # Assert: refused while the first runs; served again once it ended.
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_concurrent_exports is 1" in info.value.details()
        served: list[int] = []

        async def export_served() -> bool:
            try:
                chunks = [c async for c in stub.ExportMemories(request, timeout=30)]
            except grpc.aio.AioRpcError as exc:
                assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                return False  # the first stream's end not yet seen by the coordinator
            served.append(sum(len(c.memories.ids) // 8 for c in chunks))
            return True

        await wait_until(export_served, what="an export served after the first ended")
        assert served == [100]
