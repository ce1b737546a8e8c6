"""Inserts into a table with a capacity: ordered by the coordinator, evicting exactly.

A table's capacity is global while its slots live on many workers, so one place decides what
an insert evicts: the coordinator, one insert at a time per capped table (a lock per table).
An insert (docs/architecture.md "Capacity and eviction"):

1. stamps the batch: item i takes stamp ``base + i`` from the table's insert counter (a new
   id keeps the stamp of its last occurrence; an id already held keeps its own, so an
   overwrite is not an insert);
2. writes it through the primaries as an ordinary replicated upsert, with the stamps
   (``UpsertRequest.stamps``) and the client's request id (exactly once per slot);
3. asks every primary for its count of the table and its first k memories in eviction order
   (``WorkerTopKRequest.order``: "oldest" by stamp for ``fifo``, "weakest" by (strength, id)
   for ``weakest``), k the batch size, so the union holds the global first ``excess``;
4. deletes the ``excess = count - capacity`` first of the merged candidates, as an ordinary
   replicated delete whose request id is derived from the insert's and the victims;

and answers only then. A retry of a failed insert (same request id) finds the slots that
applied it already and completes the eviction.

Shape letters: N items of an insert, C candidates.
"""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np

from coordinator.memory.memory_ops import MemoryOps
from coordinator.memory.tables import Tables
from shared.client.memory import MemoryRouter
from shared.proto import common_pb2
from shared.rpc.codec import f32_from_bytes, ids_from_bytes

__all__ = ["CappedInserts", "eviction_order"]


def eviction_order(eviction: str) -> str:
    """The candidates' order (``WorkerTopKRequest.order``) of an eviction policy."""
    return "oldest" if eviction == "fifo" else "weakest"


def first_to_evict(replies: list[common_pb2.TopKResponse], order: str, n: int) -> np.ndarray:
    """Merge the primaries' candidates; return the ids [n'] uint64 of the global first n.

    Args:
        replies: each primary's first k memories in eviction order (ids, strengths, stamps).
        order: "oldest": by (stamp, id); "weakest": by (strength, id).
        n: how many to evict.
    """
    ids = np.concatenate([ids_from_bytes(r.ids) for r in replies] or [np.zeros(0, np.uint64)])
    strengths = np.concatenate(
        [f32_from_bytes(r.strengths) for r in replies] or [np.zeros(0, np.float32)]
    )
    stamps = np.concatenate([ids_from_bytes(r.stamps) for r in replies] or [np.zeros(0, np.uint64)])
    first = stamps if order == "oldest" else strengths
    return ids[np.lexsort((ids, first))[:n]]


class CappedInserts:
    """The coordinator's insert path of capped tables (module docstring)."""

    def __init__(self, tables: Tables, memory: MemoryOps, router: MemoryRouter) -> None:
        """Insert through ``router`` (the coordinator's map), fan out through ``memory``."""
        self._tables = tables
        self._memory = memory
        self._router = router
        self._locks: dict[str, asyncio.Lock] = {}

    async def insert(
        self,
        table: str,
        ids: np.ndarray,
        strengths: np.ndarray,
        payloads: list[bytes] | None,
        request_id: bytes,
    ) -> tuple[int, int]:
        """Insert a validated batch into a capped table, evicting per its policy.

        Args:
            table: the table (capacity > 0, checked by the caller).
            ids: [N] uint64.
            strengths: [N] float32 in [0, 1].
            payloads: [N] bytes or None.
            request_id: the client's request id (its retries keep it).

        Returns:
            (distinct ids written, memories evicted).

        Raises:
            RoutingError: the write or the eviction could not be delivered (UNAVAILABLE:
                retry with the same request id) or was refused.
            BulkOpError: a primary did not answer the candidates' query (UNAVAILABLE).
            TableNotFound: the table was dropped meanwhile (NOT_FOUND).
        """
        lock = self._locks.setdefault(table, asyncio.Lock())
        async with lock:
            spec = self._tables.spec(table)
            stamps = self._tables.take_stamps(table, len(ids))
            applied = await self._router.upsert(
                ids, strengths, payloads, request_id, None, table, stamps
            )
            evicted = await self._evict(spec, request_id, max(len(ids), 1))
        return applied, evicted

    async def _evict(self, spec: common_pb2.TableSpec, request_id: bytes, k: int) -> int:
        """Delete what exceeds the capacity, in eviction order; return how many."""
        order = eviction_order(spec.eviction)
        replies = await self._memory.candidates(k, order, spec.name)
        excess = sum(int(r.count) for r in replies) - int(spec.capacity)
        if excess <= 0:
            return 0
        if excess > k:  # over capacity before this insert (an earlier one failed part-way)
            replies = await self._memory.candidates(excess, order, spec.name)
        victims = first_to_evict(replies, order, excess)
        digest = hashlib.blake2b(request_id + b"/evict/" + victims.tobytes(), digest_size=16)
        await self._router.delete(victims, digest.digest(), None, spec.name)
        return len(victims)
