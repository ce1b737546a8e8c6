"""``LocalCluster.start`` stops what it started when the start fails: no process is left
running (a chaos run under load once left a whole cluster behind after its start timed out)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.cli.local_cluster import ClusterStartError, LocalCluster


def test_a_failed_start_leaves_no_process_running(tmp_path: Path) -> None:
    # Arrange: workers that exit at once (an option they do not know), after the coordinator
    # has started.
    cluster = LocalCluster(
        2, data_dir=tmp_path / "cluster", log_dir=tmp_path / "logs", worker_args=["--no-such"]
    )

    # Act
    with pytest.raises(ClusterStartError, match="exited with code"):
        cluster.start(timeout_s=60.0)

    # Assert: the coordinator (which was up) and every worker have ended.
    assert cluster.coordinator is not None and cluster.workers
    assert cluster.coordinator.poll() is not None
    assert all(p.poll() is not None for p in cluster.workers)
