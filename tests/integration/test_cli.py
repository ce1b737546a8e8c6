"""The real CLI: ``neuroshard up`` in a subprocess, then ``submit --follow --json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.cli_helpers import run_cli as _cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_submit_follow_json_prints_the_result(up_cluster: tuple[str, Path]) -> None:
    address, _ = up_cluster
    done = _cli(
        "submit", "configs/jobs/digits-mlp.yaml", "--follow", "--json", "--coordinator", address
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert set(doc) == {"job_id", "state", "kind", "result", "error"}
    assert doc["state"] == "SUCCEEDED" and doc["kind"] == "train"
    result = doc["result"]
    for key in ("test_accuracy", "test_loss", "steps", "samples_per_s", "model_path"):
        assert key in result
    assert result["test_accuracy"] >= 0.95
    assert sorted(result["workers"]) == ["worker-0", "worker-1", "worker-2"]
    assert all(w["samples"] > 0 and w["steps"] > 0 for w in result["workers"].values())

    jobs = _cli("jobs", "--json", "--coordinator", address)
    assert jobs.returncode == 0
    assert [j["job_id"] for j in json.loads(jobs.stdout)] == [doc["job_id"]]


def test_status_json_lists_the_workers(up_cluster: tuple[str, Path]) -> None:
    address, _ = up_cluster
    done = _cli("status", "--json", "--coordinator", address)
    assert done.returncode == 0, done.stderr
    workers = json.loads(done.stdout)["workers"]
    assert [w["name"] for w in workers] == ["worker-0", "worker-1", "worker-2"]
    for w in workers:
        assert w["state"] == "ALIVE" and w["device"] == "cpu" and w["address"]
        assert w["readmit_holddown_s"] == 0  # only a DEAD worker is held down
        assert w["train_device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")


def test_invalid_spec_exits_2_with_one_line(up_cluster: tuple[str, Path], tmp_path: Path) -> None:
    address, _ = up_cluster
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: train\nworkers: 3\noptimizer: {name: adam, lr: -1}\n")
    done = _cli("submit", str(bad), "--coordinator", address)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "optimizer.lr" in done.stderr


def test_unknown_job_and_unreachable_coordinator(up_cluster: tuple[str, Path]) -> None:
    address, _ = up_cluster
    missing = _cli("cancel", "train-00000000", "--coordinator", address)
    assert missing.returncode == 1
    assert "no job with id 'train-00000000'" in missing.stderr
    down = _cli("status", "--coordinator", "127.0.0.1:1", timeout=60)
    assert down.returncode == 1
    assert down.stderr.startswith("error: cannot reach the coordinator at 127.0.0.1:1")
    assert "Traceback" not in down.stderr


def test_up_stops_on_sigint_even_when_started_with_sigint_ignored(tmp_path: Path) -> None:
    # Arrange: `up` started as a shell without job control starts `cmd &`: SIGINT ignored
    # (Python then installs no KeyboardInterrupt of its own; `up` used to ignore `kill -INT`).
    import signal
    import subprocess

    from tests.integration.cli_helpers import CLI, REPO, processes_mentioning

    data_dir = tmp_path / "up"
    proc = subprocess.Popen(
        [*CLI, "up", "--workers", "1", "--port", "0", "--data-dir", str(data_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip(), "neuroshard up exited before printing its address"

        # Act
        proc.send_signal(signal.SIGINT)

        # Assert: it stops, with its daemons.
        assert proc.wait(timeout=30) == 0
        assert processes_mentioning(str(data_dir)) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_grant_and_finish_drive_a_paced_job(up_cluster: tuple[str, Path], tmp_path: Path) -> None:
    # Arrange: the digits job, paced (it waits at every epoch boundary for a grant)
    from shared.client import SyncClient

    address, _ = up_cluster
    spec = tmp_path / "paced.yaml"
    spec.write_text(Path("configs/jobs/digits-mlp.yaml").read_text() + "paced: true\n")
    submitted = _cli("submit", str(spec), "--coordinator", address)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()

    # Act: two epochs granted, then finish
    granted = _cli("grant", job_id, "--epochs", "2", "--coordinator", address)
    finished = _cli("finish", job_id, "--coordinator", address)
    unknown = _cli("grant", "train-00000000", "--coordinator", address)
    with SyncClient(address, timeout_s=60) as client:
        final = client.wait(job_id)

    # Assert: the grant counted; the job ran exactly the two granted epochs, then SUCCEEDED
    assert granted.returncode == 0, granted.stderr
    assert granted.stdout.strip() == f"{job_id} epochs granted: 2"
    assert finished.returncode == 0, finished.stderr
    assert final.state == "SUCCEEDED", final.error
    assert final.result is not None and final.result["epochs"] == 2
    assert unknown.returncode == 1 and "no job with id 'train-00000000'" in unknown.stderr
