"""coordinator/training/step_monitor.py: what a job learns from each step's answers.

The monitor feeds every answer into its worker's link telemetry, keeps the healthy step times
the next deadline comes from, counts bytes and pieces (result and metrics), and excludes and
re-admits members by health. No cluster: a ``Members`` with hand-made seats and outcomes.
"""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.network.link_stats import LinkStats
from coordinator.training.step_monitor import DEADLINE_FLOOR_S, StepMonitor
from coordinator.training.step_types import Member, ShardResult, StepOutcome
from coordinator.training.train_members import Members
from shared.config import TrainJobSpec
from shared.metrics import Metrics

STEP_TIMEOUT_S = 30.0


def members(*names: str) -> Members:
    m = Members(
        "job-1",
        "{}",
        shards=len(names),
        clients=None,  # type: ignore[arg-type]  # no call is made
        alive=list,
        rpc_timeout_s=5.0,
        step_timeout_s=STEP_TIMEOUT_S,
        chunk_bytes=1 << 20,
    )
    for n in names:
        m.live[n] = m.history[n] = Member(n, stub=None)  # type: ignore[arg-type]
    return m


def monitor(probation_steps: int = 2) -> tuple[StepMonitor, LinkStats, Metrics]:
    spec = TrainJobSpec(kind="train", health_threshold=0.25, probation_steps=probation_steps)
    links, metrics = LinkStats(), Metrics()
    return StepMonitor("job-1", spec, links, metrics, STEP_TIMEOUT_S), links, metrics


def answer(
    worker: str, wall_s: float, compute_s: float = 0.0, to: int = 0, back: int = 0, rows: int = 0
) -> ShardResult:
    return ShardResult(
        samples=rows,
        loss_sum=0.0,
        correct=0,
        grads={"w": np.zeros(1, np.float32)},
        worker=worker,
        wall_s=wall_s,
        compute_s=compute_s,
        bytes_to_worker=to,
        bytes_from_worker=back,
    )


def outcome(*answers: ShardResult, **fields: object) -> StepOutcome:
    return StepOutcome(results=dict(enumerate(answers)), **fields)  # type: ignore[arg-type]


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_each_answer_feeds_its_workers_link_and_the_byte_counters() -> None:
    # Arrange
    mon, links, metrics = monitor()
    ms = members("a", "b")
    step = outcome(
        answer("a", wall_s=0.2, compute_s=0.15, to=1000, back=400, rows=8),
        answer("b", wall_s=0.4, compute_s=0.1, to=2000, back=600, rows=16),
    )

    # Act
    mon.observe(step, 0, ms)

    # Assert: the link sees bytes from the worker as "up" (gradients), to it as "down".
    a = links.get("a")
    assert (a.steps, a.step_s, a.compute_s) == (1, 0.2, 0.15)
    assert (a.bytes_up, a.bytes_down, a.samples_per_s) == (400, 1000, pytest.approx(40.0))
    assert mon.bytes == {"to_workers": 3000, "from_workers": 1000}
    assert mon.result_doc() == {
        "rejected_gradients": 0,
        "backup_pieces": 0,
        "dropped_pieces": 0,
        "bytes_to_workers": 3000,
        "bytes_from_workers": 1000,
    }
    transfer = "neuroshard_train_transfer_bytes_total"
    assert sample(metrics, transfer, direction="to_workers") == 3000
    assert sample(metrics, transfer, direction="from_workers") == 1000
    assert sample(metrics, "neuroshard_train_pieces_total", outcome="accepted") == 2
    # The gauges; health against the healthy median step time (0.3 s): b's is 0.3 / 0.4.
    assert sample(metrics, "neuroshard_worker_step_seconds", worker="b") == pytest.approx(0.4)
    assert sample(metrics, "neuroshard_worker_health", worker="a") == 1.0
    assert sample(metrics, "neuroshard_worker_health", worker="b") == pytest.approx(0.75)
    assert ms.excluded == set()


def test_the_deadline_comes_from_the_healthy_members_step_times_only() -> None:
    mon, _, _ = monitor()
    ms = members("a", "b", "c")
    ms.excluded = {"c"}
    assert mon.deadline_s() == STEP_TIMEOUT_S  # no history yet: the coordinator's bound

    mon.observe(outcome(answer("a", 0.1), answer("b", 0.1), answer("c", 5.0)), 0, ms)

    assert mon.step_times.values() == [0.1, 0.1]  # c sat out: its time is no reference
    assert mon.deadline_s() == pytest.approx(0.2)  # deadline_factor 2 x the median


def test_the_deadline_has_a_floor() -> None:
    mon, _, _ = monitor()

    mon.observe(outcome(answer("a", 0.001)), 0, members("a"))

    assert mon.deadline_s() == DEADLINE_FLOOR_S


