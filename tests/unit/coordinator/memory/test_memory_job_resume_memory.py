"""A resumed memory job skips the batches drawn before in O(batch) memory (issue 19, #16)."""

from __future__ import annotations

import tracemalloc

import numpy as np

from coordinator.memory.access_stream import ScrambledZipfStream
from coordinator.memory.memory_job import skip_batches


def test_skipping_earlier_batches_holds_one_batch_at_a_time() -> None:
    batch, resumed_at = 100_000, 200  # 800 KB a batch; holding them all would be 160 MB
    ids = np.arange(1, 10_001, dtype=np.uint64)
    stream = ScrambledZipfStream(ids, 0.99, batch, seed=3)
    reference = ScrambledZipfStream(ids, 0.99, batch, seed=3)

    tracemalloc.start()
    try:
        skip_batches(stream, resumed_at)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert peak < 8 * batch * 8  # a few batches' worth, not resumed_at of them
    for i in range(resumed_at):  # the stream continues where the skipped run left it
        reference.next_batch(i)
    np.testing.assert_array_equal(stream.next_batch(resumed_at), reference.next_batch(resumed_at))
