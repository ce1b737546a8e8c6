"""Prioritized training (``sampling: prioritized``) through real daemons equals its reference.

A coordinator and workers serve in-process over gRPC (port 0); the job draws each step's rows
from its priority table in the cluster's memory store, the workers weight their losses and
return the per-sample losses, and the coordinator writes the strengths back and decays them
every epoch. The saved model, the rows drawn (their SHA-256), the running mean loss and the
table's mean strength at the end are compared with ``tests.prioritized_reference``, which does
the same draws with ``tests.memory_reference.ReferenceStore`` in one process.

The data set is a small synthetic one (200 samples, 160 training rows) so that an epoch ends
within the job: 10 steps of 16 rows per epoch on 1 worker, 5 on 2 (80-row shards), 4 on 3
(54/53/53: the last step's batches are 6/5/5 rows). The decay then runs mid-job.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from shared.client import NeuroshardError
from shared.config import TrainJobSpec
from shared.training.data import Dataset, load_dataset
from tests.conftest import wait_until
from tests.integration.test_durability import restart_coordinator
from tests.integration.test_failover import kill_abruptly
from tests.integration.test_training_equivalence import (
    GradientHold,
    assert_same_state,
    load_saved_model,
)
from tests.prioritized_reference import (
    Trace,
    train_prioritized_diloco_single_process,
    train_prioritized_single_process,
)

pytestmark = pytest.mark.integration

SLOTS = 64
STEPS = 12
TOLERANCE = 1e-5
SAMPLING = {
    "name": "prioritized",
    "alpha": 0.7,
    "beta": 0.4,
    "beta_final": 1.0,
    "decay_rate": 0.05,
    "priority": "loss",
}
FAST_FAILOVER = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0)


def job_spec(workers: int, **fields: Any) -> dict[str, Any]:
    """A prioritized sync MLP job of ``STEPS`` steps on the small synthetic set."""
    return {
        "kind": "train",
        "strategy": "sync",
        "workers": workers,
        "model": {"name": "mlp", "hidden": [16]},
        "data": {"name": "synthetic", "samples": 200, "features": 12, "classes": 4},
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "sampling": SAMPLING,
        "steps": STEPS,
        "batch_size": 16,
        "seed": 3,
    } | fields


def dataset_of(spec: TrainJobSpec) -> Dataset:
    return load_dataset(spec.data, spec.seed, spec.test_fraction)


def assert_matches(result: dict[str, Any], model: torch.nn.Module, trace: Trace) -> None:
    """The job's model, draws, running mean loss and table equal the reference's."""
    sampled = result["sampling"]
    assert sampled["rows_sha256"] == trace.digest.hexdigest()
    assert sampled["rows_drawn"] == trace.rows_drawn
    assert sampled["running_mean_loss"] == pytest.approx(trace.running_mean_loss, abs=TOLERANCE)
    quality = trace.table.quality()
    assert sampled["strength"]["count"] == quality.count
    assert sampled["strength"]["mean"] == pytest.approx(quality.mean, abs=TOLERANCE)
    assert_same_state(load_saved_model(result), model.state_dict())


async def assert_table_dropped(client, result: dict[str, Any]) -> None:
    names = [t["name"] for t in await client.list_tables()]
    assert result["sampling"]["table"] not in names


@pytest.mark.parametrize(
    ("workers", "policy"), [(1, "fixed"), (2, "fixed"), (3, "fixed"), (2, "proportional")]
)
async def test_sync_prioritized_job_equals_the_single_process_reference(
    make_cluster, workers: int, policy: str
) -> None:
    # Arrange: proportional cuts the same drawn rows by the workers' speeds instead.
    fields = job_spec(workers, batch_policy=policy)
    spec = TrainJobSpec.model_validate(fields)
    model, trace = train_prioritized_single_process(spec, dataset_of(spec), SLOTS)
    cluster = await make_cluster(workers=workers, slots=SLOTS)

    # Act
    async with cluster.client() as client:
        job = await client.submit(fields)
        histogram: list[int] = []
        async for _info, progress in client.watch(job.job_id):
            histogram = progress.get("histogram", histogram)
        final = await client.wait(job.job_id)

        # Assert
        assert final.state == "SUCCEEDED", final.error
        assert final.result["steps"] == STEPS
        assert_matches(final.result, model, trace)
        await assert_table_dropped(client, final.result)
        # the progress shows the table's strengths (10 bins, every training row) per epoch
        assert len(histogram) == 10 and sum(histogram) == trace.table.quality().count


async def test_sync_prioritized_job_with_a_worker_killed_mid_job_equals_the_reference(
    make_cluster,
) -> None:
    # Arrange: 3 workers (4 steps an epoch); worker-1 is killed while the coordinator waits
    # for its piece of global step 6 (epoch 1, step 2). Its pieces go to the survivors, and
    # its slots of the priority table to their replicas.
    fields = job_spec(3)
    spec = TrainJobSpec.model_validate(fields)
    model, trace = train_prioritized_single_process(spec, dataset_of(spec), SLOTS)
    cluster = await make_cluster(workers=3, slots=SLOTS, **FAST_FAILOVER)
    victim = cluster.workers[1]
    hold = GradientHold(victim, epoch=1, step_in_epoch=2)

    async with cluster.client() as client:
        job = await client.submit(fields)
        await wait_until(hold.reached.is_set, what="worker-1's gradient call of step 6")
        # Act
        await kill_abruptly(victim)
        final = await client.wait(job.job_id)

    # Assert
    assert final.state == "SUCCEEDED", final.error
    assert final.result["worker_failures"] == 1
    assert_matches(final.result, model, trace)


async def test_a_cancelled_prioritized_job_drops_its_table(make_cluster) -> None:
    # Arrange: a long job, cancelled once its table holds strengths written back.
    cluster = await make_cluster(workers=1, slots=SLOTS)
    async with cluster.client() as client:
        job = await client.submit(job_spec(1, steps=100_000))
        table = f"job-{job.job_id}-priorities"
        await wait_until_step(client, job.job_id, 2)
        assert table in [t["name"] for t in await client.list_tables()]

        # Act
        final = await client.cancel(job.job_id)

        # Assert
        assert final.state == "CANCELLED"
        assert table not in [t["name"] for t in await client.list_tables()]


async def wait_until_step(client, job_id: str, step: int) -> None:
    """Follow the job's progress until it reached ``step`` (within 60 s)."""

    async def follow() -> None:
        async for _job, progress in client.watch(job_id):
            if int(progress.get("step", 0)) >= step:
                return

    await asyncio.wait_for(follow(), timeout=60)


