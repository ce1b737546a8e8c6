"""Group commit: one fsync thread whose every fsync covers all the records appended before it.

A journal with ``fsync: always`` acknowledges a write only once its record is durable. With
one fsync per write, concurrent writes (a primary's own record and the forwards it receives
from the other primaries arrive together) queue behind each other's fsyncs. Here one thread
fsyncs whenever some position is wanted and not yet durable; each fsync covers everything
appended before it started, so every write that arrived while the previous fsync ran shares
the next one (the classic group commit of database logs, e.g. PostgreSQL's ``commit_delay``
without the delay). Waiters are woken together, one event-loop call per batch.

The store thread asks for an fsync right after appending (``request``), so the fsync runs
while the event loop forwards the write to the replicas; the loop then only waits (``wait``).

A failed fsync is final (``worker/store/journal.py``): every waiter and every later ``wait`` gets
the error, and the thread stops.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

__all__ = ["GroupCommit"]


class GroupCommit:
    """The fsync thread of a journal and the writes waiting for it."""

    def __init__(self, fsync: Callable[[], int], name: str = "journal-sync") -> None:
        """Start the thread.

        Args:
            fsync: makes the log durable and returns the position (bytes) it covered, that
                is the log's length when it started; raises (e.g. ``StorageFailed``) when it
                failed. Called on this object's thread only.
            name: the thread's name.
        """
        self._fsync = fsync
        self._cond = threading.Condition()
        self._wanted = 0  # the highest position asked for
        self._synced = 0  # the highest position known durable
        self._failure: Exception | None = None
        self._stopping = False
        self._idle = False  # the thread waits for work (a request must wake it)
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.fsyncs = 0  # fsyncs done (diagnostics and tests)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def request(self, pos: int) -> None:
        """Ask for the log up to ``pos`` (bytes) to be made durable; do not wait (any thread)."""
        with self._cond:
            if pos > self._wanted:
                self._wanted = pos
                if self._idle:  # a busy thread looks at _wanted again before it waits
                    self._cond.notify()

    def mark(self, pos: int) -> None:
        """Note that the log up to ``pos`` became durable by other means (a rotation's fsync)."""
        with self._cond:
            self._synced = max(self._synced, pos)
            ready = self._take_ready()
        _wake(ready, None)

    async def wait(self, pos: int) -> None:
        """Return once the log up to ``pos`` (bytes) is durable.

        Raises:
            Exception: the fsync's error (``StorageFailed``), now or from an earlier fsync.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._cond:
            if self._failure is not None:
                raise self._failure
            if self._synced >= pos:
                return
            self._waiters.append((pos, loop, fut))
            if pos > self._wanted:
                self._wanted = pos
                if self._idle:
                    self._cond.notify()
        await fut

    def close(self) -> None:
        """Stop the thread after its running fsync; fail the writes still waiting."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()
        with self._cond:
            left, self._waiters = self._waiters, []
        _wake(left, RuntimeError("the journal was closed before the write was durable"))

    def _take_ready(self) -> list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]]:
        """Under the lock: remove and return the waiters whose position is durable."""
        ready = [w for w in self._waiters if w[0] <= self._synced]
        if ready:
            self._waiters = [w for w in self._waiters if w[0] > self._synced]
        return ready

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and self._wanted <= self._synced:
                    self._idle = True
                    self._cond.wait()
                    self._idle = False
                if self._stopping:
                    return
            try:
                end = self._fsync()
            except Exception as exc:  # final: see the module docstring
                with self._cond:
                    self._failure = exc
                    left, self._waiters = self._waiters, []
                _wake(left, exc)
                return
            self.fsyncs += 1
            with self._cond:
                self._synced = max(self._synced, end)
                ready = self._take_ready()
            _wake(ready, None)


def _wake(
    waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]],
    error: Exception | None,
) -> None:
    """Resolve waiters' futures on their loops: one thread-safe call per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
    for _, loop, fut in waiters:
        by_loop.setdefault(loop, []).append(fut)
    for loop, futs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_resolve, futs, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass


def _resolve(futs: list[asyncio.Future[None]], error: Exception | None) -> None:
    for fut in futs:
        if fut.done():  # the waiting call was cancelled
            continue
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)
