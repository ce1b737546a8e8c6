"""``data put`` attacks against a real coordinator: a compressed set that inflates far beyond
its size, a corrupt deflate member, too many uploads at once, a full data root, and a writer
replacing another's data set. Each is refused with its status and a message naming the limit,
and leaves the data root as it was.

The coordinator runs in this process, so ``tracemalloc`` (which NumPy reports its buffers to)
sees what validating an upload allocates.
"""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest

from shared.client import Client, NeuroshardError
from shared.proto import coordinator_pb2, coordinator_pb2_grpc
from shared.rpc import channel
from tests.integration.security_helpers import Material
from tests.npz_files import corrupt_deflate_npz, npz_bytes

pytestmark = pytest.mark.integration

MiB = 1 << 20


def root_of(cluster) -> Path:
    return cluster.coordinator.cfg.dataset_roots()[0]


def listing(root: Path) -> dict[str, bytes]:
    """Every file in the data root with its bytes (hidden ones included)."""
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())} if root.exists() else {}


def small_set(n: int = 30, seed: int = 0) -> bytes:
    x = np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)
    return npz_bytes(x=x, y=np.arange(n, dtype=np.int64) % 2)


@asynccontextmanager
async def open_upload(address: str, name: str, total_bytes: int) -> AsyncIterator[object]:
    """A PutDataset stream whose header was sent; yields (call, first reply or the error)."""
    async with channel(address) as ch:
        call = coordinator_pb2_grpc.CoordinatorStub(ch).PutDataset(timeout=20)
        header = coordinator_pb2.DatasetHeader(name=name, total_bytes=total_bytes)
        await call.write(coordinator_pb2.DatasetChunk(header=header))
        try:
            yield call, await call.read()
        except grpc.aio.AioRpcError as exc:
            yield call, exc
        finally:
            call.cancel()


async def test_a_compressed_upload_is_validated_in_bounded_memory(
    make_cluster, tmp_path: Path
) -> None:
    # Arrange: 64 MiB of float32 zeros in well under 1 MB (the review's 467 KB cost 567 MB)
    cluster = await make_cluster(workers=0)
    n = 64 * MiB // (4 * 64)
    src = tmp_path / "zeros.npz"
    src.write_bytes(
        npz_bytes(
            compressed=True, x=np.zeros((n, 64), np.float32), y=np.arange(n, dtype=np.int64) % 2
        )
    )
    assert src.stat().st_size < MiB

    # Act
    async with cluster.client() as client:
        tracemalloc.start()
        try:
            info = await client.put_dataset(src)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    # Assert: stored, and validating it took a few chunks, not the 64 MiB it inflates to
    assert info["kind"] == "train" and info["arrays"][0]["shape"] == [n, 64]
    assert peak < 16 * MiB, f"peak {peak} bytes"


@pytest.mark.parametrize("intact", [4096, 32 * 1024], ids=["in the header", "in the data"])
async def test_a_corrupt_deflate_member_is_invalid_argument(
    make_cluster, tmp_path: Path, intact: int
) -> None:
    cluster = await make_cluster(workers=0)
    src = tmp_path / "corrupt.npz"
    src.write_bytes(corrupt_deflate_npz(intact))

    async with cluster.client() as client:
        with pytest.raises(NeuroshardError) as err:
            await client.put_dataset(src)

    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "corrupt.npz: not a readable .npz archive" in str(err.value)
    assert "invalid block type" in str(err.value)
    assert listing(root_of(cluster)) == {}


async def test_uploads_beyond_max_concurrent_uploads_are_refused(make_cluster) -> None:
    # Arrange: two uploads in progress (their headers accepted, no bytes sent yet)
    cluster = await make_cluster(workers=0, max_concurrent_uploads=2)
    root = root_of(cluster)

    async with (
        open_upload(cluster.address, "a", 1000) as (_, first),
        open_upload(cluster.address, "b", 1000) as (second_call, second),
    ):
        during = sorted(p.name for p in root.iterdir())
        # Act: a third
        async with open_upload(cluster.address, "c", 1000) as (_, third):
            pass
        # the slot of one that ends is given back
        second_call.cancel()
        await _wait_active(cluster, 1)
        async with open_upload(cluster.address, "d", 1000) as (_, fourth):
            pass

    # Assert
    assert first.HasField("accepted") and second.HasField("accepted")
    assert isinstance(third, grpc.aio.AioRpcError)
    assert third.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "c.npz: 2 uploads are in progress" in third.details()
    assert "max_concurrent_uploads 2" in third.details()
    assert len(during) == 2 and all(n.endswith(".part") for n in during)  # none for "c"
    assert fourth.HasField("accepted")
    await _wait_active(cluster, 0)
    assert listing(root) == {}


