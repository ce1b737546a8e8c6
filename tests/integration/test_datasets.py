"""Data sets over gRPC: ``put`` stores, refuses and leaves nothing behind, ``ls`` lists, and a
train job on an uploaded set runs on workers that only get their rows over FetchShard."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import grpc
import numpy as np
import pytest

from shared.client import NeuroshardError
from shared.proto import coordinator_pb2, coordinator_pb2_grpc
from shared.rpc import channel
from shared.rpc.codec import read_header_and_tensors
from tests.conftest import wait_until

pytestmark = pytest.mark.integration


def blobs(n: int = 600, features: int = 8, classes: int = 3, seed: int = 0) -> dict:
    """A learnable training set: Gaussian blobs, x [n, features] float32, y [n] int64."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 3.0, size=(classes, features))
    y = np.arange(n, dtype=np.int64) % classes
    x = (centres[y] + rng.normal(size=(n, features))).astype(np.float32)
    return {"x": x, "y": y}


def write_npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


def tree(path: Path) -> list[Path]:
    """Every file and directory under ``path``."""
    return sorted(path.rglob("*"))


def root_of(cluster) -> Path:
    return cluster.coordinator.cfg.dataset_roots()[0]


def fetches(cluster, code: str = "OK") -> float:
    """FetchShard calls the coordinator answered with ``code``.

    A worker holds a shard with two: its header, then the rows its shard cache lacks.
    """
    return cluster.coordinator.metrics.rpcs.labels("FetchShard", code)._value.get()


async def test_put_stores_the_file_and_ls_lists_it(make_cluster, tmp_path: Path) -> None:
    cluster = await make_cluster(workers=0)
    src = write_npz(tmp_path / "blobs.npz", **blobs())
    sent: list[int] = []

    async with cluster.client() as client:
        info = await client.put_dataset(src, progress=sent.append)
        listed = await client.list_datasets()

    assert info["name"] == "blobs" and info["path"] == "blobs.npz" and info["kind"] == "train"
    assert info["bytes"] == src.stat().st_size == sum(sent)
    assert info["arrays"] == [
        {"name": "x", "dtype": "float32", "shape": [600, 8]},
        {"name": "y", "dtype": "int64", "shape": [600]},
    ]
    assert (root_of(cluster) / "blobs.npz").read_bytes() == src.read_bytes()
    assert [(e["path"], e["bytes"], e["root"]) for e in listed] == [("blobs.npz", info["bytes"], 0)]


