"""``DistributedLearner`` and paced train jobs through real daemons (issue 24, item 2).

Three ``run_epoch`` calls are epochs 0, 1, 2 of one job whose model and optimizer state
persist: its losses and final model equal a plain 3-epoch job's with the same seed; close ends
it SUCCEEDED; a coordinator restart between epochs resumes it at the boundary; refusals name
the field; only the job's owner (or admin) grants its epochs.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from shared.client import Client, DistributedLearner, NeuroshardError
from tests.conftest import InProcessCluster, wait_until
from tests.integration.security_helpers import Material
from tests.integration.test_durability import crash_coordinator, restart_coordinator
from tests.integration.test_memory_job_resume import _Unwritable

pytestmark = pytest.mark.integration

SEED = 3
# the learner's spec keys and the plain job's: digits (1437 training rows), 12 steps an epoch
COMMON: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [32]},
    "data": "digits",
    "batch_size": 64,
    "seed": SEED,
}
TRAIN_ROWS = 1437


def _learner(address: str, nodes: int = 2, **kw: Any) -> DistributedLearner:
    args: dict[str, Any] = dict(
        num_nodes=nodes,
        memory_capacity=10_000,
        decay_rate=0.01,
        spec={"batch_size": 64, "seed": SEED},
        model=COMMON["model"],
        timeout_s=60.0,
    )
    return DistributedLearner(address, **(args | kw))


@dataclass
class Plain:
    """A plain job's result document and final model's state dict."""

    result: dict[str, Any]
    model: dict[str, torch.Tensor]


async def _plain(
    cluster: InProcessCluster, epochs: int, workers: int, tmp: Path, strategy: str = "sync"
) -> Plain:
    """A plain (not paced) job of COMMON, run to its end."""
    spec = {"kind": "train", "workers": workers, "epochs": epochs, "strategy": strategy}
    async with cluster.client() as c:
        job = await c.submit(spec | COMMON)
        final = await c.wait(job.job_id)
        assert final.state == "SUCCEEDED", final.error
        await c.get_model(job.job_id, tmp / "plain.pt")
    assert final.result is not None
    return Plain(final.result, torch.load(tmp / "plain.pt", weights_only=True))


@pytest.mark.parametrize("strategy", ["sync", "diloco", "allreduce"])
async def test_three_epochs_are_one_job_equal_to_a_plain_one(
    make_cluster, tmp_path: Path, strategy: str
):
    # Arrange
    cluster = await make_cluster(workers=2)
    learner = await asyncio.to_thread(_learner, cluster.address, strategy=strategy)

    # Act: three epochs, then close
    figures = [await asyncio.to_thread(learner.run_epoch) for _ in range(3)]
    final = await asyncio.to_thread(learner.close)
    plain = await _plain(cluster, 3, 2, tmp_path, strategy)
    history, plain_model = plain.result["history"], plain.model
    async with cluster.client() as c:
        await c.get_model(learner.job_id, tmp_path / "learner.pt")
    model = torch.load(tmp_path / "learner.pt", weights_only=True)

    # Assert: epochs 0, 1, 2 of one job; the losses and weights of a plain 3-epoch job
    assert learner.train_rows == TRAIN_ROWS
    assert [f["epoch"] for f in figures] == [0, 1, 2]
    for f, h in zip(figures, history, strict=True):
        assert f["loss"] == pytest.approx(h["train_loss"], abs=1e-5)
        assert f["initial_loss"] == pytest.approx(history[0]["initial_loss"], abs=1e-5)
        assert f["convergence"] == pytest.approx(f["initial_loss"] / f["loss"], rel=1e-9)
        assert f["iteration_ms_p50"] > 0 and f["iteration_ms_std"] >= 0
        assert f["wire_bytes"] > 0 and f["wire_mbit_s"] > 0
        assert f["failures"] == 0 and f["quality"] is None
    assert figures[0]["initial_loss"] > 2.0  # ln(10) at initialisation, about
    assert figures[2]["convergence"] > 1.0
    # Prometheus: neuroshard_convergence_ratio{job_id} holds the last epoch's
    gauge = cluster.coordinator.metrics.convergence_ratio.labels(learner.job_id)._value.get()
    assert gauge == pytest.approx(figures[2]["convergence"], rel=1e-9)
    assert final is not None and final.state == "SUCCEEDED", final and final.error
    assert final.result["epochs"] == 3 and final.result["steps"] == plain.result["steps"]
    assert model.keys() == plain_model.keys()
    for name, tensor in model.items():
        torch.testing.assert_close(tensor, plain_model[name], atol=1e-5, rtol=0)


async def test_a_prioritized_learner_reports_its_priority_tables_quality(make_cluster):
    # Arrange
    cluster = await make_cluster(workers=2)
    learner = await asyncio.to_thread(_learner, cluster.address, sampling="prioritized")

    # Act
    figures = [await asyncio.to_thread(learner.run_epoch) for _ in range(2)]
    final = await asyncio.to_thread(learner.close)

    # Assert: one memory per training row, strengths in [0, 1], 10 bins
    for f in figures:
        q = f["quality"]
        assert q is not None and q["count"] == TRAIN_ROWS
        assert 0.0 <= q["min"] <= q["mean"] <= q["max"] <= 1.0
        assert len(q["histogram"]) == 10 and sum(q["histogram"]) == TRAIN_ROWS
    assert final is not None and final.state == "SUCCEEDED", final and final.error
    assert final.spec["sampling"]["decay_rate"] == 0.01


async def test_a_coordinator_restart_between_epochs_resumes_the_job(
    make_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # Arrange: one epoch run
    cluster = await make_cluster(workers=1)
    learner = await asyncio.to_thread(_learner, cluster.address, 1)
    first = await asyncio.to_thread(learner.run_epoch)

    # Act: crash the coordinator (it writes nothing more), start another on the same address
    # and data dir, run the next epoch
    state = cluster.coordinator.cluster.state
    monkeypatch.setattr(state, "_db", _Unwritable(state._db))
    await crash_coordinator(cluster)
    await restart_coordinator(cluster, str(tmp_path / "coord"))
    second = await asyncio.to_thread(learner.run_epoch)
    final = await asyncio.to_thread(learner.close)
    history = (await _plain(cluster, 2, 1, tmp_path)).result["history"]

    # Assert: epoch 1 went on from epoch 0's checkpoint, as in one uninterrupted job
    assert (first["epoch"], second["epoch"]) == (0, 1)
    assert final is not None and final.state == "SUCCEEDED", final and final.error
    assert final.result["resumed_from_step"] == 23  # epoch 0: ceil(1437 / 64) steps
    assert [first["loss"], second["loss"]] == pytest.approx(
        [h["train_loss"] for h in history], abs=1e-5
    )
    assert second["initial_loss"] == pytest.approx(first["initial_loss"], abs=1e-9)


async def test_an_unreachable_coordinator_is_named_after_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(NeuroshardError) as exc:
        await asyncio.to_thread(_learner, "127.0.0.1:1", timeout_s=1.0)
    assert exc.value.code is grpc.StatusCode.UNAVAILABLE
    assert "cannot reach the coordinator at 127.0.0.1:1 within 1 s" in str(exc.value)
    assert time.monotonic() - t0 >= 1.0


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"num_nodes": 0}, "num_nodes"),
        ({"decay_rate": 1.5}, "decay_rate"),
        ({"memory_capacity": 0}, "memory_capacity"),
        ({"strategy": "gossip"}, "strategy"),
        ({"spec": {"batch_size": 0}}, "batch_size"),
        ({"spec": {"steps": 10}}, "paced"),
        ({"sampling": {"name": "prioritized", "decay_rate": 0.5}}, "sampling.decay_rate"),
    ],
)
async def test_refusals_name_the_field(make_cluster, kw: dict[str, Any], field: str):
    cluster = await make_cluster(workers=0)
    with pytest.raises(NeuroshardError) as exc:
        await asyncio.to_thread(_learner, cluster.address, **kw)
    assert exc.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert str(exc.value).startswith(field) or f"{field}:" in str(exc.value), str(exc.value)
    assert cluster.coordinator.cluster.jobs.list() == []  # nothing queued


async def test_a_memory_capacity_below_the_training_rows_is_refused(make_cluster):
    cluster = await make_cluster(workers=1)
    with pytest.raises(NeuroshardError) as exc:
        await asyncio.to_thread(_learner, cluster.address, 1, memory_capacity=1000)
    assert exc.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert str(exc.value).startswith(
        f"memory_capacity: 1000 is less than the data set's {TRAIN_ROWS}"
    )
    (job,) = cluster.coordinator.cluster.jobs.list()
    await wait_until(lambda: job.state.value == "CANCELLED", what="the job cancelled")


async def test_gpu_enabled_without_a_cuda_worker_is_refused(make_cluster):
    cluster = await make_cluster(workers=1)
    with pytest.raises(NeuroshardError) as exc:
        await asyncio.to_thread(_learner, cluster.address, 1, gpu_enabled=True)
    assert exc.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert str(exc.value).startswith(
        "gpu_enabled: True needs 1 workers training on CUDA (num_nodes), but 0 of the 1 ALIVE"
    )
    assert "worker-0 cpu" in str(exc.value)
    assert cluster.coordinator.cluster.jobs.list() == []


async def test_grants_past_the_epochs_or_to_a_plain_job_are_refused(make_cluster):
    cluster = await make_cluster(workers=0)  # the jobs stay QUEUED: grants are kept all the same
    async with cluster.client() as c:
        paced = await c.submit({"kind": "train", "epochs": 2, "paced": True, **COMMON})
        plain = await c.submit({"kind": "train", "epochs": 2, **COMMON})
        codes = {}
        for name, call in {
            "zero": c.run_epochs(paced.job_id, 0),
            "plain": c.run_epochs(plain.job_id, 1),
            "finish plain": c.finish(plain.job_id),
            "past": c.run_epochs(paced.job_id, 3),
        }.items():
            with pytest.raises(NeuroshardError) as exc:
                await call
            codes[name] = (exc.value.code, str(exc.value))
        granted = await c.run_epochs(paced.job_id, 2)
    assert codes["zero"] == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "epochs: must be at least 1, got 0",
    )
    assert codes["plain"][0] is grpc.StatusCode.FAILED_PRECONDITION
    assert codes["finish plain"][0] is grpc.StatusCode.FAILED_PRECONDITION
    assert "is not paced" in codes["plain"][1]
    assert codes["past"][0] is grpc.StatusCode.FAILED_PRECONDITION
    assert codes["past"][1].startswith("epochs: job ")
    assert granted == 2


async def test_only_the_owner_grants_epochs(secure, material: Material):
    # Arrange: alice's paced job (QUEUED: no worker)
    cluster = await secure(workers=0)
    alice = material.client(material.token("writer", "alice"))
    async with Client(cluster.address, security=alice) as a:
        job = await a.submit({"kind": "train", "epochs": 5, "paced": True, **COMMON})
    record = cluster.coordinator.cluster.jobs.get(job.job_id)
    before = (record.epochs_granted, record.finish_requested, record.version)

    # Act: a reader, another writer, then alice
    outcomes = {}
    for who, token in {
        "reader": material.token("reader", "rita"),
        "bob": material.token("writer", "bob"),
    }.items():
        async with Client(cluster.address, security=material.client(token)) as other:
            for what, call in {
                "grant": other.run_epochs(job.job_id, 1),
                "finish": other.finish(job.job_id),
            }.items():
                with pytest.raises(NeuroshardError) as exc:
                    await call
                outcomes[who, what] = exc.value.code
    after = (record.epochs_granted, record.finish_requested, record.version)
    async with Client(cluster.address, security=alice) as a:
        granted = await a.run_epochs(job.job_id, 1)

    # Assert: refused with nothing changed; the owner may
    assert outcomes == {
        ("reader", "grant"): grpc.StatusCode.PERMISSION_DENIED,
        ("reader", "finish"): grpc.StatusCode.PERMISSION_DENIED,
        ("bob", "grant"): grpc.StatusCode.NOT_FOUND,
        ("bob", "finish"): grpc.StatusCode.NOT_FOUND,
    }
    assert after == before
    assert granted == 1
