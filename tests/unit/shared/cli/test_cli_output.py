"""What the CLI prints: a train job's history as epochs end, a memory job's iterations, the
workers' training device."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from shared.cli.output import follow_job, print_status
from shared.client import JobInfo


def entry(epoch: int) -> dict[str, Any]:
    return {
        "epoch": epoch,
        "train_loss": 1.0 / epoch,
        "test_loss": 0.5 / epoch,
        "test_accuracy": 0.9 + epoch / 100,
        "lr": 0.001,
        "samples_per_s": 12345.0,
    }


def job(state: str, result: dict[str, Any] | None = None) -> JobInfo:
    return JobInfo("train-1", "train", state, {}, result, "")


class FakeClient:
    """Replays progress events as ``SyncClient.watch`` yields them."""

    def __init__(self, events: list[tuple[JobInfo, dict[str, Any]]]) -> None:
        self.events = events

    def watch(self, job_id: str) -> Iterator[tuple[JobInfo, dict[str, Any]]]:
        yield from self.events


# Epoch 2's event was coalesced away (a slow watcher): its row comes with epoch 3's event.
RESULT = {"test_accuracy": 0.93, "history": [entry(1), entry(2), entry(3)]}
EVENTS = [
    (job("RUNNING"), {"step": 1, "steps": 9, "history": []}),
    (job("RUNNING"), {"step": 3, "steps": 9, "history": [entry(1)]}),
    (job("RUNNING"), {"step": 4, "steps": 9, "history": [entry(1)]}),
    (job("RUNNING"), {"step": 9, "steps": 9, "history": [entry(1), entry(2), entry(3)]}),
    (job("SUCCEEDED", RESULT), {"step": 9, "steps": 9, "history": [entry(2), entry(3)]}),
]


def test_follow_prints_each_epoch_once_under_one_header(capsys: pytest.CaptureFixture) -> None:
    follow_job(FakeClient(EVENTS), job("QUEUED"), as_json=False)  # type: ignore[arg-type]

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["epoch", "train_loss", "test_loss", "test_acc", "lr", "samples/s"]
    assert lines[1].split() == ["1", "1.0000", "0.5000", "0.9100", "0.001", "12,345"]
    assert [line.split()[0] for line in lines[2:4]] == ["2", "3"]
    assert lines[4] == "train-1 SUCCEEDED"
    assert not any("history" in line for line in lines)  # not repeated as a JSON field


def test_a_language_models_history_shows_perplexity_and_tokens_per_s(
    capsys: pytest.CaptureFixture,
) -> None:
    lm = entry(1) | {"test_accuracy": float("nan"), "test_perplexity": 3.5, "tokens_per_s": 8e4}
    events = [(job("SUCCEEDED", {"history": [lm]}), {"step": 1, "steps": 1, "history": [lm]})]

    follow_job(FakeClient(events), job("QUEUED"), as_json=False)  # type: ignore[arg-type]

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "epoch", "train_loss", "test_loss", "ppl", "tokens/s", "lr", "samples/s"
    ]  # fmt: skip
    assert lines[1].split() == ["1", "1.0000", "0.5000", "3.500", "80,000", "0.001", "12,345"]


def test_the_convergence_of_each_epoch_is_a_column(capsys: pytest.CaptureFixture) -> None:
    rows = [entry(1) | {"convergence": 1.25}, entry(2) | {"convergence": 2.5}]
    events = [(job("SUCCEEDED", {"history": rows}), {"step": 2, "steps": 2, "history": rows})]

    follow_job(FakeClient(events), job("QUEUED"), as_json=False)  # type: ignore[arg-type]

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "convergence"
    assert [line.split()[-1] for line in lines[1:3]] == ["1.250", "2.500"]


def test_follow_json_prints_only_the_document(capsys: pytest.CaptureFixture) -> None:
    follow_job(FakeClient(EVENTS), job("QUEUED"), as_json=True)  # type: ignore[arg-type]

    doc = json.loads(capsys.readouterr().out)
    assert [e["epoch"] for e in doc["result"]["history"]] == [1, 2, 3]


def iterate(i: int) -> dict[str, Any]:
    quality = {"count": 20_000, "mean": 0.5 - i / 100, "min": 0.0, "max": 1.0}
    return {
        "phase": "iterate",
        "iteration": i,
        "iterations": 5,
        "iteration_ms": 12.5,
        "convergence": 1.5 + i / 10,
        "quality": quality | {"histogram": [2_000] * 10},
    }


def test_follow_prints_a_memory_jobs_iterations_once_each(capsys: pytest.CaptureFixture) -> None:
    mem = JobInfo("memory-1", "memory", "RUNNING", {}, None, "")
    done = JobInfo("memory-1", "memory", "SUCCEEDED", {}, {"convergence": 2.0}, "")
    events = [
        (mem, {"phase": "load", "loaded": 10, "memories": 20}),
        (mem, iterate(1)),
        (mem, iterate(1)),  # the same event again (a reconnect): no second row
        (mem, iterate(3)),  # iteration 2 coalesced away
        (done, iterate(5)),
    ]

    follow_job(FakeClient(events), mem, as_json=False)  # type: ignore[arg-type]

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["iteration", "ms", "convergence", "memories", "mean", "min", "max"]
    assert lines[1].split() == ["1", "12.5", "1.6000", "20,000", "0.4900", "0.0000", "1.0000"]
    assert [line.split()[0] for line in lines[2:4]] == ["3", "5"]
    assert lines[4:] == ["memory-1 SUCCEEDED", "  convergence: 2"]


def test_status_shows_the_training_device(capsys: pytest.CaptureFixture) -> None:
    worker = {
        "name": "w0",
        "address": "h:1",
        "state": "ALIVE",
        "device": "cpu",
        "train_device": "cuda:0",
        "memories": 5,
        "slots_primary": 3,
        "slots_replica": 4,
    }

    print_status({"workers": [worker], "jobs": {}})

    out = capsys.readouterr().out
    assert "training" in out
    assert "cuda:0" in out.split("w0", 1)[1].splitlines()[0]


def test_status_shows_the_link_figures_and_why_a_worker_is_excluded(
    capsys: pytest.CaptureFixture,
) -> None:
    base = {"state": "ALIVE", "device": "cpu", "train_device": "cpu", "memories": 0}
    fast = base | {"name": "w0", "address": "h:1", "rtt_ms": 1.234, "bandwidth_mbit": 950.0}
    slow = base | {
        "name": "w1",
        "address": "h:2",
        "rtt_ms": 201.5,
        "step_ms": 880.0,
        "health": 0.12,
        "excluded": True,
        "excluded_reason": "health 0.12 < 0.25 at step 40 (rtt 202 ms)",
    }

    print_status({"workers": [fast, slow], "jobs": {}})

    out = capsys.readouterr().out
    for heading in ("rtt_ms", "bandwidth_mbit", "step_ms", "health", "excluded"):
        assert heading in out
    links = out.split("links", 1)[1]
    row_w1 = links.split("w1", 1)[1].splitlines()[0]
    assert "201.5" in row_w1 and "0.12" in row_w1 and "True" in row_w1
    assert "w1 excluded: health 0.12 < 0.25 at step 40 (rtt 202 ms)" in out


def test_status_shows_how_long_a_dead_worker_is_held_down(capsys: pytest.CaptureFixture) -> None:
    base = {"device": "cpu", "train_device": "cpu", "memories": 0, "readmit_holddown_s": 0.0}
    alive = base | {"name": "w0", "address": "h:1", "state": "ALIVE"}
    held = base | {"name": "w1", "address": "h:2", "state": "DEAD", "readmit_holddown_s": 3.25}

    print_status({"workers": [alive, held], "jobs": {}})

    out = capsys.readouterr().out
    assert "w1 held down: may rejoin in 3.2 s, once the coordinator reaches it" in out
    assert "w0 held down" not in out
