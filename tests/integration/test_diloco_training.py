"""``strategy: diloco`` through real daemons (issue 11, part 7): the parameters of a
single-process DiLoCo, accuracy with few round trips, compressed pseudo-gradients, and a worker
killed between outer steps.

A coordinator and workers serve in-process over gRPC (port 0). Round trips are counted where
the worker's servicer calls its sessions (one ``sessions.compute`` per ComputeGradients call).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.config import TrainJobSpec
from shared.training.data import load_dataset
from tests.integration.test_failover import FAST_HEARTBEATS, kill_abruptly
from tests.integration.test_network_training import run_job
from tests.integration.test_training_equivalence import assert_same_state, load_saved_model
from tests.training_reference import train_diloco_single_process

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).parents[2] / "configs" / "jobs" / "digits-diloco.yaml"


class CountCalls:
    """Counts one worker's ComputeGradients calls that reached its training sessions."""

    def __init__(self, worker: Any) -> None:
        self.calls = 0
        self._compute = worker.sessions.compute
        worker.sessions.compute = self.compute

    async def compute(self, *args: Any) -> Any:
        self.calls += 1
        return await self._compute(*args)


async def test_diloco_job_ends_with_single_process_diloco_parameters(make_cluster) -> None:
    # Arrange: shards of 479/478/478 rows, batch 48: 10 inner steps an epoch whose last
    # batches differ (47/46/46 rows); H = 4 cuts an epoch into 4 + 4 + 2 inner steps, and 18
    # inner steps end mid-epoch: 5 outer steps. SGD with momentum carries inner state across
    # outer steps; warm-up then cosine over the job's 18 inner steps sets each one's lr.
    spec = {
        "kind": "train",
        "strategy": "diloco",
        "workers": 3,
        "model": {"name": "mlp", "hidden": [32]},
        "data": "digits",
        "precision": "fp32",
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "lr_schedule": {"name": "cosine", "warmup_steps": 3, "min_lr_factor": 0.1},
        "inner_steps": 4,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "steps": 18,
        "batch_size": 48,
        "test_fraction": 0.201,
        "seed": 7,
    }
    parsed = TrainJobSpec.model_validate(spec)
    digits = load_dataset(parsed.data, parsed.seed, parsed.test_fraction)
    expected = train_diloco_single_process(parsed, digits).state_dict()
    cluster = await make_cluster(workers=3)

    # Act
    final = await run_job(cluster, spec)

    # Assert
    assert final.state == "SUCCEEDED", final.error
    assert (final.result["inner_steps"], final.result["outer_steps"]) == (18, 5)
    assert final.result["worker_failures"] == 0
    assert_same_state(load_saved_model(final.result), expected)


async def test_diloco_reaches_095_with_far_fewer_round_trips_than_sync(make_cluster) -> None:
    # Arrange: the example job, and the same model, data and inner optimizer with sync.
    cluster = await make_cluster(workers=3)
    counters = [CountCalls(w) for w in cluster.workers]
    diloco = yaml.safe_load(EXAMPLE.read_text())
    sync = {k: v for k, v in diloco.items() if k not in ("inner_steps", "outer_lr")}
    sync |= {"strategy": "sync", "name": "digits-sync", "epochs": 15}
    sync.pop("outer_momentum")

    # Act
    d = await run_job(cluster, diloco)
    diloco_calls = sum(c.calls for c in counters)
    s = await run_job(cluster, sync)
    sync_calls = sum(c.calls for c in counters) - diloco_calls

    # Assert: accurate; one call per worker per outer step (H inner steps each).
    assert d.state == "SUCCEEDED", d.error
    assert s.state == "SUCCEEDED", s.error
    r = d.result
    print(
        f"diloco: acc {r['test_accuracy']:.4f} outer {r['outer_steps']} calls {diloco_calls} "
        f"{r['seconds']:.2f} s; sync: acc {s.result['test_accuracy']:.4f} steps "
        f"{s.result['steps']} calls {sync_calls} {s.result['seconds']:.2f} s"
    )
    assert r["test_accuracy"] >= 0.95
    # digits: 1437 training rows, 479 per shard, 15 inner steps of 32 per epoch, H = 10.
    assert (r["inner_steps"], r["outer_steps"], r["steps"]) == (20 * 15, 20 * 2, 20 * 2)
    assert diloco_calls == r["outer_steps"] * 3
    assert all(w["steps"] == r["outer_steps"] for w in r["workers"].values())
    assert len(r["history"]) == 20
    assert sync_calls == s.result["steps"] * 3
    assert diloco_calls * 5 < sync_calls


@pytest.mark.parametrize(("name", "epochs"), [("topk", 50), ("int8", 30)])
async def test_diloco_with_compressed_pseudo_gradients_reaches_095(
    make_cluster, name: str, epochs: int
) -> None:
    # Arrange: pseudo-gradients compressed with error feedback; top-k keeps 20% of each
    # (5% reached 0.947 in 60 epochs) and needs more outer steps.
    cluster = await make_cluster(workers=3)
    spec = yaml.safe_load(EXAMPLE.read_text()) | {
        "compression": {"name": name, "ratio": 0.2},
        "epochs": epochs,
    }

    # Act
    final = await run_job(cluster, spec)

    # Assert: accurate, and fewer bytes up than float32 pseudo-gradients would take.
    assert final.state == "SUCCEEDED", final.error
    print(
        f"{name}: acc {final.result['test_accuracy']:.4f} up {final.result['bytes_from_workers']}"
    )
    assert final.result["test_accuracy"] >= 0.95
    float32_up = final.result["outer_steps"] * 3 * 17_226 * 4
    # top-k sends an int32 index with each float32 value: 20% of them is 2.5x fewer bytes.
    assert final.result["bytes_from_workers"] < float32_up / 2


async def test_diloco_worker_killed_between_outer_steps_still_succeeds(make_cluster) -> None:
    # Arrange: 3 workers; one is killed abruptly after a few outer steps.
    cluster = await make_cluster(workers=3, **FAST_HEARTBEATS)
    spec = yaml.safe_load(EXAMPLE.read_text())
    async with cluster.client() as client:
        job = await client.submit(spec)
        async for _, progress in client.watch(job.job_id):
            if progress.get("step", 0) >= 4:
                break
        # Act
        await kill_abruptly(cluster.workers[1])
        final = await client.wait(job.job_id)

    # Assert: the survivors took the dead worker's shard; accuracy as without failure.
    assert final.state == "SUCCEEDED", final.error
    assert final.result["worker_failures"] == 1
    # The outer step at which the death is detected varies with the machine's load, and with
    # it which steps average 2 or 3 pseudo-gradients: 0.944-0.96 seen, so a margin below the
    # 0.95 of an undisturbed run (a job that lost the shard or a step would fall far lower).
    assert final.result["test_accuracy"] >= 0.93
    workers = final.result["workers"]
    assert workers["worker-1"]["steps"] < workers["worker-0"]["steps"]
    assert workers["worker-0"]["steps"] == final.result["outer_steps"]
