"""Per-worker telemetry: EWMA arithmetic, step accounting, the health score and its document."""

from __future__ import annotations

import json
import math

import pytest

from coordinator.network.link_stats import LinkStats, WorkerLink, ewma, health

DOC_KEYS = {
    "rtt_ms",
    "bandwidth_mbit",
    "step_ms",
    "compute_ms",
    "transfer_ms",
    "samples_per_s",
    "steps",
    "failures",
    "rejected",
    "bytes_up",
    "bytes_down",
    "health",
    "excluded",
    "excluded_reason",
}


def test_ewma_starts_at_the_first_sample_then_weights_by_alpha() -> None:
    assert ewma(None, 4.0, 0.3) == 4.0
    assert ewma(1.0, 2.0, 0.3) == pytest.approx(1.3)  # 0.3 * 2 + 0.7 * 1


def test_rtt_is_smoothed_with_the_constructor_alpha() -> None:
    link = WorkerLink(alpha=0.5)

    link.observe_rtt(1.0)
    link.observe_rtt(3.0)

    assert link.rtt_s == 2.0
    link.observe_rtt(2.0)
    assert link.rtt_s == 2.0


def test_observe_step_derives_transfer_bandwidth_and_throughput() -> None:
    link = WorkerLink()

    link.observe_step(wall_s=0.5, compute_s=0.3, bytes_up=1000, bytes_down=3000, samples=50)

    assert link.step_s == 0.5
    assert link.compute_s == 0.3
    assert link.transfer_s == pytest.approx(0.2)
    assert link.bandwidth_bps == pytest.approx(20_000.0)  # 4000 bytes / 0.2 s
    assert link.samples_per_s == 100.0  # 50 rows / 0.5 s
    assert (link.steps, link.bytes_up, link.bytes_down) == (1, 1000, 3000)


def test_compute_longer_than_wall_clamps_transfer_and_skips_bandwidth() -> None:
    link = WorkerLink()

    link.observe_step(wall_s=0.2, compute_s=0.25, bytes_up=10, bytes_down=10, samples=0)

    assert link.transfer_s == 0.0
    assert link.bandwidth_bps is None
    assert link.samples_per_s is None  # an empty shard says nothing about throughput


@pytest.mark.parametrize(
    "kwargs",
    [
        {"wall_s": -1.0},
        {"wall_s": math.nan},
        {"compute_s": math.inf},
        {"bytes_up": -1},
        {"samples": -5},
    ],
)
def test_observe_step_rejects_bad_values_and_records_nothing(kwargs: dict[str, float]) -> None:
    link = WorkerLink()
    args = {"wall_s": 1.0, "compute_s": 0.5, "bytes_up": 1, "bytes_down": 1, "samples": 1}

    with pytest.raises(ValueError, match=next(iter(kwargs))):
        link.observe_step(**(args | kwargs))  # type: ignore[arg-type]
    assert link.steps == 0 and link.step_s is None


@pytest.mark.parametrize(("alpha", "decay"), [(0.0, 0.9), (1.5, 0.9), (0.3, 1.0), (0.3, -0.1)])
def test_constructor_rejects_alpha_or_decay_out_of_range(alpha: float, decay: float) -> None:
    with pytest.raises(ValueError, match="alpha|decay"):
        WorkerLink(alpha, decay)
    with pytest.raises(ValueError, match="alpha|decay"):
        LinkStats(alpha, decay)


def test_health_is_one_when_nothing_is_known() -> None:
    assert health(WorkerLink(), None) == 1.0
    assert health(WorkerLink(), 0.5) == 1.0


def test_health_by_hand() -> None:
    link = WorkerLink()
    link.observe_step(2.0, 1.0, 0, 0, 1)
    link.observe_failure()
    link.observe_rejected()

    # speed 1.0 / 2.0, reliability 1 / (1 + 1), integrity 1 / (1 + 2 * 1)
    assert health(link, median_step_s=1.0) == pytest.approx(0.5 * 0.5 / 3)


def test_health_is_lower_for_a_slower_worker_and_capped_for_a_faster_one() -> None:
    fast, slow, slower = WorkerLink(), WorkerLink(), WorkerLink()
    fast.observe_step(0.5, 0.1, 0, 0, 1)
    slow.observe_step(2.0, 0.1, 0, 0, 1)
    slower.observe_step(4.0, 0.1, 0, 0, 1)

    assert health(fast, 1.0) == 1.0
    assert health(slow, 1.0) == 0.5
    assert health(slower, 1.0) == 0.25


