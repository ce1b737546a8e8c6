"""A job that was RUNNING at two coordinator crashes in a row is FAILED, not re-run; finished
jobs are pruned per ``job_retention`` from memory and from SQLite."""

from __future__ import annotations

from pathlib import Path

from coordinator.cluster import Cluster
from coordinator.jobs.jobs import JobState, JobStore
from coordinator.persistence import CRASHED_TWICE, StateStore
from shared.config import CoordinatorConfig, TrainJobSpec
from shared.metrics import Metrics


def _running_job(tmp_path: Path) -> str:
    store = StateStore(tmp_path)
    jobs = JobStore()
    jobs.on_change = store.save_job
    job = jobs.submit(TrainJobSpec(kind="train"))
    job.state = JobState.RUNNING
    store.save_job(job)
    store.close()  # no mark_clean_stop: the process "crashed"
    return job.job_id


def _restart(tmp_path: Path, clean: bool = False) -> dict[str, object]:
    store = StateStore(tmp_path)
    jobs = {j.job_id: j for j in store.load_jobs()}
    if clean:
        store.mark_clean_stop()
    store.close()
    return jobs


def test_a_job_running_at_two_crashes_in_a_row_fails(tmp_path: Path) -> None:
    job_id = _running_job(tmp_path)
    StateStore(tmp_path).close()  # a first process that started (and crashed) before the job

    first = _restart(tmp_path)[job_id]
    assert first.state is JobState.QUEUED  # re-run after one crash
    first.state = JobState.RUNNING  # it runs again ...
    store = StateStore(tmp_path)
    store.save_job(first)
    store.close()  # ... and the coordinator crashes again

    second = _restart(tmp_path)[job_id]

    assert (second.state, second.error) == (JobState.FAILED, CRASHED_TWICE)
    assert _restart(tmp_path)[job_id].state is JobState.FAILED  # and stays so


def test_graceful_stops_do_not_count_as_crashes(tmp_path: Path) -> None:
    job_id = _running_job(tmp_path)
    store = StateStore(tmp_path)
    store.mark_clean_stop()
    store.close()

    for _ in range(3):  # the job is found RUNNING after each graceful stop
        job = _restart(tmp_path, clean=True)[job_id]
        assert job.state is JobState.QUEUED
        store = StateStore(tmp_path)
        job.state = JobState.RUNNING
        store.save_job(job)
        store.mark_clean_stop()
        store.close()


async def test_retention_prunes_old_and_excess_finished_jobs(tmp_path: Path) -> None:
    cfg = CoordinatorConfig(
        data_dir=str(tmp_path),
        metrics_port=None,
        job_retention={"max_jobs": 2, "max_age_s": 100.0},
    )
    cluster = Cluster(cfg, Metrics())
    try:
        spec = '{"kind": "train", "workers": 1, "steps": 1}'
        jobs = [await cluster.submit(spec) for _ in range(5)]
        for finished_at, job in zip((10.0, 500.0, 510.0, 520.0), jobs, strict=False):
            await cluster.jobs.update(job, state=JobState.SUCCEEDED)
            job.finished_at = finished_at
            cluster.state.save_job(job)
        checkpoint = tmp_path / "checkpoints" / f"{jobs[1].job_id}.ckpt"
        checkpoint.parent.mkdir()
        checkpoint.write_bytes(b"x")
        boards = [tmp_path / "tensorboard" / j.job_id for j in jobs[1:3]]
        for board in boards:
            board.mkdir(parents=True)
            (board / "events.out.tfevents.1").write_bytes(b"x")

        dropped = cluster.prune_jobs(now=550.0)

        # jobs[0] is too old, jobs[1] the oldest beyond max_jobs=2; jobs[4] is still queued
        assert dropped == [jobs[0].job_id, jobs[1].job_id]
        kept = [j.job_id for j in cluster.jobs.list()]
        assert kept == [j.job_id for j in jobs[2:]]
        assert [j.job_id for j in cluster.state.load_jobs()] == kept
        assert not checkpoint.exists()
        assert [b.exists() for b in boards] == [False, True]  # a kept job keeps its own
    finally:
        await cluster.close()


def test_a_memory_jobs_progress_survives_a_restart_and_goes_with_the_job(
    tmp_path: Path,
) -> None:
    # Arrange: progress saved by one process.
    store = StateStore(tmp_path)
    store.save_memory_progress("memory-1", True, 17)
    store.close()

    # Act: another process reads it, then the job is forgotten (retention).
    store = StateStore(tmp_path)
    saved, unknown = store.load_memory_progress("memory-1"), store.load_memory_progress("x")
    store.delete_jobs(["memory-1"])

    # Assert
    assert (saved, unknown) == ((True, 17), (False, 0))
    assert store.load_memory_progress("memory-1") == (False, 0)
    store.close()
