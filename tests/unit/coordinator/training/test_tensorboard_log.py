"""``TrainBoard``: the tags and steps it writes, a resumed job's purge, a writer that fails.

The files are read back with TensorBoard's own ``EventAccumulator``; the jobs that call the
board through real daemons are in ``tests/integration/test_tensorboard.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from coordinator.training import tensorboard_log
from coordinator.training.step_types import ShardResult, StepOutcome
from coordinator.training.tensorboard_log import TrainBoard, worker_times


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _result(worker: str, wall_s: float, compute_s: float) -> ShardResult:
    return ShardResult(1, 1.0, 1, {}, worker=worker, wall_s=wall_s, compute_s=compute_s)


def test_worker_times_sum_each_workers_calls_of_the_step() -> None:
    outcome = StepOutcome(
        results={0: _result("a", 0.5, 0.25), 1: _result("b", 0.25, 0.125), 2: _result("a", 1, 0.5)}
    )

    assert worker_times(outcome) == {"a": (1.5, 0.75), "b": (0.25, 0.125)}


def test_steps_epochs_and_workers_are_written_at_the_global_step(tmp_path: Path) -> None:
    # Arrange
    board = TrainBoard(tmp_path / "job-1", "job-1")
    board.open()

    # Act
    board.add_step(1, 2.5, 0.1, {"a": (0.5, 0.25)})
    board.add_step(2, 2.0, 0.05, {"b": (0.125,)})
    board.add_epoch(
        2,
        {"epoch": 1, "step": 2, "train_loss": 2.25, "test_accuracy": 0.5, "test_loss": float("nan")}
        | {"samples": 128, "note": "text", "exact": True},
    )
    board.close()
    board.close()  # a second close (cancel after an end) does nothing

    # Assert: numbers only, NaN left out, the axis fields not scalars
    assert _scalars(tmp_path / "job-1") == {
        "train/loss": [(1, 2.5), (2, 2.0)],
        "train/lr": [(1, pytest.approx(0.1)), (2, pytest.approx(0.05))],
        "workers/a/step_ms": [(1, 500.0)],
        "workers/a/compute_ms": [(1, 250.0)],
        "workers/a/transfer_ms": [(1, 250.0)],
        "workers/b/step_ms": [(2, 125.0)],
        "epoch/train_loss": [(2, 2.25)],
        "epoch/test_accuracy": [(2, 0.5)],
        "epoch/samples": [(2, 128.0)],
    }


def test_a_resumed_job_drops_the_steps_after_its_checkpoint(tmp_path: Path) -> None:
    # Arrange: a first process wrote steps 1..4, then died; the checkpoint holds 2 steps
    first = TrainBoard(tmp_path / "job-1", "job-1")
    first.open()
    for step in range(1, 5):
        first.add_step(step, float(step), 0.1)
    first.close()

    # Act: the resumed job computes steps 3 and 4 again
    second = TrainBoard(tmp_path / "job-1", "job-1")
    second.open(resumed_step=2)
    second.add_step(3, 30.0, 0.1)
    second.add_step(4, 40.0, 0.1)
    second.close()

    # Assert
    assert _scalars(tmp_path / "job-1")["train/loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_a_board_never_opened_or_that_cannot_write_does_nothing(tmp_path: Path) -> None:
    # Arrange: the run directory's place is taken by a file
    (tmp_path / "job-1").write_bytes(b"")
    unopened, broken = (
        TrainBoard(tmp_path / "job-2", "job-2"),
        TrainBoard(tmp_path / "job-1", "job-1"),
    )

    # Act: neither raises
    unopened.add_step(1, 1.0, 0.1)
    unopened.add_epoch(1, {"train_loss": 1.0})
    broken.open()
    broken.add_step(1, 1.0, 0.1)
    broken.add_epoch(1, {"train_loss": 1.0})
    broken.close()

    # Assert
    assert not (tmp_path / "job-2").exists()


def test_an_epoch_end_flushes_only_when_the_last_flush_is_old_enough(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange: flushes at most once an hour, but the first epoch's end always
    monkeypatch.setattr(tensorboard_log, "EPOCH_FLUSH_S", 3600.0)
    board = TrainBoard(tmp_path / "job-1", "job-1")
    board.open()

    # Act
    board.add_epoch(10, {"train_loss": 1.0})
    board.add_epoch(20, {"train_loss": 0.5})
    on_disk = _scalars(tmp_path / "job-1")
    board.flush()  # a checkpoint's
    at_checkpoint = _scalars(tmp_path / "job-1")
    board.close()

    # Assert
    assert on_disk == {"epoch/train_loss": [(10, 1.0)]}
    assert at_checkpoint == {"epoch/train_loss": [(10, 1.0), (20, 0.5)]}
