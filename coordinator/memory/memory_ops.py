"""Bulk memory operations fanned out to every primary: decay, quality, top-k, and sweep.

A sweep is the memory iteration's fused step: decay, then quality and top-k of the decayed
store, one RPC per primary and one pass over its strengths.

Each runs under the rebalancer's ``map_lock`` so every worker sees the same epoch, and merges
the workers' answers exactly (``shared.memory.stats.merge_quality`` / ``merge_topk``).

A decay is exactly-once: it carries an operation id, each slot applies an id once (its
primary and replica remember it, ``worker/store/dedup.py``), so the fan-out is re-sent to every
primary of the current map, after the map moved past a failed worker, until all answered;
slots that applied it already skip it. A client's retry with the same id does the same.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np
from grpc import aio

from coordinator.placement.membership import Membership
from coordinator.placement.rebalance import Rebalancer
from coordinator.placement.slot_map import SlotMap
from shared.memory.stats import Quality, merge_quality, merge_topk, quality_from_pb
from shared.proto import common_pb2, worker_pb2, worker_pb2_grpc
from shared.rpc.codec import f32_from_bytes, ids_from_bytes
from shared.rpc.peers import WorkerClients

T = TypeVar("T")


# A primary's answer that may change once the slot map moves past a failure.
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.FAILED_PRECONDITION,  # stale epoch or not primary: the map moved
    grpc.StatusCode.NOT_FOUND,  # a table the worker's map lacks: the map listing it is on its way
}


@dataclass(frozen=True)
class SweepResult:
    """What a sweep found after its decay.

    Attributes:
        memories: memories decayed (primary copies).
        quality: merged statistics; None when not asked for.
        ids: [k'] uint64 the global top-k, strongest first (ties: smaller id).
        strengths: [k'] float32 theirs.
    """

    memories: int
    quality: Quality | None
    ids: np.ndarray
    strengths: np.ndarray


class BulkOpError(RuntimeError):
    """Some primaries did not answer (UNAVAILABLE); the message names them.

    Attributes:
        retryable: every failure may pass once the slot map moves (a worker that died, a
            stale epoch), as opposed to a refusal such as INVALID_ARGUMENT.
    """

    def __init__(self, message: str, retryable: bool = False) -> None:
        """Carry ``message`` and whether a retry may succeed."""
        super().__init__(message)
        self.retryable = retryable


def primary_stubs(
    current: SlotMap, membership: Membership, clients: WorkerClients, what: str
) -> tuple[list[str], list[worker_pb2_grpc.WorkerStub]]:
    """Return the primaries of the slot map ``current`` (names sorted) and their stubs.

    Raises:
        BulkOpError: a primary is not in the membership (retryable, UNAVAILABLE).
    """
    names = sorted({n for n in current.primary if n})
    stubs = []
    for n in names:
        rec = membership.get(n)
        if rec is None:
            raise BulkOpError(f"{what}: primary {n} is unknown", retryable=True)
        stubs.append(clients.stub(n, rec.address))
    return names, stubs


class MemoryOps:
    """Fan-out of bulk operations over the primaries of the current slot map."""

    def __init__(
        self,
        rebalancer: Rebalancer,
        membership: Membership,
        clients: WorkerClients,
        rpc_timeout_s: float,
        retry_budget_s: float = 10.0,
    ) -> None:
        """Fan out over ``rebalancer``'s current map.

        Args:
            rebalancer: owner of the slot map and its ``map_lock``.
            membership: where the primaries' addresses are.
            clients: channels to the workers.
            rpc_timeout_s: deadline of each worker call, seconds.
            retry_budget_s: how long a decay is re-sent to the primaries after a failure,
                seconds (long enough for a dead worker to be declared and its slots promoted).
        """
        self._rebalancer = rebalancer
        self._membership = membership
        self._clients = clients
        self._timeout_s = rpc_timeout_s
        self._retry_budget_s = retry_budget_s

    async def _fan_out(
        self, call: Callable[[worker_pb2_grpc.WorkerStub, int], Awaitable[T]], what: str
    ) -> list[T]:
        async with self._rebalancer.map_lock:
            current = self._rebalancer.current
            names, stubs = primary_stubs(current, self._membership, self._clients, what)
            results = await asyncio.gather(
                *(call(s, current.epoch) for s in stubs), return_exceptions=True
            )
        failed = [
            (n, r) for n, r in zip(names, results, strict=True) if isinstance(r, BaseException)
        ]
        if failed:
            n, exc = failed[0]
            detail = exc.details() if isinstance(exc, aio.AioRpcError) else str(exc)
            retryable = all(
                isinstance(e, aio.AioRpcError) and e.code() in _RETRYABLE for _, e in failed
            )
            raise BulkOpError(
                f"{what}: {len(failed)} of {len(names)} primaries failed "
                f"({', '.join(sorted(f for f, _ in failed))}; first: {n}: {detail})",
                retryable,
            )
        return [r for r in results if not isinstance(r, BaseException)]

    async def decay(self, rate: float, op_id: bytes = b"", table: str = "") -> int:
        """Subtract ``rate`` from every strength, clipped to [0, 1], once; return memories.

        Re-sent with the same ``op_id`` to every primary of the current map (jittered
        backoff, 50 ms to 1 s) while a primary fails retryably, for ``retry_budget_s``.
        Shielded: a caller that gives up does not stop a decay half-way.

        Args:
            rate: in [0, 1], validated by the caller.
            op_id: the operation id (a client's, kept across its retries); empty: a new one.
            table: the table decayed, as on the wire ("": the default one; checked by the
                caller).

        Returns:
            The memories of the table, each decayed once by this operation.

        Raises:
            BulkOpError: a primary still failed when the budget ran out, or refused; the
                message names the op id and the primaries whose slots may not have applied it
                (UNAVAILABLE). A retry with the same ``op_id`` completes it, never repeats it.
        """
        return await asyncio.shield(self._decay(rate, op_id or uuid.uuid4().bytes, table))

    async def _decay(self, rate: float, op_id: bytes, table: str) -> int:
        replies = await self._until_all(
            lambda s, e: s.Decay(
                worker_pb2.WorkerDecayRequest(epoch=e, rate=rate, op_id=op_id, table=table),
                timeout=self._timeout_s,
            ),
            "decay",
            op_id,
        )
        return sum(int(r.memories) for r in replies)

    async def _until_all(
        self,
        call: Callable[[worker_pb2_grpc.WorkerStub, int], Awaitable[T]],
        what: str,
        op_id: bytes,
    ) -> list[T]:
        """Fan ``call`` out until every primary of one map answered (an exactly-once op).

        Re-sent to every primary of the current map (jittered backoff, 50 ms to 1 s) while a
        primary fails retryably, for ``retry_budget_s``; the replies all come from one
        fan-out.

        Raises:
            BulkOpError: as ``decay``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._retry_budget_s
        backoff_s = 0.05
        while True:
            try:
                return await self._fan_out(call, what)
            except BulkOpError as exc:
                pause_s = backoff_s * random.uniform(0.5, 1.0)
                if not exc.retryable or loop.time() + pause_s > deadline:
                    raise BulkOpError(
                        f"{what} op {op_id.hex()} may be applied on part of the store only: "
                        f"{exc}; a retry with the same op id completes it"
                    ) from None
            await asyncio.sleep(pause_s)
            backoff_s = min(2 * backoff_s, 1.0)

    async def sweep(
        self, rate: float, op_id: bytes, k: int, want_quality: bool, table: str = ""
    ) -> SweepResult:
        """Decay every memory once (as ``decay``), then merged statistics and global top-k.

        One ``Sweep`` per primary: each decays its slots, then summarizes them and selects
        its local top-k in the same pass; the answers merge exactly as ``quality`` and
        ``topk`` merge theirs. Retried and shielded as ``decay``; the answers all come from
        the fan-out that completed the decay (a retry's, if one was needed).

        Args:
            rate: in [0, 1], validated by the caller; 0: no decay (statistics only).
            op_id: the operation id (a client's, kept across its retries); empty: a new one.
            k: global top-k size, 0 (none) to ``topk_max`` (checked by the caller).
            want_quality: compute the statistics.
            table: the table swept, as ``decay``'s.

        Returns:
            The memories decayed, the merged quality (None unless ``want_quality``) and the
            global top-k (ids [k'] uint64, strengths [k'] float32; empty when k is 0).

        Raises:
            BulkOpError: as ``decay`` (UNAVAILABLE).
        """
        op_id = op_id or uuid.uuid4().bytes
        replies = await asyncio.shield(
            self._until_all(
                lambda s, e: s.Sweep(
                    worker_pb2.WorkerSweepRequest(
                        epoch=e,
                        rate=rate,
                        op_id=op_id,
                        k=k,
                        want_quality=want_quality,
                        table=table,
                    ),
                    timeout=self._timeout_s,
                ),
                "sweep",
                op_id,
            )
        )
        quality = (
            merge_quality([quality_from_pb(r.quality) for r in replies]) if want_quality else None
        )
        parts = [(ids_from_bytes(r.topk.ids), f32_from_bytes(r.topk.strengths)) for r in replies]
        ids, strengths = merge_topk(parts, k)
        return SweepResult(sum(int(r.memories) for r in replies), quality, ids, strengths)

    async def quality(self, table: str = "") -> Quality:
        """Merged strength statistics of every memory of a table (one copy of each)."""
        replies = await self._fan_out(
            lambda s, e: s.Quality(
                worker_pb2.WorkerQualityRequest(epoch=e, table=table), timeout=self._timeout_s
            ),
            "quality",
        )
        return merge_quality([quality_from_pb(r) for r in replies])

    async def candidates(self, k: int, order: str, table: str) -> list[common_pb2.TopKResponse]:
        """Every primary's count of a table and its first k memories in an eviction order.

        Args:
            k: how many per primary, >= 1.
            order: "oldest" (by insert stamp) or "weakest" (by strength, then id).
            table: the table, as on the wire.

        Returns:
            One ``TopKResponse`` per primary (ids, strengths, stamps, count).

        Raises:
            BulkOpError: a primary still failed after the retry budget (UNAVAILABLE).
        """
        return await self._until_all(
            lambda s, e: s.TopK(
                worker_pb2.WorkerTopKRequest(epoch=e, k=k, table=table, order=order),
                timeout=self._timeout_s,
            ),
            "candidates",
            b"candidates",
        )

    async def topk(self, k: int, table: str = "") -> tuple[np.ndarray, np.ndarray]:
        """The exact global top-k of a table, strongest first, ties broken by smaller id.

        Args:
            k: how many, >= 1 (at most ``topk_max``, checked by the caller).
            table: as ``decay``'s.

        Returns:
            ids [k'] uint64 and strengths [k'] float32, k' = min(k, memories).
        """
        replies = await self._fan_out(
            lambda s, e: s.TopK(
                worker_pb2.WorkerTopKRequest(epoch=e, k=k, table=table), timeout=self._timeout_s
            ),
            "topk",
        )
        parts = [(ids_from_bytes(r.ids), f32_from_bytes(r.strengths)) for r in replies]
        return merge_topk(parts, k)
