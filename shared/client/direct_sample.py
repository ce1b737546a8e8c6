"""A prioritized sample drawn by the client through the primaries, without the coordinator hop.

The coordinator's ``Sample`` (``coordinator/memory/sampling.py``) is three rounds in series:
client -> coordinator, phase 1 (every primary's slot weight sums, ``SampleSums``), phase 2
(the memories at the draws' offsets, ``SamplePick``). A client with a slot map runs the two
phases itself, in the same order with the same draw (``shared.memory.sampling.draw_slots``
over the per-slot sums in slot order), so a seed draws the same memories with the same
probabilities as through the coordinator: P(i) = w_i / W exactly. Every call carries the
map's epoch, so every answer is of one map (the coordinator holds its ``map_lock`` for the
same); phase 2 names phase 1's version, so a worker whose state moved answers ``stale``.

Anything out of the plain case returns None (after a failed phase, with the slot map fetched
again for the next sample) and the caller asks the coordinator, which
retries, waits and refuses as before: no usable map or table, n above the map's
``max_sample_batch``, an empty table (``min_size`` waits are the coordinator's), a weight sum
of 2**64 or more, a ``stale`` pick, and any failed call.

Shape letters: S slots, K draws.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np

from shared.client.memory import MemoryRouter, RoutingError
from shared.client.sampling import SampleBatch
from shared.memory.sampling import draw_slots, gather_picks, slot_sums
from shared.memory.tables import table_specs
from shared.proto import common_pb2, worker_pb2
from shared.rpc.codec import ids_to_bytes, rows_to_bytes

__all__ = ["direct_sample"]


async def direct_sample(
    router: MemoryRouter,
    n: int,
    alpha: float,
    seed: int,
    with_payloads: bool,
    wire: str,
    timeout_s: float,
) -> SampleBatch | None:
    """Draw n memories with replacement, P(i) = w_i / W, through the primaries; or None.

    Args:
        router: the client's router (its slot map, worker channels and data-plane token).
        n: draws, >= 1.
        alpha: priority exponent (checked by the workers).
        seed: the generator's seed, >= 0.
        with_payloads: answer the drawn memories' payloads.
        wire: the table as requests carry it ("" for the default one).
        timeout_s: deadline of each worker call, seconds.

    Returns:
        The draws as the coordinator's ``Sample`` would answer them for ``seed``; None when
        the coordinator should answer (module docstring).
    """
    m = router.cached_map
    if m is None or router.token_stale():
        try:
            m = await router.slot_map()
        except (RoutingError, grpc.RpcError):
            return None
    if m.epoch == 0 or (wire and wire not in table_specs(m)) or not 0 < n <= m.max_sample_batch:
        return None
    owners = sorted({w for w in m.primary if w >= 0})  # worker names are sorted in a map
    stubs = [router.worker_stub(m.workers[w], m.addresses[w]) for w in owners]
    sums = await _all(
        [
            s.SampleSums(
                worker_pb2.WorkerSampleSumsRequest(epoch=m.epoch, table=wire, alpha=alpha),
                timeout=timeout_s,
            )
            for s in stubs
        ]
    )
    if sums is None:
        await _refresh(router)
        return None
    totals_S, owner_S = slot_sums(sums, m.slots)
    size = sum(int(r.memories) for r in sums)
    # W exact: far from a wrap uint64 is; near one, the coordinator refuses or answers
    if not size or float(totals_S.sum(dtype=np.float64)) >= 2.0**63:
        return None
    total = int(totals_S.sum(dtype=np.uint64))
    if not total:
        return None  # every weight 0: the coordinator samples uniformly
    versions = [int(r.version) for r in sums]
    batch = await _pick(
        m, stubs, versions, totals_S, owner_S, n, seed, with_payloads, wire, timeout_s
    )
    if batch is not None:
        ids, strengths, weights, payloads = batch
        return SampleBatch(
            ids, strengths, [p or None for p in payloads], weights / float(total), seed, size, total
        )
    await _refresh(router)
    return None


async def _refresh(router: MemoryRouter) -> None:
    """Fetch the slot map again after a failed phase (the next sample uses the new one)."""
    try:
        await router.slot_map(refresh=True)
    except (RoutingError, grpc.RpcError):
        pass  # the coordinator's Sample reports it


async def _pick(
    m: common_pb2.SlotMap,
    stubs: list[Any],
    versions: list[int],
    totals_S: np.ndarray,
    owner_S: np.ndarray,
    n: int,
    seed: int,
    with_payloads: bool,
    wire: str,
    timeout_s: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[bytes]] | None:
    """Draw, then phase 2 on the primaries the draws fall on (as the coordinator's ``_pick``).

    Returns:
        ``gather_picks``' arrays in draw order; None after a failed call or a stale pick.
    """
    slots, offsets = draw_slots(totals_S, n, seed)
    owner = owner_S[slots]
    parts = [(i, np.flatnonzero(owner == i)) for i in range(len(stubs))]
    parts = [(i, draws) for i, draws in parts if len(draws)]
    replies = await _all(
        [
            stubs[i].SamplePick(
                worker_pb2.WorkerSamplePickRequest(
                    epoch=m.epoch,
                    table=wire,
                    version=versions[i],
                    slots=rows_to_bytes(slots[draws]),
                    offsets=ids_to_bytes(offsets[draws]),
                    with_payloads=with_payloads,
                ),
                timeout=timeout_s,
            )
            for i, draws in parts
        ]
    )
    if replies is None or any(r.stale for r in replies):
        return None
    return gather_picks(
        n, [(draws, r) for (_, draws), r in zip(parts, replies, strict=True)], with_payloads
    )


async def _all(calls: list[Any]) -> list[Any] | None:
    """Await every call; their replies, or None when any failed (the coordinator retries)."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    if any(isinstance(r, BaseException) for r in results):
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, grpc.RpcError):
                raise r
        return None
    return list(results)
