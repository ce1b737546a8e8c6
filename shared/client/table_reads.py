"""Whole-table reads (Quality, TopK) fanned out by the client itself to every primary.

The coordinator's ``Quality`` and ``TopK`` ask every primary of its slot map and merge the
answers (``coordinator/memory/memory_ops.py``); a client with a slot map can do the same
without the hop through the coordinator: one round of parallel calls to the primaries of
its cached map, each at that map's epoch, merged with the same exact merges
(``shared.memory.stats.merge_quality`` / ``merge_topk``, primaries in name order as the
coordinator's). Every answer comes from a worker at the map's epoch, so each slot is counted
once, by its primary at that epoch.

After a status that a newer map may cure (a stale epoch, a failover, a table the worker's map
lacks, a worker that refuses the read) the map is fetched again and the read sent once more
if the map moved to a new epoch; otherwise ``None``: the caller asks the coordinator, whose
fan-out retries and reports as before. A top-k above the map's ``topk_max`` and a table the
map does not list go to the coordinator at once (its INVALID_ARGUMENT / NOT_FOUND).

With auth on, the calls carry the data-plane token of the map (``GetSlotMap``'s), which
workers accept for these two reads with what the coordinator's give (``shared/security/
auth.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import numpy as np
import numpy.typing as npt
from grpc import aio

from shared.client.memory import MemoryRouter, RoutingError
from shared.memory.stats import Quality, merge_quality, merge_topk, quality_from_pb
from shared.memory.tables import table_specs
from shared.proto import common_pb2, worker_pb2, worker_pb2_grpc
from shared.rpc.codec import f32_from_bytes, ids_from_bytes

__all__ = ["direct_quality", "direct_topk"]

Reply = TypeVar("Reply")
# One primary's call: (its stub, the map's epoch) -> the reply
Start = Callable[[worker_pb2_grpc.WorkerStub, int], Awaitable[Reply]]

# Statuses after which the coordinator is asked (once a refreshed map did not help)
_FALLBACK = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,  # a stale epoch
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.NOT_FOUND,  # a table the worker's map lacks (yet, or no more)
        grpc.StatusCode.PERMISSION_DENIED,  # a worker that does not serve clients these
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


async def direct_quality(router: MemoryRouter, wire: str, timeout_s: float) -> Quality | None:
    """The merged strength statistics of a table, asked of its primaries; None: ask elsewhere.

    Args:
        router: the client's router (its slot map, worker channels and data-plane token).
        wire: the table as requests carry it ("" for the default one).
        timeout_s: deadline of each worker call, seconds.

    Returns:
        The statistics as the coordinator's ``Quality`` merges them; None when the
        coordinator should answer (module docstring).

    Raises:
        RoutingError: a worker refused the read with another status (INVALID_ARGUMENT,
            RESOURCE_EXHAUSTED, ...); ``code`` is the worker's.
    """
    replies: list[common_pb2.QualityStats] | None = await _fan_out(
        router,
        wire,
        0,
        lambda stub, epoch: stub.Quality(
            worker_pb2.WorkerQualityRequest(epoch=epoch, table=wire), timeout=timeout_s
        ),
    )
    if replies is None:
        return None
    return merge_quality([quality_from_pb(r) for r in replies])


async def direct_topk(
    router: MemoryRouter, k: int, wire: str, timeout_s: float
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]] | None:
    """The exact global top-k of a table from its primaries' local ones; None: ask elsewhere.

    Args:
        router: as ``direct_quality``.
        k: how many, >= 1 (above the map's ``topk_max``: None).
        wire: as ``direct_quality``.
        timeout_s: as ``direct_quality``.

    Returns:
        ids [k'] uint64 and strengths [k'] float32, strongest first (ties: smaller id),
        k' = min(k, memories); None as ``direct_quality``.

    Raises:
        RoutingError: as ``direct_quality``.
    """
    replies: list[common_pb2.TopKResponse] | None = await _fan_out(
        router,
        wire,
        k,
        lambda stub, epoch: stub.TopK(
            worker_pb2.WorkerTopKRequest(epoch=epoch, k=k, table=wire), timeout=timeout_s
        ),
    )
    if replies is None:
        return None
    return merge_topk([(ids_from_bytes(r.ids), f32_from_bytes(r.strengths)) for r in replies], k)


async def _fan_out(
    router: MemoryRouter, wire: str, k: int, start: Start[Reply]
) -> list[Reply] | None:
    """One call to every primary of the cached map at once; all replies in name order, or None.

    Args:
        router: as ``direct_quality``.
        wire: the table; one the map does not list: None.
        k: a top-k's size (above the map's ``topk_max``: None); 0 for other reads.
        start: makes one primary's call.

    Raises:
        RoutingError: as ``direct_quality``.
    """
    m = router.cached_map
    failed_epoch = -1
    while True:
        if m is None or failed_epoch >= 0 or router.token_stale():
            try:
                m = await router.slot_map(refresh=m is not None)
            except (RoutingError, grpc.RpcError):
                return None  # the coordinator's path reports it
            if m.epoch == failed_epoch:
                return None
        if (wire and wire not in table_specs(m)) or k > m.topk_max or m.epoch == 0:
            return None
        owners = sorted({w for w in m.primary if w >= 0})  # worker names are sorted in a map
        if not owners:
            return None
        results = await asyncio.gather(
            *(start(router.worker_stub(m.workers[w], m.addresses[w]), m.epoch) for w in owners),
            return_exceptions=True,
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if not failed:
            return list(results)  # type: ignore[arg-type]  # no exception among them
        for exc in failed:
            if not isinstance(exc, aio.AioRpcError):
                raise exc
            if exc.code() not in _FALLBACK:
                raise RoutingError(exc.details() or exc.code().name, exc.code())
        if failed_epoch >= 0:
            return None
        failed_epoch = m.epoch
