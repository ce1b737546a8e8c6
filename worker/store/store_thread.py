"""The store's one thread: jobs run in submission order, their results handed to the loop.

``StoreThread.run`` replaces ``loop.run_in_executor(ThreadPoolExecutor(1), ...)`` on the
write path, which a worker crosses several times per write (a primary's apply, each
replica's apply): the executor's ``submit`` (a work item, a concurrent future, the idle
semaphore of ``_adjust_thread_count``) and ``asyncio.wrap_future``'s two chained futures cost
about 7% of a worker's GIL time under reinforce traffic (py-spy, 1M memories, 3 workers).
Here a job is one tuple on a ``queue.SimpleQueue`` and its result one
``call_soon_threadsafe``. Semantics are the executor's: one job at a time in order; a job
whose caller was cancelled before it started is skipped; ``shutdown`` finishes the running
job and drops the queued ones.

``run_small`` runs a short job (a read of a few ids, a keyed write of a few) on the calling
thread instead, when every job submitted before it has finished and none is running: a
one-id get or upsert then costs no hand-off to the thread and back (two wake-ups, ~40% of a
one-id get's wall time on a loaded 2-core machine; an upsert crosses twice, on the primary
and on its replica).
Jobs are submitted from one event loop's thread (the worker's), which is what makes
"every job submitted before it has finished" a comparison of two counters, each written by
one thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["StoreThread"]

T = TypeVar("T")
_Job = tuple[Callable[..., Any], tuple[Any, ...], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


class StoreThread:
    """One thread running jobs in submission order."""

    def __init__(self, name: str = "store") -> None:
        """Start the thread, named ``name``."""
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        # Jobs submitted (written by the submitting thread) and finished (by the store thread);
        # _running is held by the store thread while a job runs.
        self._submitted = 0
        self._finished = 0
        self._running = threading.Lock()
        self.inline = False  # a job runs inline (``run_small``) on the submitting thread now
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the thread after every job submitted before it.

        Raises:
            RuntimeError: after ``shutdown``. Whatever ``fn`` raises.
        """
        if self._closed:
            raise RuntimeError("the store thread is shut down")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._submitted += 1
        self._jobs.put((fn, args, loop, fut))
        return await fut

    async def run_small(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a short ``fn(*args)`` now on the calling thread when the thread is idle.

        Idle: every job submitted before has finished, and none runs (the store's state is
        the one ``run`` would have shown it, and nothing changes it meanwhile). Otherwise
        as ``run``. ``fn`` must be short (it holds the event loop): a read or a write of a
        few ids, or a pass over a small store (at most ~0.1 ms: ``MemoryNode``'s
        ``INLINE_SCAN_MEMORIES``), never a pass over a large one. ``inline`` is True while
        it runs.

        Raises:
            RuntimeError: after ``shutdown``. Whatever ``fn`` raises.
        """
        if self._finished == self._submitted and self._running.acquire(blocking=False):
            try:
                if self._finished == self._submitted and not self._closed:
                    self.inline = True
                    try:
                        return fn(*args)
                    finally:
                        self.inline = False
            finally:
                self._running.release()
        return await self.run(fn, *args)

    def shutdown(self) -> None:
        """Finish the running job, drop the queued ones (their callers get CancelledError)."""
        self._closed = True
        dropped: list[_Job] = []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                dropped.append(job)
        self._jobs.put(None)
        self._thread.join()
        for _, _, loop, fut in dropped:
            try:
                loop.call_soon_threadsafe(fut.cancel)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, loop, fut = job
            result: Any = None
            error: BaseException | None = None
            with self._running:
                skip = fut.cancelled()  # as an executor's job cancelled before it started
                if not skip:
                    try:
                        result = fn(*args)
                    except BaseException as exc:  # handed to the caller, as an executor does
                        error = exc
                # Counted (and the lock released) before the caller can see the result, so
                # that its next run_small may read inline.
                self._finished += 1
            if not skip:
                _post(loop, fut, result, error)


def _post(
    loop: asyncio.AbstractEventLoop,
    fut: asyncio.Future[Any],
    result: Any,
    error: BaseException | None,
) -> None:
    try:
        loop.call_soon_threadsafe(_settle, fut, result, error)
    except RuntimeError:  # the loop is closed: nobody waits any more
        pass


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.cancelled():
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)
