"""Jobs remember who submitted them (across a coordinator restart), and the per-client limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.cluster import Cluster
from coordinator.jobs.jobs import JobQuotaExceeded, JobStore
from coordinator.persistence import StateStore
from shared.config import CoordinatorConfig, TrainJobSpec
from shared.metrics import Metrics


def test_the_owner_survives_a_restart(tmp_path: Path) -> None:
    # Arrange
    store = StateStore(tmp_path)
    jobs = JobStore()
    jobs.on_change = store.save_job
    mine = jobs.submit(TrainJobSpec(kind="train"), owner="alice")
    anonymous = jobs.submit(TrainJobSpec(kind="train"))
    store.close()

    # Act
    reloaded = {j.job_id: j for j in StateStore(tmp_path).load_jobs()}

    # Assert
    assert reloaded[mine.job_id].owner == "alice"
    assert reloaded[anonymous.job_id].owner == ""


async def test_active_jobs_per_owner_are_limited(tmp_path: Path) -> None:
    cfg = CoordinatorConfig(data_dir=str(tmp_path), max_jobs_per_client=2, metrics_port=None)
    cluster = Cluster(cfg, Metrics())
    try:
        spec = '{"kind": "train", "workers": 1, "steps": 1}'
        await cluster.submit(spec, "alice")
        await cluster.submit(spec, "alice")
        await cluster.submit(spec, "bob")  # another subject has its own count
        with pytest.raises(JobQuotaExceeded, match="client 'alice' already has 2 queued"):
            await cluster.submit(spec, "alice")
        assert cluster.jobs.active("alice") == 2
    finally:
        await cluster.close()
