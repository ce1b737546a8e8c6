"""Prioritized ``strategy: allreduce`` through real daemons equals its reference.

Each window of ``resample_every_steps`` steps (default: one epoch) is one generation of the
job: its rows and weights are drawn by the coordinator at its start and sent to every rank,
the ranks' per-sample losses come back at its end. The saved model, the rows drawn, the
running mean loss and the table are compared with
``tests.prioritized_reference.train_prioritized_allreduce_single_process``.

The small synthetic set has 160 training rows: with 2 workers of 16 rows a step (G = 32)
an epoch is 5 steps, so 12 steps make windows [0, 5), [5, 10), [10, 12) by default.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from shared.client import NeuroshardError
from shared.config import TrainJobSpec
from tests.integration.test_failover import kill_abruptly
from tests.integration.test_prioritized_training import (
    SLOTS,
    assert_matches,
    assert_table_dropped,
    dataset_of,
    job_spec,
)
from tests.prioritized_reference import train_prioritized_allreduce_single_process

pytestmark = pytest.mark.integration


def allreduce_spec(workers: int, **fields: Any) -> dict[str, Any]:
    """A prioritized allreduce MLP job on the small synthetic set."""
    return job_spec(workers, strategy="allreduce", **fields)


@pytest.mark.parametrize("every", [None, 2])
async def test_allreduce_prioritized_job_equals_the_single_process_reference(
    make_cluster, every: int | None
) -> None:
    # Arrange: windows of one epoch (5 steps), or of 2 steps cut at epoch ends (2, 2, 1)
    fields = allreduce_spec(2)
    fields["sampling"] = fields["sampling"] | {"resample_every_steps": every}
    spec = TrainJobSpec.model_validate(fields)
    model, trace = train_prioritized_allreduce_single_process(spec, dataset_of(spec), SLOTS)
    cluster = await make_cluster(workers=2, slots=SLOTS)

    # Act
    async with cluster.client() as client:
        job = await client.submit(fields)
        final = await client.wait(job.job_id)

        # Assert
        assert final.state == "SUCCEEDED", final.error
        assert final.result["strategy"] == "allreduce"
        assert final.result["worker_failures"] == 0
        assert_matches(final.result, model, trace)
        await assert_table_dropped(client, final.result)


async def test_allreduce_prioritized_job_with_a_worker_killed_mid_job_equals_the_reference(
    make_cluster,
) -> None:
    # Arrange: 3 workers (G = 48: an epoch is 4 steps), min_workers 2; worker-1 dies once
    # the first window (epoch) is done. The window it dies in is run again from its start
    # with the coordinator's state of that step: same rows, same weights, same model.
    fields = allreduce_spec(3, min_workers=2, steps=16, collective_timeout_s=5)
    spec = TrainJobSpec.model_validate(fields)
    model, trace = train_prioritized_allreduce_single_process(spec, dataset_of(spec), SLOTS)
    beats = {"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 2.0}
    cluster = await make_cluster(workers=3, slots=SLOTS, **beats)

    async with cluster.client() as client:
        job = await client.submit(fields)
        async for _, progress in client.watch(job.job_id):
            if progress and progress.get("step", 0) >= 4:
                break
        # Act
        await kill_abruptly(cluster.workers[1])
        final = await client.wait(job.job_id)

    # Assert
    assert final.state == "SUCCEEDED", final.error
    # 4 windows, one of them run again (or a generation that could not start)
    assert final.result["worker_failures"] == 1 and final.result["generations"] >= 5
    assert_matches(final.result, model, trace)


async def test_a_window_too_large_for_a_message_is_refused(make_cluster) -> None:
    # Arrange: 1 MiB messages; a window of one epoch of a 100,000-row set is 1.2 MB of rows
    cluster = await make_cluster(workers=0, max_message_bytes=1 << 20)
    fields = allreduce_spec(
        1, data={"name": "synthetic", "samples": 125_000, "features": 4, "classes": 2}
    )

    async with cluster.client() as client:
        with pytest.raises(NeuroshardError) as err:
            await client.submit(fields)
        assert await client.jobs() == []

    assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "sampling.resample_every_steps: a window of" in str(err.value)
    assert "max_message_bytes 1048576" in str(err.value)