async def test_an_upload_in_tiny_chunks_stores_every_byte_once(
    make_cluster, tmp_path: Path
) -> None:
    # Arrange: ~25 KB in chunks of 1000 bytes (issue 20 #4: a dropped or repeated chunk fails)
    cluster = await make_cluster(workers=0)
    src = write_npz(tmp_path / "blobs.npz", **blobs())
    size = src.stat().st_size
    sent: list[int] = []

    # Act
    async with cluster.client() as client:
        info = await client.put_dataset(src, progress=sent.append, chunk_bytes=1000)

    # Assert
    assert sent == [1000] * (size // 1000) + ([size % 1000] if size % 1000 else [])
    assert info["bytes"] == size and len(sent) >= 20
    assert info["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert (root_of(cluster) / "blobs.npz").read_bytes() == src.read_bytes()


async def test_a_file_over_the_cap_is_refused_and_nothing_is_left(
    make_cluster, tmp_path: Path
) -> None:
    cluster = await make_cluster(workers=0, max_dataset_bytes=4096)
    src = write_npz(tmp_path / "big.npz", **blobs(n=300))
    size = src.stat().st_size

    async with cluster.client() as client:
        with pytest.raises(NeuroshardError) as err:
            await client.put_dataset(src)
        listed = await client.list_datasets()

    assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"big.npz: {size} bytes exceed the coordinator's max_dataset_bytes 4096" in str(
        err.value
    )
    assert listed == []
    assert not root_of(cluster).exists() or os.listdir(root_of(cluster)) == []


async def test_bytes_beyond_the_declared_size_are_refused_as_they_arrive(make_cluster) -> None:
    cluster = await make_cluster(workers=0, max_dataset_bytes=4096)

    async with channel(cluster.address) as ch:
        call = coordinator_pb2_grpc.CoordinatorStub(ch).PutDataset(timeout=10)
        header = coordinator_pb2.DatasetHeader(name="liar", total_bytes=1000)
        await call.write(coordinator_pb2.DatasetChunk(header=header))
        accepted = await call.read()
        for _ in range(2):  # 2000 bytes where 1000 were declared
            await call.write(coordinator_pb2.DatasetChunk(data=b"\0" * 1000))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()

    assert accepted.HasField("accepted")
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "liar.npz: more bytes than the 1000 declared" in err.value.details()
    assert os.listdir(root_of(cluster)) == []


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x": np.zeros((5, 2), np.complex128), "y": np.arange(5)}, "array 'x' has dtype"),
        ({"obj": np.array([{"pickle": 1}], dtype=object)}, "holds Python objects"),
        ({"z": np.zeros(3)}, "expected arrays x and y"),
    ],
)
async def test_an_invalid_data_set_is_refused_and_nothing_is_kept(
    make_cluster, tmp_path: Path, arrays: dict, message: str
) -> None:
    cluster = await make_cluster(workers=0)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    src = tmp_path / "bad.npz"
    src.write_bytes(buf.getvalue())

    async with cluster.client() as client:
        with pytest.raises(NeuroshardError) as err:
            await client.put_dataset(src)

    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert str(err.value).startswith("bad.npz: ") and message in str(err.value)
    assert os.listdir(root_of(cluster)) == []


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", ".hidden", "x" * 129])
async def test_a_bad_name_is_refused_and_nothing_is_created(
    make_cluster, tmp_path: Path, name: str
) -> None:
    cluster = await make_cluster(workers=0)
    src = write_npz(tmp_path / "ok.npz", **blobs(n=30))
    before = tree(tmp_path)

    async with cluster.client() as client:
        with pytest.raises(NeuroshardError) as err:
            await client.put_dataset(src, name=name)

    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert str(err.value).startswith("name: ")
    assert not root_of(cluster).exists()
    assert tree(tmp_path) == before


async def test_an_existing_name_needs_replace(make_cluster, tmp_path: Path) -> None:
    cluster = await make_cluster(workers=0)
    first = write_npz(tmp_path / "first.npz", **blobs(n=30))
    second = write_npz(tmp_path / "second.npz", **blobs(n=60))

    async with cluster.client() as client:
        await client.put_dataset(first, name="d")
        with pytest.raises(NeuroshardError) as err:
            await client.put_dataset(second, name="d")
        kept = (root_of(cluster) / "d.npz").read_bytes()  # noqa: ASYNC240 (a test)
        replaced = await client.put_dataset(second, name="d", replace=True)

    assert err.value.code is grpc.StatusCode.ALREADY_EXISTS
    assert "d.npz exists" in str(err.value)
    assert kept == first.read_bytes()
    assert replaced["arrays"][1]["shape"] == [60]
    assert (root_of(cluster) / "d.npz").read_bytes() == second.read_bytes()
    assert os.listdir(root_of(cluster)) == ["d.npz"]


async def test_ls_lists_every_root_and_no_symlink_out_of_one(make_cluster, tmp_path: Path) -> None:
    first, second, outside = tmp_path / "r0", tmp_path / "r1", tmp_path / "outside"
    for d in (first / "sub", second, outside):
        d.mkdir(parents=True)
    (first / "sub" / "trace.npy").write_bytes(b"123")
    (second / "m.npz").write_bytes(b"12")
    (outside / "secret.npz").write_bytes(b"secret")
    (first / "leak.npz").symlink_to(outside / "secret.npz")
    cluster = await make_cluster(workers=0, data_roots=[str(first), str(second)])

    async with cluster.client() as client:
        listed = await client.list_datasets()

    assert [(e["path"], e["bytes"], e["root"]) for e in listed] == [
        ("sub/trace.npy", 3, 0),
        ("m.npz", 2, 1),
    ]


async def _submit_on_uploaded_set(cluster, tmp_path: Path, **spec: object):
    (tmp_path / "src").mkdir(exist_ok=True)
    src = write_npz(tmp_path / "src" / "blobs.npz", **blobs())
    job_spec = {
        "kind": "train",
        "workers": 2,
        "data": {"path": "blobs.npz"},
        "batch_size": 32,
        "optimizer": {"name": "adam", "lr": 0.01},
        "seed": 0,
    } | spec
    client = cluster.client()
    await client.put_dataset(src)
    return client, await client.submit(job_spec)