@pytest.mark.parametrize("every", [None, 4])
async def test_diloco_prioritized_job_equals_the_single_process_reference(
    make_cluster, every: int | None
) -> None:
    # Arrange: 2 shards of 80 rows, 5 inner steps an epoch, 2 inner steps an outer step
    # (3 outer steps an epoch, the last of one inner step); windows of one outer step, or of
    # two (the epoch's last window then has one).
    sampling = SAMPLING | {"resample_every_steps": every}
    fields = job_spec(2, strategy="diloco", inner_steps=2, sampling=sampling)
    fields["optimizer"] = {"name": "adam", "lr": 0.01}
    spec = TrainJobSpec.model_validate(fields)
    model, trace = train_prioritized_diloco_single_process(spec, dataset_of(spec), SLOTS)
    cluster = await make_cluster(workers=2, slots=SLOTS)

    # Act
    async with cluster.client() as client:
        job = await client.submit(fields)
        final = await client.wait(job.job_id)

    # Assert
    assert final.state == "SUCCEEDED", final.error
    assert final.result["inner_steps"] == STEPS
    assert_matches(final.result, model, trace)


@pytest.mark.parametrize(
    ("sampling", "fields", "message"),
    [
        ({"alpha": -0.5}, {}, "sampling.alpha: Input should be greater than or equal to 0"),
        ({"beta": 1.5}, {}, "sampling.beta: Input should be less than or equal to 1"),
        ({"beta_final": -1}, {}, "sampling.beta_final: Input should be greater than or equal"),
        ({"decay_rate": 2}, {}, "sampling.decay_rate: Input should be less than or equal to 1"),
        (
            {},
            {"strategy": "allreduce", "sharding": "fsdp"},
            "sampling.name: prioritized is not supported with sharding fsdp",
        ),
        ({"resample_every_steps": 2}, {}, "sampling.resample_every_steps: only for strategy"),
        (
            {"resample_every_steps": 3},
            {"strategy": "diloco", "inner_steps": 2},
            "sampling.resample_every_steps: 3 is not a multiple of inner_steps (2)",
        ),
        ({"priority": "gradient"}, {}, "sampling.priority: Input should be 'loss'"),
        ({"temperature": 1}, {}, "sampling.temperature: Extra inputs are not permitted"),
    ],
)
async def test_bad_sampling_is_refused_naming_the_field_and_nothing_is_queued(
    make_cluster, sampling: dict[str, Any], fields: dict[str, Any], message: str
) -> None:
    cluster = await make_cluster(workers=0)
    spec = job_spec(1, sampling=SAMPLING | sampling, **fields)

    async with cluster.client() as client:
        with pytest.raises(NeuroshardError) as err:
            await client.submit(spec)
        assert await client.jobs() == []

    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert message in str(err.value)


