"""Nothing the daemons keep is readable by group or others: data dirs 0700, files 0600.

Real in-process daemons write what they keep (journals with payloads and a snapshot,
``coordinator.db`` with every user's specs, checkpoints, models, TensorBoard event files, an
uploaded data set); then every directory and file under their data dirs is checked. The test
process keeps its usual umask (022), so the modes come from the daemons' explicit ones, not
from a umask.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import wait_until
from tests.npz_files import npz_bytes

pytestmark = pytest.mark.integration


def readable_by_others(root: Path) -> list[str]:
    """Every path under ``root`` (itself included) with a group or other permission bit."""
    paths = [root, *root.rglob("*")]
    return [
        f"{p.relative_to(root.parent)} {stat.filemode(p.lstat().st_mode)}"
        for p in paths
        if p.lstat().st_mode & 0o077
    ]


async def test_data_dirs_are_0700_and_files_0600(make_cluster, tmp_path: Path) -> None:
    # Arrange: the usual umask, so that only explicit modes can pass
    old_umask = os.umask(0o022)
    os.umask(old_umask)
    assert old_umask & 0o077 != 0o077, "the test needs a permissive umask to mean anything"
    cluster = await make_cluster(
        workers=2,
        checkpoint_every_steps=1,
        worker_overrides={"snapshot_log_bytes": 4096},
    )
    coord = Path(cluster.coordinator.cfg.data_dir)
    workers = [Path(w.cfg.data_dir) for w in cluster.workers]
    n = 30
    x = np.random.default_rng(0).normal(size=(60, 4)).astype(np.float32)
    (tmp_path / "set.npz").write_bytes(npz_bytes(x=x, y=np.arange(60, dtype=np.int64) % 2))

    # Act: writes with payloads (journal, then a snapshot), an upload, a train job
    async with cluster.client() as client:
        for i in range(4):
            ids = np.arange(i * n, (i + 1) * n, dtype=np.uint64)
            await client.upsert(ids, np.full(n, 0.5, np.float32), [b"secret" * 40] * n)
        await client.put_dataset(tmp_path / "set.npz")
        job = await client.submit(
            {"kind": "train", "workers": 2, "data": {"path": "set.npz"}, "steps": 3}
        )
        final = await client.wait(job.job_id)
    await wait_until(
        lambda: all((w / "snapshot.bin").exists() for w in workers), what="worker snapshots"
    )

    # Assert: each kind of file is there, and nothing is open to group or others
    assert final.state == "SUCCEEDED", final.error
    kept = {p.relative_to(coord).as_posix() for p in coord.rglob("*")}  # noqa: ASYNC240
    assert {
        "coordinator.db",
        "coordinator.db-wal",  # SQLite's: it takes the database's mode
        "datasets/set.npz",
        "checkpoints",  # the job's checkpoint is deleted once it succeeded
        f"models/{job.job_id}.pt",
        f"models/{job.job_id}.best.pt",
        f"tensorboard/{job.job_id}",  # and its event file
    } <= kept
    assert any(k.startswith(f"tensorboard/{job.job_id}/events.out.tfevents.") for k in kept)
    for w in workers:
        names = {p.name for p in w.iterdir()}
        assert {"LOCK", "snapshot.bin"} <= names and any(n.endswith(".wal") for n in names)
    exposed = [e for root in (coord, *workers) for e in readable_by_others(root)]
    assert exposed == []
