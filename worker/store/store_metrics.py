"""The memory store's Prometheus metrics: operations counted and timed, memories by role.

``neuroshard_memory_ops_total{op}`` and ``neuroshard_memory_op_seconds{op}`` take one sample
per request a ``MemoryNode`` serves (never one per item), on the event loop, after the
operation returned: the store thread does no metric work. ``neuroshard_memories{role}`` is
computed when ``/metrics`` is scraped, so writes pay nothing for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import Counter, Histogram

from shared.metrics import Metrics

__all__ = ["ROLES", "StoreMetrics"]

ROLES = ("primary", "replica")


class StoreMetrics:
    """Counts and times a worker's memory store operations (a no-op without ``Metrics``)."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        """Record into ``metrics`` (the worker's), or nowhere when None (unit tests)."""
        self._metrics = metrics
        # One labelled child per op, looked up once: ``labels()`` takes a lock each call.
        self._children: dict[str, tuple[Counter, Histogram]] = {}

    @contextmanager
    def op(self, name: str) -> Iterator[None]:
        """Count and time the operation run in the ``with`` block, if it returns normally.

        A refused or failed operation (stale epoch, bad input, replication error) is not
        counted: the metric counts operations applied or served.

        Args:
            name: the operation, e.g. "upsert", "get", "decay" (the ``op`` label).
        """
        start = time.perf_counter()
        yield
        if self._metrics is None:
            return
        child = self._children.get(name)
        if child is None:
            m = self._metrics
            child = self._children[name] = (
                m.memory_ops.labels(name),
                m.memory_op_seconds.labels(name),
            )
        child[0].inc()
        child[1].observe(time.perf_counter() - start)

    def report_memories(self, by_role: Callable[[], dict[str, int]]) -> None:
        """Make ``neuroshard_memories{role}`` read ``by_role()`` at every scrape.

        Args:
            by_role: returns ``{role: memories held}`` for each of ``ROLES``; it runs on the
                scraping thread, so it must only read.
        """
        if self._metrics is None:
            return
        for role in ROLES:
            self._metrics.memories.labels(role).set_function(_reader(by_role, role))


def _reader(by_role: Callable[[], dict[str, int]], role: str) -> Callable[[], float]:
    """Return a function reading one role's count from ``by_role``."""
    return lambda: float(by_role().get(role, 0))
