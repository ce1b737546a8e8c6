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
        self._jobs.put((fn, args, loop, fut))
        return await fut

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
            if fut.cancelled():  # as an executor's job cancelled before it started
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the caller, as an executor does
                _post(loop, fut, None, exc)
            else:
                _post(loop, fut, result, None)


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
