"""``convergence_ratio``: a memory job's convergence, with literal values and its edge cases."""

from __future__ import annotations

from shared.memory.stats import EMPTY_QUALITY, Quality, convergence_ratio


def table(mean: float, count: int = 4) -> Quality:
    return Quality(count, mean * count, mean, 0.0, 1.0, (0,) * 10)


def test_the_accessed_mean_over_the_table_mean() -> None:
    assert convergence_ratio(0.8, 3, table(0.4)) == 2.0
    assert convergence_ratio(0.4, 1, table(0.4)) == 1.0  # accesses leave no mark
    assert convergence_ratio(0.1, 2, table(0.4)) == 0.25


def test_no_accessed_memory_is_zero_and_an_all_zero_table_is_one() -> None:
    assert convergence_ratio(0.0, 0, table(0.4)) == 0.0
    assert convergence_ratio(0.0, 0, EMPTY_QUALITY) == 0.0
    assert convergence_ratio(0.0, 5, table(0.0)) == 1.0