def test_backups_drops_rejections_and_late_members_are_counted() -> None:
    # Arrange: a answered; b's gradient was refused; c was cut off after 3 s.
    mon, links, metrics = monitor()
    ms = members("a", "b", "c")
    step = outcome(
        answer("a", 0.5, to=10, back=20),
        backups=2,
        dropped=[3, 4],
        rejected=[("b", 1, "non-finite gradients")],
        late={"c": 3.0},
    )

    # Act
    mon.observe(step, 7, ms)

    # Assert
    assert mon.result_doc() == {
        "rejected_gradients": 1,
        "backup_pieces": 2,
        "dropped_pieces": 2,
        "bytes_to_workers": 10,
        "bytes_from_workers": 20,
    }
    pieces = "neuroshard_train_pieces_total"
    assert [
        sample(metrics, pieces, outcome=o) for o in ("accepted", "backup", "dropped", "rejected")
    ] == [1, 2, 2, 1]
    assert (links.get("b").rejected, links.get("b").steps) == (1, 0)
    c = links.get("c")  # a lower bound of its step time, nothing else
    assert (c.step_s, c.steps, c.bytes_up, c.bytes_down, c.compute_s) == (3.0, 1, 0, 0, 0.0)
    assert mon.step_times.values() == [0.5]  # only answers set the deadline


def test_a_slow_member_is_excluded_with_its_reason_then_readmitted_on_trial() -> None:
    # Arrange: c takes ten times as long as a and b.
    mon, links, _ = monitor(probation_steps=2)
    ms = members("a", "b", "c")

    # Act: step 0.
    mon.observe(outcome(answer("a", 0.1), answer("b", 0.1), answer("c", 1.0)), 0, ms)

    # Assert: health 0.1 / 1.0 < 0.25: c sits out, and status says why.
    assert ms.excluded == {"c"}
    assert links.excluded == {"c": "health 0.10 < 0.25 at step 0 (step 1000 ms)"}
    assert mon.worker_docs(ms)["c"]["excluded"] is True

    # Act / Assert: step 1, c still on probation; step 2, back on trial.
    mon.observe(outcome(answer("a", 0.1), answer("b", 0.1)), 1, ms)
    assert ms.excluded == {"c"}
    mon.observe(outcome(answer("a", 0.1), answer("b", 0.1)), 2, ms)
    assert ms.excluded == set() and links.excluded == {}
    assert mon.exclusion.state("c") == "trial"


def test_the_last_included_member_is_never_excluded() -> None:
    # Arrange: a alone, its gradients rejected three times (health about 1 / 6).
    mon, links, _ = monitor()
    ms = members("a")
    for _ in range(3):
        mon.reject("a", 0, "norm outlier")

    # Act
    mon.observe(outcome(answer("a", 0.1)), 0, ms)

    # Assert
    assert links.health("a") < 0.25
    assert ms.excluded == set() and links.excluded == {}


def test_release_clears_the_jobs_exclusions_from_status() -> None:
    mon, links, _ = monitor()
    ms = members("a", "b", "c")
    mon.observe(outcome(answer("a", 0.1), answer("b", 0.1), answer("c", 1.0)), 0, ms)
    links.excluded["other-job-worker"] = "kept"

    mon.release(ms)

    assert links.excluded == {"other-job-worker": "kept"}


def test_worker_docs_join_the_members_figures_and_their_links() -> None:
    # Arrange: a computed 7 steps of this job (8 rows); its link saw one call.
    mon, _, _ = monitor()
    ms = members("a", "b")
    ms.history["a"].samples, ms.history["a"].steps, ms.history["a"].compute_s = 8, 7, 1.25
    mon.observe(outcome(answer("a", 0.1234567, to=100, back=50), answer("b", 0.2)), 0, ms)

    # Act
    doc = mon.worker_docs(ms)["a"]

    # Assert: the job's steps stay the member's; the link's count is "calls".
    assert (doc["samples"], doc["steps"], doc["compute_s"], doc["calls"]) == (8, 7, 1.25, 1)
    assert doc["step_ms"] == 123.457  # rounded to 3 decimals
    assert (doc["bytes_up"], doc["bytes_down"]) == (50, 100)
    assert (doc["health"], doc["excluded"], doc["excluded_reason"]) == (1.0, False, None)


def test_health_is_judged_against_the_members_computing_not_those_sitting_out() -> None:
    # Arrange: c, d and e sit out, slow (10 s); a1..a3 take 0.1 s and b 0.5 s.
    mon, links, metrics = monitor()
    ms = members("a1", "a2", "a3", "b", "c", "d", "e")
    for n in "cde":
        links.get(n).step_s = 10.0
        mon.exclusion.update(n, 0.0, step=0, others_included=4)
    ms.excluded = {"c", "d", "e"}

    # Act
    mon.observe(
        outcome(answer("a1", 0.1), answer("a2", 0.1), answer("a3", 0.1), answer("b", 0.5)), 1, ms
    )

    # Assert: against the computing members' median (0.1 s) b scores 0.2 and sits out too;
    # counting the slow ones (median 0.5 s) would have found it fine.
    assert ms.excluded == {"b", "c", "d", "e"}
    assert sample(metrics, "neuroshard_worker_health", worker="b") == pytest.approx(0.2)
    assert sample(metrics, "neuroshard_worker_health", worker="c") is None
