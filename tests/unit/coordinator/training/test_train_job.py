"""A train job's parts without daemons: the device it resolves, its per-epoch history."""

from __future__ import annotations

import math

import pytest

from coordinator.jobs.jobs import JobFailed
from coordinator.placement.membership import WorkerRecord
from coordinator.training.train_history import PROGRESS_ENTRIES, TrainHistory
from coordinator.training.train_job import job_device


def worker(name: str, train_device: str) -> WorkerRecord:
    return WorkerRecord(name, f"{name}:1", "cpu", train_device)


def test_auto_trains_on_cuda_only_when_every_worker_has_it() -> None:
    gpus = [worker("a", "cuda:0"), worker("b", "cuda:1")]
    mixed = [worker("a", "cuda:0"), worker("b", "cpu")]

    assert job_device("auto", gpus) == "cuda"
    assert job_device("auto", mixed) == "cpu"
    assert job_device("cpu", gpus) == "cpu"
    assert job_device("cuda", gpus) == "cuda"
    with pytest.raises(JobFailed, match="device: cuda asked for, but worker b trains on cpu"):
        job_device("cuda", mixed)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_epoch_entry_averages_its_steps_and_tracks_the_best() -> None:
    clock = Clock()
    history = TrainHistory(clock)
    history.add_step(64, 128.0)
    history.add_step(36, 22.0)
    clock.now = 2.0

    first = history.end_epoch(1, test_loss=0.5, test_accuracy=0.8, lr=0.01)
    history.add_step(100, 50.0)
    clock.now = 3.0
    second = history.end_epoch(2, test_loss=0.6, test_accuracy=0.7, lr=0.005)

    assert history.entries[0] == {
        "epoch": 1,
        "train_loss": 1.5,
        "test_loss": 0.5,
        "test_accuracy": 0.8,
        "lr": 0.01,
        "samples_per_s": 50.0,
        "seconds": 2.0,
    }
    assert history.entries[1]["samples_per_s"] == 100.0
    assert history.entries[1]["seconds"] == 3.0  # training seconds up to the epoch's end
    assert (first, second, history.best_test_accuracy) == (True, False, 0.8)


def test_history_continues_from_a_checkpoint() -> None:
    clock = Clock()
    before = TrainHistory(clock)
    before.end_epoch(1, 0.5, 0.8, 0.01)
    before.add_step(10, 5.0)
    clock.now = 4.0
    doc = before.to_doc()

    clock.now = 100.0  # the coordinator restarted later
    after = TrainHistory(clock)
    after.load_doc(doc)
    clock.now = 105.0  # and took 5 s to start the workers
    after.start()
    after.add_step(10, 15.0)
    clock.now = 106.0
    after.end_epoch(2, 0.4, 0.85, 0.01)

    assert [e["epoch"] for e in after.entries] == [1, 2]
    assert after.entries[1]["train_loss"] == 1.0  # both halves of epoch 2
    assert after.entries[1]["samples_per_s"] == 20 / 5.0  # 4 s before, 1 s after
    assert after.entries[1]["seconds"] == 0.0 + 5.0  # epoch 1 took 0 s; the restart is not counted
    assert after.best_test_accuracy == 0.85
    fresh = TrainHistory(clock)
    fresh.load_doc({})
    assert fresh.entries == [] and math.isnan(fresh.best_test_accuracy)


def test_progress_carries_the_recent_entries() -> None:
    history = TrainHistory(Clock())
    for epoch in range(1, PROGRESS_ENTRIES + 6):
        history.end_epoch(epoch, 0.1, 0.9, 0.01)

    assert [e["epoch"] for e in history.recent()] == list(range(6, PROGRESS_ENTRIES + 6))
