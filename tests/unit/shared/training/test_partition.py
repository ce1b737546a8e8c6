"""The rows of an allreduce epoch: each trained on exactly once, whatever the world sizes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.config import TrainJobSpec
from shared.training.partition import (
    allreduce_steps_per_epoch,
    allreduce_total_steps,
    global_batch_size,
    global_rows,
    micro_batches,
    rank_rows,
)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 500),
    g=st.integers(1, 64),
    worlds=st.lists(st.integers(1, 5), min_size=1, max_size=40),
    k=st.integers(1, 4),
)
def test_an_epoch_trains_each_row_once_when_the_world_changes(n, g, worlds, k) -> None:
    # Arrange: the world size of each step of the epoch (cycled), as generations come and go.
    per_epoch = allreduce_steps_per_epoch(n, g)
    seen: list[int] = []
    # Act
    for s in range(per_epoch):
        world = worlds[s % len(worlds)]
        rows = global_rows(n, g, seed=3, epoch=1, step_in_epoch=s)
        for rank in range(world):
            for part in micro_batches(rank_rows(rows, rank, world), k):
                seen.extend(part.tolist())
    # Assert
    assert sorted(seen) == list(range(n))


def test_rows_are_pinned() -> None:
    # Literal values: a change of the permutation would move every job's batches.
    rows = global_rows(10, 4, seed=0, epoch=0, step_in_epoch=0)
    assert rows.dtype == np.int64
    assert rows.tolist() == np.random.default_rng((0, 0, 7)).permutation(10)[:4].tolist()
    assert rank_rows(np.arange(7), 0, 3).tolist() == [0, 1, 2]
    assert rank_rows(np.arange(7), 2, 3).tolist() == [5, 6]
    assert global_rows(10, 4, 0, 0, 3).tolist() == []


def test_rank_outside_world_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 3 is outside"):
        rank_rows(np.arange(4), 3, 3)


def test_step_counts_follow_the_global_batch() -> None:
    spec = TrainJobSpec(kind="train", workers=3, batch_size=16, grad_accum_steps=2, epochs=2)
    assert global_batch_size(spec) == 96
    assert allreduce_steps_per_epoch(1437, 96) == 15
    assert allreduce_total_steps(spec, 1437) == 30
    assert allreduce_total_steps(spec.model_copy(update={"steps": 7}), 1437) == 7
