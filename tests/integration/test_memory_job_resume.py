"""A memory job resumes after a coordinator crash from its last saved iteration, and no
iteration is applied twice (issue 12, item 6): the store ends equal to a reference replaying
every iteration exactly once."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest

from coordinator.memory.access_stream import ScrambledZipfStream, generate_memories
from tests.conftest import wait_until
from tests.integration.memory_helpers import assert_cluster_equals
from tests.integration.test_durability import crash_coordinator, restart_coordinator
from tests.memory_reference import ReferenceStore

pytestmark = pytest.mark.integration

SLOTS = 32
SPEC = {
    "kind": "memory",
    "workers": 2,
    "memories": 4_000,
    "iterations": 400,
    "seed": 5,
    "access": {"distribution": "zipf", "alpha": 0.99, "batch": 500, "boost": 0.05},
    "decay_rate": 0.001,
    "topk": 20,
}


class _Unwritable:
    """The coordinator's database as a killed process leaves it: nothing more is written."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def execute(self, *_args: object) -> None:
        return None

    def executemany(self, *_args: object) -> None:
        return None

    def close(self) -> None:
        self._db.close()


def _reference() -> ReferenceStore:
    """The store after SPEC's load and each of its iterations applied once."""
    ref = ReferenceStore(slots=SLOTS)
    ids, strengths = generate_memories(SPEC["memories"], seed=SPEC["seed"])
    ref.upsert(ids, strengths)
    stream = ScrambledZipfStream(np.unique(ids), 0.99, 500, seed=SPEC["seed"])
    boosts = np.full(500, 0.05, np.float32)
    for i in range(SPEC["iterations"]):
        ref.reinforce(stream.next_batch(i), boosts)
        ref.decay(0.001)
    return ref


async def test_a_memory_job_resumes_after_a_coordinator_crash(
    make_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # Arrange: a long memory job that has saved some progress.
    cluster = await make_cluster(workers=2, slots=SLOTS)
    async with cluster.client() as client:
        job_id = (await client.submit(SPEC)).job_id
    state = cluster.coordinator.cluster.state
    await wait_until(lambda: state.load_memory_progress(job_id)[1] > 0, what="a saved iteration")

    # Act: crash the coordinator mid-job (its task is cancelled wherever it is, possibly
    # between an iteration's reinforce and its decay) and start a new one on the same
    # address and data dir; the workers keep running and register again.
    # A killed process writes nothing after its death: the job's cancellation must not be
    # saved as its outcome, nor later progress.
    monkeypatch.setattr(state, "_db", _Unwritable(state._db))
    await crash_coordinator(cluster)
    coordinator = await restart_coordinator(cluster, str(tmp_path / "coord"), slots=SLOTS)
    async with cluster.client() as client:
        await wait_until(
            lambda: coordinator.cluster.jobs.get(job_id).state.terminal,
            timeout_s=60,
            what="the resumed job to finish",
        )
        job = await client.get_job(job_id)

    # Assert: resumed past 0, all 400 iterations counted, each applied once.
    assert job.state == "SUCCEEDED", job.error
    assert 0 < job.result["resumed_at_iteration"] < SPEC["iterations"]
    assert job.result["iterations"] == SPEC["iterations"]
    await assert_cluster_equals(cluster, _reference())