async def test_workers_train_on_an_uploaded_set_fetching_their_shards(
    make_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = await make_cluster(workers=2)
    # Nothing a worker could open: its cwd is empty and its data dir is its own.
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")

    client, job = await _submit_on_uploaded_set(cluster, tmp_path, epochs=3)
    final = await client.wait(job.job_id)
    await client.close()

    assert final.state == "SUCCEEDED", final.error
    assert final.result["test_accuracy"] >= 0.9  # the rows arrived intact and in order
    assert set(final.result["workers"]) == {"worker-0", "worker-1"}
    assert tree(Path(".")) == []  # no copy of the data set where the workers run
    assert not [p for w in ("worker-0", "worker-1") for p in tree(tmp_path / w) if "npz" in p.name]
    assert fetches(cluster) == 4  # one shard each, header and rows, over the wire
    assert job.job_id not in cluster.coordinator.cluster.train_sets  # its rows dropped at end


async def test_a_survivor_fetches_the_shard_of_a_failed_worker(
    make_cluster, tmp_path: Path
) -> None:
    cluster = await make_cluster(workers=2)
    client, job = await _submit_on_uploaded_set(cluster, tmp_path, steps=300, batch_size=8)
    record = cluster.coordinator.cluster.jobs.get(job.job_id)
    await wait_until(lambda: record.progress.get("step", 0) >= 3, what="a few steps")

    async def broken(*_args: object) -> None:
        raise RuntimeError("worker-1 broke")

    sessions = cluster.workers[1].sessions  # fails every step and every re-join from now on
    sessions.compute = sessions.start = broken  # type: ignore[method-assign]
    final = await client.wait(job.job_id)
    await client.close()

    assert final.state == "SUCCEEDED", final.error
    assert final.result["worker_failures"] == 1
    assert final.result["workers"]["worker-0"]["steps"] == 300
    assert fetches(cluster) == 6  # a shard each at the start, then worker-1's by worker-0


async def test_shards_fetched_in_tiny_chunks_hold_every_training_row_once(
    make_cluster, tmp_path: Path
) -> None:
    # Arrange: FetchShard streams in 1 KiB chunks (x: 32 rows a chunk, y: 128) (issue 20 #4)
    cluster = await make_cluster(workers=2, chunk_bytes=1024)
    client, job = await _submit_on_uploaded_set(cluster, tmp_path, steps=100_000)
    record = cluster.coordinator.cluster.jobs.get(job.job_id)
    await wait_until(lambda: record.progress.get("step", 0) >= 1, what="the job to run")
    source = blobs()
    rows = {x.tobytes(): int(y) for x, y in zip(source["x"], source["y"], strict=True)}

    # Act: fetch both shards as the job's workers would
    chunks, shards = [], []
    async with channel(cluster.address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        for index, worker in enumerate(record.workers):
            request = coordinator_pb2.FetchShardRequest(
                job_id=job.job_id, shard_index=index, shard_count=2, worker=worker
            )
            msgs = [m async for m in stub.FetchShard(request, timeout=10)]
            chunks += [m.rows for m in msgs if m.HasField("rows")]
            shards.append(await read_header_and_tensors(_aiter(msgs), "header", "rows"))
    await client.cancel(job.job_id)
    await client.wait(job.job_id)
    await client.close()

    # Assert: the shards tile the training rows, each row once and as in the file
    (h0, t0), (h1, t1) = shards
    assert (h0.start, h0.stop, h1.start, h1.stop) == (0, h0.stop, h0.stop, h0.n_train)
    x = np.concatenate([t0["x"], t1["x"]])
    y = np.concatenate([t0["y"], t1["y"]])
    assert len(x) == len(y) == h0.n_train > 400
    assert len({r.tobytes() for r in x}) == len(x)  # no row twice
    assert all(rows.get(r.tobytes()) == int(label) for r, label in zip(x, y, strict=True))
    assert len(chunks) >= h0.n_train * 32 // 1024 and max(len(c.data) for c in chunks) == 1024


async def _aiter(items):
    for item in items:
        yield item


async def test_fetch_shard_is_refused_to_a_worker_outside_the_job(
    make_cluster, tmp_path: Path
) -> None:
    cluster = await make_cluster(workers=2)
    client, job = await _submit_on_uploaded_set(cluster, tmp_path, workers=1, steps=100_000)
    record = cluster.coordinator.cluster.jobs.get(job.job_id)
    await wait_until(lambda: record.progress.get("step", 0) >= 1, what="the job to run")
    outsider = ({"worker-0", "worker-1"} - set(record.workers)).pop()

    async def fetch(job_id: str, worker: str) -> grpc.aio.AioRpcError:
        request = coordinator_pb2.FetchShardRequest(
            job_id=job_id, shard_index=0, shard_count=1, worker=worker
        )
        async with channel(cluster.address) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.FetchShard(request, timeout=10):
                    pass
        return err.value

    denied = await fetch(job.job_id, outsider)
    unknown = await fetch("train-nope", record.workers[0])
    await client.cancel(job.job_id)
    await client.wait(job.job_id)
    ended = await fetch(job.job_id, record.workers[0])
    await client.close()

    assert denied.code() is grpc.StatusCode.PERMISSION_DENIED
    assert f"worker {outsider!r} is not part of job" in denied.details()
    assert unknown.code() is grpc.StatusCode.NOT_FOUND
    assert ended.code() is grpc.StatusCode.NOT_FOUND  # the job's rows are dropped at its end
    assert fetches(cluster, "PERMISSION_DENIED") == 1


async def test_under_tls_and_tokens_writers_put_readers_list_and_workers_fetch(
    secure, material, tmp_path: Path
) -> None:
    from shared.client import Client
    from shared.security.tokens import AUD_DATA

    cluster = await secure(workers=2)

    def person(role: str) -> Client:
        return Client(cluster.address, security=material.client(material.token(role, f"a-{role}")))

    src = write_npz(tmp_path / "blobs.npz", **blobs())
    reader, writer = person("reader"), person("writer")
    with pytest.raises(NeuroshardError) as denied:
        await reader.put_dataset(src)
    await writer.put_dataset(src)
    listed = await reader.list_datasets()
    job = await writer.submit(
        {"kind": "train", "workers": 2, "data": {"path": "blobs.npz"}, "epochs": 2}
    )
    final = await writer.wait(job.job_id)
    await reader.close()
    await writer.close()

    assert denied.value.code is grpc.StatusCode.PERMISSION_DENIED
    assert [e["path"] for e in listed] == ["blobs.npz"]
    assert final.state == "SUCCEEDED", final.error
    assert fetches(cluster) == 4  # each worker by its own certificate, as itself

    # Only a worker's certificate fetches rows, and only as the name it carries.
    async def fetch(security, worker: str) -> grpc.aio.AioRpcError:
        request = coordinator_pb2.FetchShardRequest(
            job_id=job.job_id, shard_index=0, shard_count=2, worker=worker
        )
        async with channel(cluster.address, security=security) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.FetchShard(request, timeout=10):
                    pass
        return err.value

    as_other = await fetch(material.daemon_client("worker-0"), "worker-1")
    as_coordinator = await fetch(material.daemon_client(), "worker-0")
    as_writer = await fetch(material.client(material.token("writer", "a-writer")), "worker-0")
    data_token = material.token("writer", "a-writer", audience=AUD_DATA)
    as_data_plane = await fetch(material.client(data_token), "worker-0")
    as_nobody = await fetch(material.client(None), "worker-0")

    assert as_other.code() is grpc.StatusCode.PERMISSION_DENIED
    assert as_other.details() == (
        "FetchShard: worker 'worker-0' (by its certificate) may not act as worker 'worker-1'"
    )
    assert as_coordinator.code() is grpc.StatusCode.PERMISSION_DENIED
    assert as_coordinator.details() == "coordinator 'coordinator' may not call FetchShard"
    assert as_writer.code() is grpc.StatusCode.PERMISSION_DENIED
    assert as_writer.details() == "writer 'a-writer' may not call FetchShard"
    assert as_data_plane.code() is grpc.StatusCode.UNAUTHENTICATED
    assert as_data_plane.details().startswith("token is not for this daemon")
    assert as_nobody.code() is grpc.StatusCode.UNAUTHENTICATED
    assert as_nobody.details().startswith("missing bearer token")
    assert fetches(cluster) == 4  # none of them got a row
