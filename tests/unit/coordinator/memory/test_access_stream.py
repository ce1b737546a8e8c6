"""Generated memories and access streams of the memory job: determinism and distribution."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.memory.access_stream import (
    ScrambledZipfStream,
    TraceStream,
    ZipfianGenerator,
    generate_memories,
    zeta,
)


def test_generated_memories_are_distinct_and_seeded() -> None:
    ids, strengths = generate_memories(10_000, seed=4)
    again, _ = generate_memories(10_000, seed=4)
    other, _ = generate_memories(10_000, seed=5)
    assert ids.dtype == np.uint64 and strengths.dtype == np.float32
    assert len(np.unique(ids)) == 10_000
    assert ((strengths >= 0) & (strengths < 1)).all()
    np.testing.assert_array_equal(ids, again)
    assert not np.array_equal(ids, other)


def test_zeta_matches_the_direct_sum() -> None:
    direct = sum(1 / i**0.99 for i in range(1, 10_001))
    assert zeta(10_000, 0.99, chunk=999) == pytest.approx(direct, rel=1e-12)


@pytest.mark.parametrize("items", [1, 2, 3, 1000, 100_000])
def test_zipf_ranks_follow_the_first_two_probabilities(items: int) -> None:
    gen = ZipfianGenerator(items, 0.99, np.random.default_rng(0))
    ranks = gen.ranks(400_000)
    assert ranks.min() >= 0 and ranks.max() < items
    # Gray et al. give ranks 0 and 1 their exact Zipf probabilities: 1/zeta, 0.5**theta/zeta.
    assert (ranks == 0).mean() == pytest.approx(1 / gen.zetan, abs=3e-3)
    if items > 1:
        assert (ranks == 1).mean() == pytest.approx(0.5**0.99 / gen.zetan, abs=3e-3)


def test_zipf_needs_theta_below_one() -> None:
    with pytest.raises(ValueError, match="0 < theta < 1"):
        ZipfianGenerator(10, 1.0, np.random.default_rng(0))


def test_scrambled_stream_is_seeded_and_scatters_the_hot_ids() -> None:
    ids = np.arange(10_000, dtype=np.uint64)
    a = ScrambledZipfStream(ids, 0.99, 5_000, seed=1)
    b = ScrambledZipfStream(ids, 0.99, 5_000, seed=1)
    batches = [a.next_batch(i) for i in range(3)]
    for i, batch in enumerate(batches):
        np.testing.assert_array_equal(batch, b.next_batch(i))
        assert batch.dtype == np.uint64 and len(batch) == 5_000
    hottest = np.bincount(np.concatenate(batches).astype(np.int64)).argmax()
    assert hottest == a.by_rank[0] != 0  # rank 0 is a random id, not the smallest


def test_trace_stream_replays_rows_or_reuses_one() -> None:
    rows = TraceStream(np.arange(6, dtype=np.uint64).reshape(3, 2))
    one = TraceStream(np.arange(4, dtype=np.uint64).reshape(1, 4))
    assert rows.batch == 2 and rows.next_batch(2).tolist() == [4, 5]
    assert one.batch == 4 and one.next_batch(7).tolist() == [0, 1, 2, 3]
