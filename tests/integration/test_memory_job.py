"""The ``memory`` job on an in-process cluster: result document, equality with a replay on
the single-process reference, trace files, and files refused up front."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from coordinator.memory.access_stream import ScrambledZipfStream, generate_memories
from shared.client import NeuroshardError
from shared.rpc.limits import request_items
from tests.integration.memory_helpers import assert_cluster_equals
from tests.memory_reference import ReferenceStore

pytestmark = pytest.mark.integration

SLOTS = 64


async def _run(cluster: Any, spec: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    """Submit a job, follow it to the end; return the final job and every progress event."""
    events = []
    async with cluster.client() as client:
        job = await client.submit(spec)
        async for _, progress in client.watch(job.job_id):
            events.append(progress)
        return await client.get_job(job.job_id), events


def _assert_topk_matches(result: dict[str, Any], ref: ReferenceStore) -> None:
    ref_ids, ref_s = ref.topk(result["topk_k"])
    shown = result["topk"]
    assert [t["id"] for t in shown] == ref_ids[: len(shown)].tolist()
    assert [t["strength"] for t in shown] == ref_s[: len(shown)].tolist()


async def test_zipf_job_equals_reference_replay(make_cluster) -> None:
    cluster = await make_cluster(workers=3, slots=SLOTS)
    spec = {
        "kind": "memory",
        "workers": 3,
        "memories": 20_000,
        "iterations": 5,
        "seed": 3,
        "access": {"distribution": "zipf", "alpha": 0.99, "batch": 5_000, "boost": 0.05},
        "decay_rate": 0.01,
        "topk": 50,
    }

    job, events = await _run(cluster, spec)

    assert job.state == "SUCCEEDED", job.error
    r = job.result
    assert r["iterations"] == 5 and r["memories"] == 20_000 and r["accesses"] == 25_000
    assert 0 < r["iteration_ms_p50"] <= r["iteration_ms_p99"]
    assert r["load_s"] > 0 and r["upserts_per_s"] > 0 and r["reinforces_per_s"] > 0
    assert set(r["phase_ms_p50"]) == {"reinforce", "sweep", "convergence"}
    assert r["iteration_ms_std"] >= 0
    assert r["topk_k"] == 50 and len(r["topk"]) == 10
    last = events[-1]
    assert last["iteration"] == last["iterations"] == 5 and last["iteration_ms"] > 0
    assert last["quality"] == r["quality"] and last["convergence"] == r["convergence"]
    # Replay the same operations on the reference: same seed, same streams, same order.
    ref = ReferenceStore(slots=SLOTS)
    ids, strengths = generate_memories(20_000, seed=3)
    ref.upsert(ids, strengths)
    stream = ScrambledZipfStream(np.unique(ids), 0.99, 5_000, seed=3)
    boosts = np.full(5_000, 0.05, np.float32)
    for i in range(5):
        accessed = stream.next_batch(i)
        ref.reinforce(accessed, boosts)
        ref.decay(0.01)
    _assert_topk_matches(r, ref)
    rq = ref.quality()
    # Convergence: the last iteration's distinct accessed ids' mean strength over the table's.
    _, accessed_s, _ = ref.get(np.unique(accessed))
    want = float(np.mean(accessed_s, dtype=np.float64)) / rq.mean
    assert r["convergence"] == pytest.approx(want, rel=1e-9) and r["convergence"] > 1
    gauge = cluster.coordinator.metrics.convergence_ratio.labels(job.job_id)._value.get()
    assert gauge == r["convergence"]
    assert r["quality"]["count"] == rq.count and r["quality"]["histogram"] == list(rq.histogram)
    assert (r["quality"]["min"], r["quality"]["max"]) == (rq.min, rq.max)
    await assert_cluster_equals(cluster, ref)


async def test_loaded_memories_and_trace_file(make_cluster, tmp_path: Path) -> None:
    cluster = await make_cluster(workers=2, slots=SLOTS, data_roots=[str(tmp_path)])
    rng = np.random.default_rng(5)
    ids = rng.choice(1 << 40, size=3_000, replace=False).astype(np.uint64)
    strengths = rng.random(3_000, dtype=np.float32)
    np.savez(tmp_path / "mem.npz", ids=ids, strengths=strengths)
    # Three rows of accesses, with repeats and a few ids that are not stored.
    trace = np.concatenate([rng.choice(ids, size=(3, 900)), np.full((3, 100), 7, np.uint64)], 1)
    np.save(tmp_path / "trace.npy", trace)
    spec = {
        "kind": "memory",
        "workers": 2,
        "load": str(tmp_path / "mem.npz"),
        "iterations": 3,
        "access": {"trace": str(tmp_path / "trace.npy"), "boost": 0.1},
        "decay_rate": 0.02,
        "topk": 20,
    }

    job, _ = await _run(cluster, spec)

    assert job.state == "SUCCEEDED", job.error
    r = job.result
    assert r["memories"] == 3_000 and r["accesses"] == 3_000 and r["reinforce_hits"] == 2_700
    ref = ReferenceStore(slots=SLOTS)
    ref.upsert(ids, strengths)
    for row in trace:
        ref.reinforce(row, np.full(len(row), 0.1, np.float32))
        ref.decay(0.02)
    _assert_topk_matches(r, ref)
    await assert_cluster_equals(cluster, ref)


async def test_bad_files_fail_the_job_before_loading(make_cluster, tmp_path: Path) -> None:
    cluster = await make_cluster(workers=1, slots=SLOTS, data_roots=[str(tmp_path)])
    bad_trace = np.arange(30, dtype=np.int64).reshape(3, 10)
    bad_trace[1, 2] = -5
    np.save(tmp_path / "neg.npy", bad_trace)
    np.save(tmp_path / "short.npy", np.arange(20, dtype=np.uint64).reshape(2, 10))
    np.savez(tmp_path / "mem.npz", ids=np.arange(3), values=np.ones(3))
    base = {"kind": "memory", "workers": 1, "memories": 100, "iterations": 3}
    cases = [
        (
            {"access": {"trace": str(tmp_path / "neg.npy")}},
            f"{tmp_path / 'neg.npy'}: trace[1, 2]: -5 is negative; ids are uint64",
        ),
        (
            {"access": {"trace": str(tmp_path / "short.npy")}},
            f"{tmp_path / 'short.npy'}: trace has 2 rows but the job runs 3 iterations",
        ),
        (
            {"load": str(tmp_path / "mem.npz")},
            f"{tmp_path / 'mem.npz'}: no array 'strengths' (has: ids, values)",
        ),
    ]
    for extra, reason in cases:
        job, _ = await _run(cluster, base | extra)
        assert (job.state, job.error) == ("FAILED", reason)
    async with cluster.client() as client:
        assert (await client.quality())["count"] == 0


async def test_missing_files_and_big_topk_are_refused_at_submission(
    make_cluster, tmp_path: Path
) -> None:
    cluster = await make_cluster(workers=1, slots=SLOTS, data_roots=[str(tmp_path)])
    base = {"kind": "memory", "workers": 1, "memories": 100, "iterations": 3}
    cases = [
        (
            {"access": {"trace": "missing.npy"}},
            "access.trace: no file 'missing.npy' in the coordinator's data roots",
        ),
        ({"topk": 20_000}, "topk: 20000 exceeds the coordinator's topk_max 10000"),
    ]
    async with cluster.client() as client:
        for extra, reason in cases:
            with pytest.raises(NeuroshardError) as err:
                await client.submit(base | extra)
            assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert str(err.value).endswith(reason)
        assert await client.jobs() == []


@pytest.mark.parametrize(
    ("limits", "memories", "chunk"),
    [
        # A hot id holds about a third of the batch: one slot's part is larger than a worker
        # takes, which the router cannot cut (it keeps a slot's items together).
        ({"max_batch_items": 1_000}, 10, 1_000),
        # One memory, one slot: the whole batch (1.2 MB) would be one message over 1 MiB.
        ({"max_message_bytes": 1 << 20}, 1, None),
    ],
)
async def test_an_access_batch_is_sent_in_requests_the_workers_take(
    make_cluster, limits: dict[str, int], memories: int, chunk: int | None
) -> None:
    batch = 5_000 if chunk else 100_000
    worker_limits = {"max_batch_items": limits.get("max_batch_items", 1 << 20)}
    cluster = await make_cluster(workers=2, slots=SLOTS, worker_overrides=worker_limits, **limits)
    spec = {
        "kind": "memory",
        "workers": 2,
        "memories": memories,
        "iterations": 3,
        "seed": 5,
        "access": {"distribution": "zipf", "alpha": 0.99, "batch": batch, "boost": 0.0001},
        "decay_rate": 0.001,
        "topk": 10,
    }

    job, _ = await _run(cluster, spec)

    assert job.state == "SUCCEEDED", job.error
    assert job.result["accesses"] == 3 * batch
    # The reference applies the same requests: the router cut the batch in chunks, in order
    # (one slot holds more accesses than a request may carry).
    step = chunk or request_items(1 << 20, 1 << 20, item_bytes=12)
    assert step < batch
    ref = ReferenceStore(slots=SLOTS)
    ids, strengths = generate_memories(memories, seed=5)
    ref.upsert(ids, strengths)
    stream = ScrambledZipfStream(np.unique(ids), 0.99, batch, seed=5)
    boosts = np.full(batch, 0.0001, np.float32)
    for i in range(3):
        accessed = stream.next_batch(i)
        for start in range(0, batch, step):
            ref.reinforce(accessed[start : start + step], boosts[start : start + step])
        ref.decay(0.001)
    await assert_cluster_equals(cluster, ref)