async def _wait_active(cluster, n: int) -> None:
    from tests.conftest import wait_until

    await wait_until(lambda: cluster.coordinator.cluster.uploads.active == n, what=f"{n} uploads")


async def test_an_upload_past_max_data_root_bytes_is_refused(make_cluster, tmp_path: Path) -> None:
    # Arrange: a stored set of S bytes; a quota with room for one more such set, not two
    data = small_set()
    src = tmp_path / "set.npz"
    src.write_bytes(data)
    quota = 2 * len(data) + len(data) // 2
    cluster = await make_cluster(workers=0, max_data_root_bytes=quota)
    root = root_of(cluster)
    async with cluster.client() as client:
        await client.put_dataset(src, name="kept")
        before = listing(root)

        # Act: one upload in progress (counted at its declared size), then another
        async with open_upload(cluster.address, "pending", len(data)) as (_, pending):
            with pytest.raises(NeuroshardError) as full:
                await client.put_dataset(src, name="third")
            during = sorted(p.name for p in root.iterdir())
        # replacing a set in place frees its bytes: it fits
        replaced = await client.put_dataset(src, name="kept", replace=True)

    # Assert
    assert pending.HasField("accepted")
    assert full.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    message = str(full.value)
    assert f"third.npz: {len(data)} bytes would bring the data root to {3 * len(data)}" in message
    assert f"max_data_root_bytes {quota} bytes" in message
    assert [n for n in during if not n.endswith(".part")] == ["kept.npz"]  # nothing for "third"
    assert replaced["name"] == "kept"
    assert listing(root) == before


async def test_only_the_owner_or_an_admin_replaces_a_data_set(
    secure, material: Material, tmp_path: Path
) -> None:
    # Arrange: alice (a writer) stores a set
    cluster = await secure(workers=0)
    root = root_of(cluster)
    mine, theirs = tmp_path / "mine.npz", tmp_path / "theirs.npz"
    mine.write_bytes(small_set(30, seed=1))
    theirs.write_bytes(small_set(40, seed=2))

    def person(role: str, subject: str) -> Client:
        return Client(cluster.address, security=material.client(material.token(role, subject)))

    alice, bob, root_user = (
        person("writer", "alice"),
        person("writer", "bob"),
        person("admin", "ops"),
    )
    try:
        stored = await alice.put_dataset(mine, name="d")
        before = listing(root)

        # Act: bob replaces it
        with pytest.raises(NeuroshardError) as denied:
            await bob.put_dataset(theirs, name="d", replace=True)
        after_denied = listing(root)
        listed_by_bob = await bob.list_datasets()
        # alice may, and so may an admin (who then owns it)
        await alice.put_dataset(theirs, name="d", replace=True)
        by_admin = await root_user.put_dataset(mine, name="d", replace=True)
        with pytest.raises(NeuroshardError) as alice_now:
            await alice.put_dataset(theirs, name="d", replace=True)
    finally:
        for c in (alice, bob, root_user):
            await c.close()

    # Assert
    assert stored["owner"] == "alice"
    assert sorted(before) == [".d.npz.owner", "d.npz"]
    assert denied.value.code is grpc.StatusCode.PERMISSION_DENIED
    assert str(denied.value) == (
        "d.npz belongs to 'alice'; only its owner or an admin may replace it, not 'bob'"
    )
    assert after_denied == before  # same bytes, same owner, no temporary file
    assert [(e["path"], e["owner"]) for e in listed_by_bob] == [("d.npz", "alice")]
    assert by_admin["owner"] == "ops"
    assert alice_now.value.code is grpc.StatusCode.PERMISSION_DENIED
    assert (root / "d.npz").read_bytes() == mine.read_bytes()
    assert sorted(os.listdir(root)) == [".d.npz.owner", "d.npz"]


async def test_a_data_set_put_there_by_the_operator_is_only_an_admins_to_replace(
    secure, material: Material, tmp_path: Path
) -> None:
    cluster = await secure(workers=0)
    root = root_of(cluster)
    root.mkdir(parents=True, exist_ok=True)
    (root / "ops.npz").write_bytes(small_set())
    src = tmp_path / "new.npz"
    src.write_bytes(small_set(40))
    writer = Client(cluster.address, security=material.client(material.token("writer", "w")))

    try:
        with pytest.raises(NeuroshardError) as denied:
            await writer.put_dataset(src, name="ops", replace=True)
        listed = await writer.list_datasets()
    finally:
        await writer.close()

    assert denied.value.code is grpc.StatusCode.PERMISSION_DENIED
    assert "ops.npz has no recorded owner; only its owner or an admin" in str(denied.value)
    assert (root / "ops.npz").read_bytes() == small_set()
    assert [(e["path"], e["owner"]) for e in listed] == [("ops.npz", "")]
