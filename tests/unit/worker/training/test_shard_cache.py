"""The worker's shard cache: entries by key and row range, gaps, pins, LRU, restart."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from shared.training.tasks import DataError
from worker.training.shard_cache import Layout, ShardCache

KEY = "ab" * 20
LAYOUT = [Layout("x", "uint8", (2,)), Layout("y", "int16", ())]


def put(cache: ShardCache, start: int, stop: int, key: str = KEY):
    """Write rows [start, stop): x = [row, row], y = row."""
    rows = np.arange(start, stop)
    w = cache.writer(key, start, stop, LAYOUT)
    x = np.repeat(rows, 2).astype(np.uint8).tobytes()
    w.write("x", 0, x[:3])  # in two chunks
    w.write("x", 3, x[3:])
    w.write("y", 0, rows.astype("<i2").tobytes())
    return w.commit()


def test_entries_are_mapped_back_and_gaps_are_what_no_entry_holds(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", 1 << 20)
    put(cache, 10, 20)
    put(cache, 30, 35)

    (piece,) = cache.pin(cache.covering(KEY, 12, 14))

    assert cache.missing(KEY, 0, 40) == [(0, 10), (20, 30), (35, 40)]
    assert cache.missing(KEY, 12, 18) == []
    assert cache.missing("cd" * 20, 12, 18) == [(12, 18)]
    np.testing.assert_array_equal(piece.arrays["x"].array[:2], [[10, 10], [11, 11]])
    np.testing.assert_array_equal(piece.arrays["y"].array[-1], 19)
    assert stat.S_IMODE(os.stat(cache.root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(piece.path / "x.npy").st_mode) == 0o600


def test_bytes_out_of_order_or_missing_discard_the_entry(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", 1 << 20)
    w = cache.writer(KEY, 0, 4, LAYOUT)
    with pytest.raises(DataError, match="out of order"):
        w.write("x", 2, b"\0\0")
    w.write("x", 0, bytes(8))
    with pytest.raises(DataError, match="array 'y' is incomplete"):
        w.commit()

    assert list(cache.root.iterdir()) == [] and cache.missing(KEY, 0, 4) == [(0, 4)]


def test_least_recently_used_unpinned_entries_go_past_the_bound(tmp_path: Path) -> None:
    # each entry of 10 rows: 2 .npy headers (128 bytes each) + 10 x 4 bytes of data
    cache = ShardCache(tmp_path / "cache", 3 * 296)
    old, pinned, recent = put(cache, 0, 10), put(cache, 10, 20), put(cache, 20, 30)
    os.utime(old.path, ns=(1, 1))
    cache.pin([pinned])
    os.utime(pinned.path, ns=(2, 2))

    put(cache, 30, 40)  # needs room: the oldest unpinned entry goes
    put(cache, 40, 50)  # again: "recent" goes, "pinned" stays though older
    cache.unpin([pinned])  # now it may go too

    names = sorted(p.name for p in cache.root.iterdir())
    assert names == [f"{KEY}-30-40", f"{KEY}-40-50"] or names == [
        f"{KEY}-10-20",
        f"{KEY}-30-40",
        f"{KEY}-40-50",
    ]
    assert old.path.exists() is False and recent.path.exists() is False
    assert cache.used_bytes <= 3 * 296


def test_a_restart_keeps_whole_entries_and_removes_unfinished_ones(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", 1 << 20)
    put(cache, 0, 5)
    w = cache.writer(KEY, 5, 9, LAYOUT)  # a killed process leaves its temporary entry
    for f in w._files.values():
        f.close()

    again = ShardCache(tmp_path / "cache", 1 << 20)

    assert [p.name for p in again.root.iterdir()] == [f"{KEY}-0-5"]
    assert again.missing(KEY, 0, 9) == [(5, 9)]
