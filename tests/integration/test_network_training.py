"""Network-aware sync training through real daemons (issue 11): compression with error
feedback, rejection and exclusion of a worker sending NaN gradients, and throughput-
proportional batches equal to fixed ones.

A coordinator and workers serve in-process over gRPC (port 0). Fault injection wraps one
worker's ``sessions.compute`` (the seam the worker's servicer calls), so the bad gradient
really crosses the wire and the coordinator's checks see it as they would a faulty GPU's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from shared.netem.link_proxy import LinkProxy
from shared.netem.link_settings import LinkSettings
from shared.training.data import Dataset
from tests.integration.test_training_equivalence import (
    ADAM,
    assert_same_state,
    digits,
    job_spec,
    load_saved_model,
    reference_state,
)

__all__ = ["digits"]  # the fixture, shared with the equivalence tests

pytestmark = pytest.mark.integration


def digits_job(**extra: Any) -> dict[str, Any]:
    """The demo's digits MLP job on 3 workers, with ``extra`` keys."""
    return {
        "kind": "train",
        "workers": 3,
        "model": {"name": "mlp", "hidden": [128, 64]},
        "data": "digits",
        "optimizer": {"name": "adam", "lr": 0.003},
        "epochs": 15,
        "batch_size": 32,
        "seed": 0,
        **extra,
    }


async def run_job(cluster: Any, spec: dict[str, Any]) -> Any:
    async with cluster.client() as client:
        job = await client.submit(spec)
        return await client.wait(job.job_id)


@pytest.mark.parametrize(("name", "epochs"), [("topk", 30), ("int8", 15)])
async def test_compressed_training_with_error_feedback_reaches_095(
    make_cluster, name: str, epochs: int
) -> None:
    # Arrange: top-k sends 1% of each gradient (172 of 17,226 values); it needs more epochs.
    cluster = await make_cluster(workers=3)
    spec = digits_job(compression={"name": name, "ratio": 0.01}, epochs=epochs)

    # Act
    final = await run_job(cluster, spec)

    # Assert: accuracy as uncompressed, and far fewer gradient bytes than float32 would take.
    assert final.state == "SUCCEEDED", final.error
    assert final.result["test_accuracy"] >= 0.95
    steps, params = final.result["steps"], 17_226
    float32_grads = steps * 3 * params * 4
    assert final.result["bytes_from_workers"] < float32_grads / (20 if name == "topk" else 3)


class NanGradients:
    """Makes one worker answer every step with NaN gradients (its finite flag says so)."""

    def __init__(self, worker: Any) -> None:
        self.calls = 0
        self._compute = worker.sessions.compute
        worker.sessions.compute = self.compute

    async def compute(self, *args: Any) -> Any:
        res = await self._compute(*args)
        self.calls += 1
        res.grads = {n: np.full_like(g, np.nan) for n, g in res.grads.items()}
        res.finite = False
        return res


async def test_a_worker_sending_nan_gradients_is_rejected_and_excluded(make_cluster) -> None:
    # Arrange: worker-1's gradients are all NaN.
    cluster = await make_cluster(workers=3)
    bad = NanGradients(cluster.workers[1])

    # Act
    final = await run_job(cluster, digits_job(health_threshold=0.5, probation_steps=50))

    # Assert: the job succeeds as if the worker were not there; it was excluded for a while.
    assert final.state == "SUCCEEDED", final.error
    assert final.result["test_accuracy"] >= 0.95
    assert bad.calls > 0
    assert final.result["rejected_gradients"] == bad.calls
    w1 = final.result["workers"]["worker-1"]
    assert w1["rejected"] >= 1 and w1["health"] < 0.5
    # Probation 50, then a 3-step trial, then 100: far fewer calls than the job's steps.
    assert bad.calls < final.result["steps"] / 2


async def test_proportional_batches_equal_fixed_batches(make_cluster) -> None:
    # Arrange: the same job with fixed and with proportional batches (an MLP: no BatchNorm,
    # so only the split of each step's global batch between the workers differs).
    spec = {
        "kind": "train",
        "workers": 3,
        "model": {"name": "mlp", "hidden": [32]},
        "data": "digits",
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "steps": 30,
        "batch_size": 48,
        "test_fraction": 0.201,
        "seed": 7,
    }
    cluster = await make_cluster(workers=3)

    # Act
    fixed = await run_job(cluster, spec | {"batch_policy": "fixed"})
    proportional = await run_job(cluster, spec | {"batch_policy": "proportional"})

    # Assert
    assert fixed.state == proportional.state == "SUCCEEDED", proportional.error
    assert_same_state(load_saved_model(proportional.result), load_saved_model(fixed.result))
    assert sum(w["samples"] for w in proportional.result["workers"].values()) == sum(
        w["samples"] for w in fixed.result["workers"].values()
    )


async def test_backup_mode_equals_single_process_with_a_worker_slowed_by_a_proxy(
    make_cluster, digits: Dataset
) -> None:
    # Arrange: worker-2 is reached through a link proxy adding 40 ms each way; it stays in the
    # job (no exclusion), so every step needs backups of its piece.
    spec = job_spec(3, ADAM) | {
        "straggler": {"mode": "backup", "deadline_factor": 2.0},
        "health_threshold": 0.0,
    }
    expected = reference_state(spec, digits)
    cluster = await make_cluster(workers=2)
    proxy = LinkProxy("127.0.0.1", 0, "127.0.0.1", 0, LinkSettings(latency_ms=40))
    port = await proxy.start()
    try:
        slow = await cluster.add_worker("worker-2", advertise_address=f"127.0.0.1:{port}")
        # start() returned before the worker registers (in the background): aim the proxy now.
        proxy.target_port = slow.port
        await cluster.wait_alive(3)

        # Act
        final = await run_job(cluster, spec)
    finally:
        await proxy.stop()

    # Assert: the slow worker's pieces were also computed by the others at the deadline, and
    # every step still averaged the whole global batch: single-process training.
    assert final.state == "SUCCEEDED", final.error
    assert final.result["backup_pieces"] > 0
    assert final.result["dropped_pieces"] == 0
    assert_same_state(load_saved_model(final.result), expected)
    assert final.result["workers"]["worker-2"]["rtt_ms"] >= 80
