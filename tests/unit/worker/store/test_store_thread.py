"""worker/store/store_thread.py: jobs in submission order on one thread, errors handed back, a job
cancelled before it starts skipped, shutdown finishing the running job only."""

from __future__ import annotations

import asyncio
import threading

import pytest

from worker.store.store_thread import StoreThread


async def test_jobs_run_in_order_on_one_thread_and_errors_reach_the_caller() -> None:
    # Arrange
    worker = StoreThread("store-test")
    seen: list[tuple[int, str]] = []

    def job(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        if i == 3:
            raise ValueError("job 3 refused")
        return i * i

    # Act
    results = await asyncio.gather(*(worker.run(job, i) for i in range(6)), return_exceptions=True)
    worker.shutdown()

    # Assert
    assert [i for i, _ in seen] == list(range(6))
    assert {name for _, name in seen} == {"store-test"}
    assert results[:3] == [0, 1, 4] and results[4:] == [16, 25]
    assert isinstance(results[3], ValueError)


async def test_a_cancelled_queued_job_is_skipped_and_shutdown_drops_the_queue() -> None:
    # Arrange: the first job holds the thread until the gate opens.
    worker = StoreThread("store-test")
    gate, ran = threading.Event(), []
    first = asyncio.ensure_future(worker.run(gate.wait, 10))
    cancelled = asyncio.ensure_future(worker.run(ran.append, "cancelled"))
    kept = asyncio.ensure_future(worker.run(ran.append, "kept"))
    await asyncio.sleep(0)  # let the three calls queue their jobs

    # Act: cancel the second before it starts, then open the gate.
    cancelled.cancel()
    gate.set()
    assert await first is True
    await kept

    # Assert: the cancelled job never ran; after shutdown, nothing runs.
    assert ran == ["kept"]
    worker.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        await worker.run(ran.append, "late")
    assert ran == ["kept"]


async def test_run_small_reads_inline_only_when_no_job_is_queued_or_running() -> None:
    # Arrange: a value the store thread's jobs change
    worker = StoreThread("store-test")
    state = {"v": 0}
    gate = threading.Event()

    def write(v: int) -> None:
        gate.wait(10)
        state["v"] = v

    def read() -> tuple[int, str]:
        return state["v"], threading.current_thread().name

    # Act: idle, then behind a queued write held by the gate, then idle again
    idle = await worker.run_small(read)
    pending = asyncio.ensure_future(worker.run(write, 7))
    await asyncio.sleep(0)  # the write is submitted (and may be running, held by the gate)
    behind = asyncio.ensure_future(worker.run_small(read))
    await asyncio.sleep(0.01)
    waited = not behind.done()
    gate.set()
    await pending
    after_write = await behind
    again = await worker.run_small(read)
    worker.shutdown()

    # Assert: inline on the caller's thread when idle; after the earlier write otherwise
    here = threading.current_thread().name
    assert idle == (0, here)
    assert waited
    assert after_write == (7, "store-test")
    assert again == (7, here)
