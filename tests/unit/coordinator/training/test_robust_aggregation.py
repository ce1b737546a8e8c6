"""Rejection of non-finite and outlier gradients; trimmed mean and median against hand values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from coordinator.training.aggregation import weighted_average
from coordinator.training.robust_aggregation import (
    aggregate,
    global_norm,
    nonfinite_names,
    norm_outliers,
)


def per_worker(columns: list[list[float]]) -> list[dict[str, np.ndarray]]:
    """Gradients {"w": [len(columns)]} per worker; columns[j][w] is worker w's coordinate j."""
    rows = np.asarray(columns, np.float32).T
    return [{"w": row.copy()} for row in rows]


# Two coordinates, five workers; the expected values below are worked out by hand.
COLUMNS = [[1.0, 2.0, 3.0, 4.0, 100.0], [10.0, -5.0, 0.0, 7.0, 3.0]]


def test_nonfinite_names_lists_nan_and_inf_in_dict_order() -> None:
    grads = {
        "ok": np.ones(3, np.float32),
        "nan": np.array([0.0, np.nan], np.float32),
        "inf": np.array([[-np.inf]], np.float32),
    }

    assert nonfinite_names(grads) == ["nan", "inf"]
    assert nonfinite_names({"ok": np.zeros(2, np.float32)}) == []


def test_global_norm_spans_every_tensor() -> None:
    grads = {"a": np.array([3.0], np.float32), "b": np.array([[4.0]], np.float32)}

    assert global_norm(grads) == 5.0
    assert global_norm({}) == 0.0


def test_global_norm_accumulates_in_float64() -> None:
    # 1e20 ** 2 overflows float32 (max ~3.4e38) but not float64.
    grads = {"a": np.array([1e20, 1e20], np.float32)}

    assert global_norm(grads) == pytest.approx(math.sqrt(2) * 1e20, rel=1e-6)


def test_global_norm_is_not_finite_for_nonfinite_gradients() -> None:
    assert math.isinf(global_norm({"a": np.array([1.0, np.inf], np.float32)}))


@pytest.mark.parametrize(
    ("norms", "expected"),
    [
        ([1.0, 1.2, 0.9, 50.0], [3]),  # median 1.1: 50 > 10 * 1.1
        ([1.0, 1.0, 1.0, 0.05], [3]),  # 0.05 < 1 / 10
        ([1.0, 10.9, 0.11], [1]),  # median 1.0: 10.9 > 10, 0.11 >= 0.1 stays
        ([1.0, 2.0, 3.0], []),
        ([1.0, 1.0, math.inf], [2]),
        ([1.0, 1e9], []),  # two workers: no majority, nothing rejected
        ([1e9], []),
        ([], []),
    ],
)
def test_norm_outliers(norms: list[float], expected: list[int]) -> None:
    assert norm_outliers(norms, max_ratio=10.0) == expected


@pytest.mark.parametrize("ratio", [1.0, 0.5, math.inf, math.nan])
def test_norm_outliers_rejects_a_ratio_that_is_not_above_one(ratio: float) -> None:
    with pytest.raises(ValueError, match="max_ratio"):
        norm_outliers([1.0, 1.0, 1.0], ratio)


def test_norm_outliers_rejects_negative_norms() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        norm_outliers([1.0, -1.0, 1.0], 10.0)


def test_trimmed_mean_equal_weights_by_hand() -> None:
    # trim 0.2 of W=5: k=1. Column 0 drops 1 and 100 -> (2+3+4)/3; column 1 drops -5 and 10
    # -> (0+3+7)/3.
    out = aggregate(per_worker(COLUMNS), [1] * 5, "trimmed_mean", trim=0.2)

    assert out["w"].dtype == np.float32
    np.testing.assert_allclose(out["w"], [3.0, 10.0 / 3.0], rtol=1e-7)


def test_trimmed_mean_removes_values_with_their_weights_by_hand() -> None:
    # Weights 1..5. Column 0 keeps 2,3,4 with weights 2,3,4: 29/9. Column 1 sorted is
    # -5(w2) 0(w3) 3(w5) 7(w4) 10(w1); keeps 0,3,7 with weights 3,5,4: 43/12.
    out = aggregate(per_worker(COLUMNS), [1, 2, 3, 4, 5], "trimmed_mean", trim=0.2)

    np.testing.assert_allclose(out["w"], [29.0 / 9.0, 43.0 / 12.0], rtol=1e-7)


def test_trimmed_mean_with_zero_trim_is_the_weighted_mean() -> None:
    rng = np.random.default_rng(0)
    grads = [
        {
            "a": rng.normal(size=(3, 4)).astype(np.float32),
            "b": rng.normal(size=5).astype(np.float32),
        }
        for _ in range(4)
    ]
    samples = [3, 7, 1, 5]

    out = aggregate(grads, samples, "trimmed_mean", trim=0.0)
    reference = weighted_average(grads, samples)

    for name in reference:
        np.testing.assert_allclose(out[name], reference[name], rtol=1e-6, atol=1e-7)
    # and by hand: values 1, 2, 3 with weights 1, 1, 2 -> 9 / 4
    hand = aggregate(per_worker([[1.0, 2.0, 3.0]]), [1, 1, 2], "trimmed_mean", 0.0)
    np.testing.assert_array_equal(hand["w"], [2.25])


