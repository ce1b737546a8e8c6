"""Bulk memory operations fanned out to every primary: decay, quality, top-k.

Each runs under the rebalancer's ``map_lock`` so every worker sees the same epoch, and merges
the workers' answers exactly (``shared.memory.stats.merge_quality`` / ``merge_topk``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import numpy as np
from grpc import aio

from coordinator.membership import Membership
from coordinator.rebalance import Rebalancer
from shared.memory.stats import Quality, merge_quality, merge_topk, quality_from_pb
from shared.proto import worker_pb2, worker_pb2_grpc
from shared.rpc.codec import f32_from_bytes, ids_from_bytes
from shared.rpc.peers import WorkerClients

T = TypeVar("T")


class BulkOpError(RuntimeError):
    """Some primaries did not answer (UNAVAILABLE); the message names them."""


class MemoryOps:
    """Fan-out of bulk operations over the primaries of the current slot map."""

    def __init__(
        self,
        rebalancer: Rebalancer,
        membership: Membership,
        clients: WorkerClients,
        rpc_timeout_s: float,
    ) -> None:
        """Fan out over ``rebalancer``'s current map.

        Args:
            rebalancer: owner of the slot map and its ``map_lock``.
            membership: where the primaries' addresses are.
            clients: channels to the workers.
            rpc_timeout_s: deadline of each worker call, seconds.
        """
        self._rebalancer = rebalancer
        self._membership = membership
        self._clients = clients
        self._timeout_s = rpc_timeout_s

    async def _fan_out(
        self, call: Callable[[worker_pb2_grpc.WorkerStub, int], Awaitable[T]], what: str
    ) -> list[T]:
        async with self._rebalancer.map_lock:
            current = self._rebalancer.current
            names = sorted({n for n in current.primary if n})
            stubs = []
            for n in names:
                rec = self._membership.get(n)
                if rec is None:
                    raise BulkOpError(f"{what}: primary {n} is unknown")
                stubs.append(self._clients.stub(n, rec.address))
            results = await asyncio.gather(
                *(call(s, current.epoch) for s in stubs), return_exceptions=True
            )
        failed = [
            (n, r) for n, r in zip(names, results, strict=True) if isinstance(r, BaseException)
        ]
        if failed:
            n, exc = failed[0]
            detail = exc.details() if isinstance(exc, aio.AioRpcError) else str(exc)
            raise BulkOpError(
                f"{what}: {len(failed)} of {len(names)} primaries failed (first: {n}: {detail})"
            )
        return [r for r in results if not isinstance(r, BaseException)]

    async def decay(self, rate: float) -> int:
        """Subtract ``rate`` from every strength, clipped to [0, 1]; return memories decayed.

        Raises:
            BulkOpError: a primary failed (UNAVAILABLE); others may have applied the decay.
        """
        replies = await self._fan_out(
            lambda s, e: s.Decay(
                worker_pb2.WorkerDecayRequest(epoch=e, rate=rate), timeout=self._timeout_s
            ),
            "decay",
        )
        return sum(int(r.memories) for r in replies)

    async def quality(self) -> Quality:
        """Merged strength statistics of every memory (one copy of each)."""
        replies = await self._fan_out(
            lambda s, e: s.Quality(
                worker_pb2.WorkerQualityRequest(epoch=e), timeout=self._timeout_s
            ),
            "quality",
        )
        return merge_quality([quality_from_pb(r) for r in replies])

    async def topk(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The exact global top-k, strongest first, ties broken by smaller id.

        Args:
            k: how many, >= 1 (at most ``topk_max``, checked by the caller).

        Returns:
            ids [k'] uint64 and strengths [k'] float32, k' = min(k, memories).
        """
        replies = await self._fan_out(
            lambda s, e: s.TopK(
                worker_pb2.WorkerTopKRequest(epoch=e, k=k), timeout=self._timeout_s
            ),
            "topk",
        )
        parts = [(ids_from_bytes(r.ids), f32_from_bytes(r.strengths)) for r in replies]
        return merge_topk(parts, k)
