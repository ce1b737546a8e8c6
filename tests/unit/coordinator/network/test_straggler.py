"""Step deadlines (median and MAD), proportional batch shares, and exclusion with probation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.network.straggler import Exclusion, StepTimes, proportional_shares, step_deadline_s

# --- step_deadline_s -----------------------------------------------------------------------


def test_deadline_without_history_is_the_cap() -> None:
    assert step_deadline_s([], factor=3.0, floor_s=0.5, cap_s=30.0) == 30.0


def test_deadline_of_steady_steps_is_the_multiple_of_the_median() -> None:
    # median 1.0, MAD 0 -> max(3 * 1.0, 1.0 + 0) = 3.0
    assert step_deadline_s([1.0, 1.0, 1.0, 1.0], 3.0, 0.1, 30.0) == 3.0


def test_deadline_of_jittery_steps_adds_three_scaled_mads() -> None:
    # median 2.0; |t - m| = 1, 1, 0, 1, 1 -> MAD 1.0; 2 + 3 * 1.4826 * 1 = 6.4478 > 1.5 * 2
    times = [1.0, 3.0, 2.0, 1.0, 3.0]

    assert step_deadline_s(times, 1.5, 0.1, 30.0) == pytest.approx(6.4478)


def test_deadline_ignores_a_minority_of_stragglers() -> None:
    times = [1.0] * 15 + [25.0] * 5  # MAD 0 while fewer than half are slow

    assert step_deadline_s(times, 2.0, 0.1, 30.0) == 2.0


@pytest.mark.parametrize(
    ("times", "expected"),
    [([0.01, 0.01], 0.5), ([50.0, 50.0], 30.0)],  # floor, cap
)
def test_deadline_is_clamped(times: list[float], expected: float) -> None:
    assert step_deadline_s(times, 2.0, 0.5, 30.0) == expected


@pytest.mark.parametrize(
    ("times", "factor", "floor_s", "cap_s"),
    [
        ([1.0], 0.5, 0.1, 30.0),
        ([1.0], math.nan, 0.1, 30.0),
        ([1.0], 2.0, -1.0, 30.0),
        ([1.0], 2.0, 5.0, 1.0),
        ([1.0], 2.0, 0.1, math.inf),
        ([1.0, -1.0], 2.0, 0.1, 30.0),
        ([1.0, math.nan], 2.0, 0.1, 30.0),
    ],
)
def test_deadline_rejects_bad_arguments(
    times: list[float], factor: float, floor_s: float, cap_s: float
) -> None:
    with pytest.raises(ValueError):
        step_deadline_s(times, factor, floor_s, cap_s)


def test_step_times_keep_the_last_window() -> None:
    window = StepTimes(size=3)
    for t in (1.0, 2.0, 3.0, 4.0):
        window.add(t)

    assert window.values() == [2.0, 3.0, 4.0]
    assert len(window) == 3
    with pytest.raises(ValueError, match="step_s"):
        window.add(-0.1)
    with pytest.raises(ValueError, match="size"):
        StepTimes(size=0)


# --- proportional_shares -------------------------------------------------------------------


def test_shares_follow_the_rates_by_hand() -> None:
    # quotas 100 * 1/6, 2/6, 3/6 = 16.67, 33.33, 50: floors 16, 33, 50, one row left to the
    # largest remainder (a: 0.67).
    assert proportional_shares(100, {"a": 10.0, "b": 20.0, "c": 30.0}) == {
        "a": 17,
        "b": 33,
        "c": 50,
    }


def test_equal_rates_split_like_numpy_array_split_in_name_order() -> None:
    shares = proportional_shares(10, {"w2": 5.0, "w0": 5.0, "w1": 5.0})

    assert list(shares) == ["w0", "w1", "w2"]
    assert list(shares.values()) == [4, 3, 3]


def test_unmeasured_rates_count_as_the_median_of_the_measured() -> None:
    # None, 0 and NaN become median(10, 30) = 20: rates 10, 30, 20, 20, 20 over 100 rows
    rates = {"a": 10.0, "b": 30.0, "c": None, "d": 0.0, "e": math.nan}

    assert proportional_shares(100, rates) == {"a": 10, "b": 30, "c": 20, "d": 20, "e": 20}


def test_no_measured_rate_gives_equal_shares() -> None:
    assert proportional_shares(7, {"a": None, "b": 0.0}) == {"a": 4, "b": 3}


def test_a_very_slow_worker_still_gets_one_row() -> None:
    shares = proportional_shares(10, {"fast": 1000.0, "slow": 0.001, "mid": 500.0})

    assert shares["slow"] == 1
    assert sum(shares.values()) == 10


def test_fewer_rows_than_workers_may_leave_some_without_rows() -> None:
    assert proportional_shares(2, {"a": 1.0, "b": 1.0, "c": 1.0}) == {"a": 1, "b": 1, "c": 0}
    assert proportional_shares(0, {"a": 1.0}) == {"a": 0}
    assert proportional_shares(0, {}) == {}


@pytest.mark.parametrize(
    ("total", "rates"),
    [(-1, {"a": 1.0}), (5, {"a": -1.0}), (5, {"a": math.inf}), (5, {})],
)
def test_shares_reject_bad_arguments(total: int, rates: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        proportional_shares(total, rates)


rate_values = st.one_of(
    st.none(), st.just(0.0), st.just(math.nan), st.floats(1e-3, 1e6, allow_nan=False)
)
rate_maps = st.dictionaries(st.text("abcdefgh", min_size=1, max_size=3), rate_values, min_size=1)


@given(total=st.integers(0, 5000), rates=rate_maps)
def test_shares_always_sum_exactly(total: int, rates: dict[str, float | None]) -> None:
    shares = proportional_shares(total, rates)

    assert set(shares) == set(rates)
    assert sum(shares.values()) == total
    assert all(v >= 0 for v in shares.values())
    if total >= len(rates):
        assert all(v >= 1 for v in shares.values())


@given(
    total=st.integers(0, 5000),
    rates=st.dictionaries(
        st.text("abcdefgh", min_size=1, max_size=3), st.floats(1e-3, 1e6), min_size=1
    ),
)
def test_a_faster_worker_never_gets_fewer_rows(total: int, rates: dict[str, float]) -> None:
    shares = proportional_shares(total, rates)

    for a in rates:
        for b in rates:
            if rates[a] > rates[b]:
                assert shares[a] >= shares[b]


@given(total=st.integers(0, 5000), workers=st.integers(1, 12), rate=st.floats(1e-3, 1e6))
def test_equal_rates_always_match_array_split(total: int, workers: int, rate: float) -> None:
    names = [f"w{i:02d}" for i in range(workers)]

    shares = proportional_shares(total, dict.fromkeys(names, rate))

    expected = [len(part) for part in np.array_split(np.arange(total), workers)]
    assert [shares[n] for n in names] == expected


# --- Exclusion -----------------------------------------------------------------------------


def test_low_health_excludes_with_a_reason_built_from_the_detail() -> None:
    ex = Exclusion(threshold=0.3, probation_steps=5, trial_steps=3)

    assert ex.update("w1", 0.9, step=39, others_included=2) is None
    event = ex.update("w1", 0.12, 40, 2, detail="rtt 210 ms, 3 rejected gradients")

    assert event == "excluded"
    assert ex.excluded("w1") and ex.state("w1") == "excluded"
    assert ex.reason("w1") == "health 0.12 < 0.30 at step 40 (rtt 210 ms, 3 rejected gradients)"
    assert ex.excluded_reasons() == {"w1": ex.reason("w1")}


def test_the_last_included_worker_is_never_excluded() -> None:
    ex = Exclusion(threshold=0.3)

    assert ex.update("only", 0.0, 1, others_included=0) is None
    assert not ex.excluded("only") and ex.reason("only") is None


def run(ex: Exclusion, name: str, health: float, steps: range) -> dict[int, str]:
    """Update one worker at each step with a fixed health; the events by step."""
    events = {}
    for step in steps:
        event = ex.update(name, health, step, others_included=1)
        if event is not None:
            events[step] = event
    return events


def test_probation_then_trial_then_readmission_for_good() -> None:
    ex = Exclusion(threshold=0.3, probation_steps=5, trial_steps=3)
    assert run(ex, "w", 0.1, range(10, 11)) == {10: "excluded"}

    # excluded for steps 10..14 whatever its health; back on trial at 15
    assert run(ex, "w", 0.9, range(11, 15)) == {}
    assert ex.excluded("w")
    assert run(ex, "w", 0.1, range(15, 16)) == {15: "readmitted"}
    assert ex.state("w") == "trial" and not ex.excluded("w") and ex.reason("w") is None

    # low health is tolerated during the 3 trial steps, healthy at the end: included
    assert run(ex, "w", 0.1, range(16, 18)) == {}
    assert run(ex, "w", 0.8, range(18, 19)) == {}
    assert ex.state("w") == "included"

    # its probation was reset: a later exclusion lasts 5 steps again
    assert run(ex, "w", 0.1, range(30, 36)) == {30: "excluded", 35: "readmitted"}


def test_a_failed_trial_doubles_the_probation() -> None:
    ex = Exclusion(threshold=0.3, probation_steps=5, trial_steps=3)

    events = run(ex, "w", 0.1, range(0, 40))

    # excluded 0, readmitted 5, still low at 5 + 3 = 8: excluded for 10 -> 18, trial to 21,
    # excluded for 20 -> 41
    assert events == {
        0: "excluded",
        5: "readmitted",
        8: "excluded",
        18: "readmitted",
        21: "excluded",
    }
    assert ex.reason("w") == "health 0.10 < 0.30 at step 21"


def test_a_worker_on_trial_is_not_excluded_while_it_is_the_only_one() -> None:
    ex = Exclusion(threshold=0.3, probation_steps=2, trial_steps=1)
    run(ex, "w", 0.1, range(0, 3))  # excluded 0, readmitted 2
    assert ex.state("w") == "trial"

    assert ex.update("w", 0.1, 3, others_included=0) is None
    assert ex.state("w") == "trial"
    assert ex.update("w", 0.1, 4, others_included=1) == "excluded"


def test_forget_and_unknown_workers() -> None:
    ex = Exclusion()
    ex.update("w", 0.0, 0, 1)

    ex.forget("w")
    ex.forget("never-seen")

    assert ex.state("w") == "included" and ex.reason("w") is None


@pytest.mark.parametrize("kwargs", [{"threshold": 1.5}, {"probation_steps": 0}, {"trial_steps": 0}])
def test_exclusion_rejects_bad_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Exclusion(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("health", "others"), [(1.5, 1), (math.nan, 1), (0.5, -1)])
def test_update_rejects_bad_arguments(health: float, others: int) -> None:
    with pytest.raises(ValueError):
        Exclusion().update("w", health, 0, others)
