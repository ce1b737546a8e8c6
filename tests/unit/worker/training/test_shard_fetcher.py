"""ShardFetcher: a shard's header first, then only the rows its cache lacks; a full cache does
not lose the entries a fetch counts on. The coordinator's FetchShard is a stand-in."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np

from shared.proto import coordinator_pb2
from shared.rpc.codec import block_to_chunks
from worker.training.shard_cache import ShardCache
from worker.training.shards import ShardFetcher

X = np.arange(40, dtype=np.uint8).reshape(20, 2)  # 20 training rows, as stored
Y = (np.arange(20) % 3).astype(np.int16)
KEY = "ab" * 20


class Coordinator:
    """FetchShard of one job: 20 rows in shards of ``shard_bounds``; records the ranges sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int]] = []

    def FetchShard(self, request, timeout: float) -> AsyncIterator[coordinator_pb2.ShardChunk]:  # noqa: N802
        return self._stream(request)

    async def _stream(self, request) -> AsyncIterator[coordinator_pb2.ShardChunk]:
        lo, hi = (0, 10) if request.shard_index == 0 else (10, 20)
        if request.shard_count == 1:
            lo, hi = 0, 20
        a, b = (request.start, request.stop) if request.stop else (lo, hi)
        count = 0 if request.header_only else b - a
        yield coordinator_pb2.ShardChunk(
            header=coordinator_pb2.ShardHeader(
                n_train=20,
                input_shape=[2],
                num_classes=3,
                start=lo,
                stop=hi,
                data_key=KEY,
                arrays=[
                    coordinator_pb2.ShardArray(name="x", dtype="uint8", row_shape=[2]),
                    coordinator_pb2.ShardArray(name="y", dtype="int16", row_shape=[]),
                ],
                rows_start=a,
                rows_stop=a + count,
                task="classification",
            )
        )
        if count:
            self.sent.append((a, b))
            for name, arr in (("x", X[a:b]), ("y", Y[a:b])):
                for chunk in block_to_chunks(name, arr, arr.shape, 0, 7):
                    yield coordinator_pb2.ShardChunk(rows=chunk)


async def test_only_the_rows_the_cache_lacks_are_fetched_and_converted_per_batch(
    tmp_path: Path,
) -> None:
    # Arrange: a cache bounded to one shard's entry (296 bytes), holding shard 0 already
    coordinator = Coordinator()
    cache = ShardCache(tmp_path / "cache", 300)  # one entry: 2 headers + 10 rows of 4 bytes
    fetcher = ShardFetcher(coordinator, "w0", 5.0, cache)  # type: ignore[arg-type]
    first, _ = await fetcher.fetch("j1", (0, 2))
    first.close()

    # Act: the whole set as one shard (another job, one worker)
    data, rows = await fetcher.fetch("j2", (0, 1))
    x, y = data.gather(np.array([19, 3, 10]), 1)

    # Assert: shard 0's rows came from the cache (kept, pinned, though the cache was full)
    assert coordinator.sent == [(0, 10), (10, 20)]
    assert fetcher.counts.cached_rows == 10
    np.testing.assert_array_equal(x, X[[19, 3, 10]].astype(np.float32))
    np.testing.assert_array_equal(y, Y[[19, 3, 10]].astype(np.int64))
    assert (x.dtype, y.dtype) == (np.float32, np.int64)
    np.testing.assert_array_equal(rows.x, X.astype(np.float32))  # read whole: allreduce
    data.close()