async def test_a_training_set_larger_than_max_memories_per_job_is_refused(make_cluster) -> None:
    # 160 training rows would be 160 memories of the priority table.
    cluster = await make_cluster(workers=0, max_memories_per_job=100)

    async with cluster.client() as client:
        with pytest.raises(NeuroshardError) as err:
            await client.submit(job_spec(1))
        assert await client.jobs() == []
        uniform = await client.submit(job_spec(1, sampling="uniform"))  # no table: admitted

    assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "sampling.name: 160 memories (prioritized: one per training row) exceeds" in str(
        err.value
    )
    assert uniform.state == "QUEUED"


async def test_a_restarted_coordinator_resumes_the_job_with_its_table(
    make_cluster, tmp_path: Path
) -> None:
    # Arrange: a checkpoint every 3 steps; the coordinator stops (as on SIGTERM: the job
    # stays RUNNING on disk) once the job is past its first checkpoint.
    options: dict[str, Any] = {"slots": SLOTS, "checkpoint_every_steps": 3}
    cluster = await make_cluster(workers=2, **options)
    async with cluster.client() as client:
        job_id = (await client.submit(job_spec(2, steps=40))).job_id
        await wait_until_step(client, job_id, 5)
    table = f"job-{job_id}-priorities"
    table_id = cluster.coordinator.cluster.tables.spec(table).id

    # Act: a new coordinator on the same address and data dir; the workers register again.
    await cluster.coordinator.stop()
    coordinator = await restart_coordinator(cluster, str(tmp_path / "coord"), **options)
    jobs = coordinator.cluster.jobs
    await wait_until(
        lambda: jobs.get(job_id).progress.get("step", 0) > 0,
        timeout_s=60,
        what="a step of the resumed job",
    )
    resumed_table_id = coordinator.cluster.tables.spec(table).id
    await wait_until(
        lambda: jobs.get(job_id).state.terminal, timeout_s=60, what="the resumed job to end"
    )

    # Assert: the same table (not made afresh), the job resumed from a checkpoint and ended,
    # the table dropped then.
    job = jobs.get(job_id)
    assert job.state.value == "SUCCEEDED", job.error
    assert job.result is not None and job.result["resumed_from_step"] > 0
    assert resumed_table_id == table_id
    assert table not in [t.name for t in coordinator.cluster.tables.specs()]


async def test_a_table_left_by_an_ended_job_is_dropped_at_start_and_no_other(
    make_cluster,
) -> None:
    # Arrange: an ended prioritized job whose table is there again (as a failed drop, or a
    # job failed by a restarted coordinator, leaves it), and a user's table of the same form.
    cluster = await make_cluster(workers=1, slots=SLOTS)
    async with cluster.client() as client:
        job = await client.submit(job_spec(1, steps=2))
        assert (await client.wait(job.job_id)).state == "SUCCEEDED"
        left = f"job-{job.job_id}-priorities"
        await client.create_table(left)
        await client.create_table("job-mine-priorities")

        # Act: what a coordinator does once when it starts
        dropped = await cluster.coordinator.cluster.drop_left_priority_tables()

        # Assert
        names = [t["name"] for t in await client.list_tables()]
    assert dropped == [left]
    assert left not in names and "job-mine-priorities" in names