def test_a_failure_and_a_rejection_lower_health() -> None:
    link = WorkerLink()
    before = health(link, None)

    link.observe_failure()
    after_failure = health(link, None)
    link.observe_rejected()
    after_rejection = health(link, None)

    assert before > after_failure > after_rejection
    assert (link.failures, link.rejected) == (1, 1)


def test_health_recovers_step_by_step_after_trouble() -> None:
    link = WorkerLink(decay=0.9)
    link.observe_failure()
    link.observe_rejected()
    scores = [health(link, None)]

    for _ in range(30):
        link.observe_step(1.0, 0.5, 0, 0, 1)
        scores.append(health(link, None))

    assert all(b > a for a, b in zip(scores, scores[1:], strict=False))
    # after 10 steps: 1 / (1 + 0.9**10) * 1 / (1 + 2 * 0.9**10)
    assert scores[10] == pytest.approx(1 / (1 + 0.9**10) / (1 + 2 * 0.9**10))
    assert scores[-1] > 0.88  # 1 / (1 + 0.9**30) / (1 + 2 * 0.9**30) = 0.884
    assert link.failures == 1  # the totals do not decay


def test_describe_names_what_was_measured() -> None:
    link = WorkerLink()
    assert link.describe() == ""

    link.observe_rtt(0.21)
    link.observe_rejected()
    link.observe_rejected()
    link.observe_rejected()

    assert link.describe() == "rtt 210 ms, 3 rejected gradients"


def test_to_doc_uses_none_for_unmeasured_and_is_strict_json() -> None:
    doc = WorkerLink().to_doc()

    assert set(doc) == DOC_KEYS
    assert doc["rtt_ms"] is None and doc["bandwidth_mbit"] is None and doc["step_ms"] is None
    assert doc["health"] == 1.0 and doc["excluded"] is False and doc["excluded_reason"] is None
    json.dumps(doc, allow_nan=False)


def test_to_doc_units() -> None:
    link = WorkerLink()
    link.observe_rtt(0.25)
    link.observe_step(wall_s=0.5, compute_s=0.25, bytes_up=1_000_000, bytes_down=0, samples=10)

    doc = link.to_doc(median_step_s=0.25, excluded=True, excluded_reason="slow")

    assert doc["rtt_ms"] == 250.0
    assert doc["step_ms"] == 500.0 and doc["compute_ms"] == 250.0 and doc["transfer_ms"] == 250.0
    assert doc["bandwidth_mbit"] == pytest.approx(32.0)  # 4e6 bytes/s * 8 bits / 1e6
    assert doc["samples_per_s"] == 20.0
    assert doc["health"] == 0.5
    assert (doc["excluded"], doc["excluded_reason"]) == (True, "slow")
    json.dumps(doc, allow_nan=False)


def test_link_stats_creates_on_get_and_keeps_one_link_per_name() -> None:
    stats = LinkStats(alpha=0.5)

    a = stats.get("a")
    a.observe_rtt(1.0)

    assert stats.get("a") is a and a.alpha == 0.5
    assert "a" in stats and "b" not in stats and len(stats) == 1
    stats.remove("a")
    stats.remove("never-seen")
    assert list(stats) == []


def test_link_stats_median_and_health_against_the_healthy_workers() -> None:
    stats = LinkStats()
    for name, step_s in (("a", 1.0), ("b", 2.0), ("c", 3.0), ("d", 10.0)):
        stats.get(name).observe_step(step_s, 0.1, 0, 0, 1)
    stats.get("idle")  # no steps yet: not in the median

    assert stats.median_step_s() == 2.5
    assert stats.median_step_s(["a", "b", "c"]) == 2.0
    assert stats.median_step_s(["idle", "unknown"]) is None
    assert stats.health("d", healthy=["a", "b", "c"]) == 0.2


def test_link_stats_to_doc_marks_excluded_workers_and_leaves_them_out_of_the_median() -> None:
    stats = LinkStats()
    stats.get("a").observe_step(1.0, 0.1, 0, 0, 1)
    stats.get("b").observe_step(1.0, 0.1, 0, 0, 1)
    stats.get("slow").observe_step(4.0, 0.1, 0, 0, 1)

    docs = stats.to_doc(excluded={"slow": "health 0.25 < 0.30 at step 3"})

    assert set(docs) == {"a", "b", "slow"}
    assert docs["slow"]["excluded"] is True
    assert docs["slow"]["excluded_reason"] == "health 0.25 < 0.30 at step 3"
    assert docs["slow"]["health"] == 0.25  # against the median 1.0 of a and b
    assert docs["a"]["excluded"] is False and docs["a"]["health"] == 1.0
    json.dumps(docs, allow_nan=False)