def test_median_equal_weights_is_numpy_median() -> None:
    out = aggregate(per_worker(COLUMNS), [2] * 5, "median")
    even = aggregate(per_worker([[1.0, 2.0, 3.0, 10.0]]), [1] * 4, "median")

    np.testing.assert_array_equal(out["w"], [3.0, 3.0])
    np.testing.assert_array_equal(even["w"], [2.5])


def test_weighted_median_by_hand() -> None:
    # Weights 1..5, total 15, half 7.5. Column 0 cumulative 1,3,6,10 -> 4.0. Column 1 sorted
    # -5(w2) 0(w3) 3(w5): cumulative 2,5,10 -> 3.0.
    out = aggregate(per_worker(COLUMNS), [1, 2, 3, 4, 5], "median")

    np.testing.assert_array_equal(out["w"], [4.0, 3.0])


@pytest.mark.parametrize(
    ("method", "expected"),
    [("trimmed_mean", 3.1 / 3.0), ("median", 1.0)],  # trimmed: drops 0.9 and 1e6
)
def test_robust_methods_ignore_one_byzantine_worker(method: str, expected: float) -> None:
    honest = [{"w": np.full(3, v, np.float32)} for v in (0.9, 1.0, 1.1, 1.0)]
    byzantine = {"w": np.full(3, 1e6, np.float32)}

    robust = aggregate([*honest, byzantine], [1] * 5, method, trim=0.2)  # type: ignore[arg-type]
    mean = aggregate([*honest, byzantine], [1] * 5, "mean")

    np.testing.assert_allclose(robust["w"], np.full(3, expected), rtol=1e-6)
    assert mean["w"][0] > 1e5


@pytest.mark.parametrize("method", ["mean", "trimmed_mean", "median"])
def test_one_worker_is_returned_as_is(method: str) -> None:
    grads = [{"w": np.array([[1.5, -2.0]], np.float32)}]

    out = aggregate(grads, [7], method, trim=0.4)  # type: ignore[arg-type]

    assert out["w"].shape == (1, 2)
    np.testing.assert_array_equal(out["w"], [[1.5, -2.0]])


def test_two_workers_trimmed_mean_trims_nothing() -> None:
    out = aggregate(per_worker([[1.0, 4.0]]), [1, 3], "trimmed_mean", trim=0.49)

    np.testing.assert_array_equal(out["w"], [3.25])  # (1*1 + 3*4) / 4


def test_two_workers_median_is_the_mean_or_the_heavier_worker() -> None:
    equal = aggregate(per_worker([[1.0, 4.0]]), [2, 2], "median")
    heavier_low = aggregate(per_worker([[1.0, 4.0]]), [3, 1], "median")
    heavier_high = aggregate(per_worker([[1.0, 4.0]]), [1, 3], "median")

    np.testing.assert_array_equal(equal["w"], [2.5])
    np.testing.assert_array_equal(heavier_low["w"], [1.0])
    np.testing.assert_array_equal(heavier_high["w"], [4.0])


@pytest.mark.parametrize("method", ["trimmed_mean", "median"])
def test_workers_without_samples_are_left_out(method: str) -> None:
    # The empty worker's 1e6 would be the median's middle value if it counted; with trim 0.34
    # of 3 workers k would be 1, of the 2 that count it is 0.
    grads = per_worker([[1.0, 1e6, 3.0]])

    out = aggregate(grads, [1, 0, 1], method, trim=0.34)  # type: ignore[arg-type]

    np.testing.assert_array_equal(out["w"], [2.0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "mode"}, "unknown aggregation method"),
        ({"trim": 0.5}, "trim"),
        ({"trim": -0.1}, "trim"),
        ({"samples": [1, 1]}, "3 gradient sets but 2 sample counts"),
        ({"samples": [1, -1, 1]}, ">= 0"),
        ({"samples": [0, 0, 0]}, "0 samples"),
    ],
)
def test_aggregate_errors(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "grads": per_worker([[1.0, 2.0, 3.0]]),
        "samples": [1, 1, 1],
        "method": "median",
        "trim": 0.1,
    }
    with pytest.raises(ValueError, match=match):
        aggregate(**(args | kwargs))  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["trimmed_mean", "median"])
def test_aggregate_names_a_mismatched_parameter(method: str) -> None:
    grads = [{"w": np.zeros(2, np.float32)}, {"w": np.zeros(3, np.float32)}]

    with pytest.raises(ValueError, match="'w'"):
        aggregate(grads, [1, 1], method)  # type: ignore[arg-type]
