"""shared/rpc/chunking.py: byte budgets per message, payloads counted, every item once."""

from __future__ import annotations

import numpy as np

from shared.rpc.chunking import byte_ranges, memory_sizes


def test_ranges_fit_the_budget_and_a_big_item_goes_alone() -> None:
    sizes = np.array([12, 12, 12, 5012, 22, 12, 12, 12, 112, 12], np.int64)

    ranges = byte_ranges(sizes, 1000)

    assert ranges == [(0, 3), (3, 4), (4, 10)]


def test_an_item_limit_cuts_too_and_nothing_is_no_range() -> None:
    assert byte_ranges(np.full(5, 12, np.int64), 10**6, max_items=2) == [(0, 2), (2, 4), (4, 5)]
    assert byte_ranges(np.empty(0, np.int64), 100) == []


def test_memory_sizes_count_payloads() -> None:
    ids = np.array([7, 3, 9], np.uint64)

    sizes = memory_sizes(ids, {3: b"abc", 9: b""})

    assert sizes.tolist() == [12, 15, 12]
    assert memory_sizes(ids, None).tolist() == [12, 12, 12]
