"""Prioritized sampling over the whole store: the coordinator's draw and its two phases.

Under the rebalancer's ``map_lock`` (every primary at one epoch): phase 1 asks every primary
for its slots' weight sums (``SampleSums``); the coordinator draws n integers in [0, W) with
a seeded PCG64 generator and locates each in a slot and an offset
(``shared.memory.sampling.draw_slots``); phase 2 asks each primary for the memories at its
draws' offsets (``SamplePick``), as of the state phase 1 read. P(i) = w_i / W exactly, and
the draws depend on the seed and the store's content only (docs/architecture.md,
"Sampling").

A primary that fails (a killed worker, a map moving) makes the sample start over once the
map moved past it, within ``retry_budget_s``; so does a reply marked ``stale`` (a drawn
memory deleted between the phases). ``min_size`` waits, polling phase 1, until the table
holds that many memories (Reverb's MinSize rate limiter).

Shape letters: S slots, K draws.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from grpc import aio

from coordinator.memory.memory_ops import BulkOpError, primary_stubs
from coordinator.placement.membership import Membership
from coordinator.placement.rebalance import Rebalancer
from shared.memory.sampling import DEFAULT_TABLE, draw_slots, gather_picks, slot_sums
from shared.proto import worker_pb2, worker_pb2_grpc
from shared.rpc.codec import ids_to_bytes, rows_to_bytes
from shared.rpc.limits import BudgetExceeded
from shared.rpc.peers import WorkerClients

__all__ = ["SampleRefused", "SampleResult", "Sampler"]

_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.FAILED_PRECONDITION,  # stale epoch or not primary: the map moved
}
POLL_INTERVAL_S = 0.05  # min_size: how often the table's size is read again


class SampleRefused(RuntimeError):
    """The table is empty, or did not reach ``min_size`` in time (FAILED_PRECONDITION)."""


class _Stale(Exception):
    """A primary answered ``stale`` (its state moved between the phases): sample again."""


@dataclass(frozen=True)
class SampleResult:
    """A sample's draws, in draw order.

    Attributes:
        ids: [K] uint64; strengths: [K] float32; payloads: K bytes (b"": none).
        probabilities: [K] float64, w_i / W of each draw.
        seed: the generator's seed; size: memories in the table; total_weight: W.
    """

    ids: np.ndarray
    strengths: np.ndarray
    payloads: list[bytes]
    probabilities: np.ndarray
    seed: int
    size: int
    total_weight: int


@dataclass
class _Sums:
    """Phase 1 over one map: every primary's version and the slots' sums and owners."""

    stubs: dict[str, worker_pb2_grpc.WorkerStub]
    versions: dict[str, int]
    totals_S: np.ndarray
    owner_S: np.ndarray  # index into names, -1 for no owner
    names: list[str]
    size: int
    total: int  # W, the sum of totals_S, exact


class Sampler:
    """Samples the store through the primaries of the current slot map."""

    def __init__(
        self,
        rebalancer: Rebalancer,
        membership: Membership,
        clients: WorkerClients,
        rpc_timeout_s: float,
        retry_budget_s: float = 10.0,
    ) -> None:
        """Sample over ``rebalancer``'s current map.

        Args:
            rebalancer: owner of the slot map and its ``map_lock``.
            membership: where the primaries' addresses are.
            clients: channels to the workers.
            rpc_timeout_s: deadline of each worker call, seconds.
            retry_budget_s: how long a sample is started over after a primary failed,
                seconds (long enough for a dead worker's slots to be promoted).
        """
        self._rebalancer = rebalancer
        self._membership = membership
        self._clients = clients
        self._timeout_s = rpc_timeout_s
        self._retry_budget_s = retry_budget_s

    async def sample(
        self,
        n: int,
        alpha: float,
        seed: int,
        min_size: int = 0,
        timeout_s: float = 30.0,
        with_payloads: bool = True,
        table: str = DEFAULT_TABLE,
    ) -> SampleResult:
        """Draw n memories with replacement, P(i) = w_i / W (validated arguments).

        Args:
            n: draws, 1 .. max_sample_batch.
            alpha: priority exponent, finite and >= 0.
            seed: the generator's seed, >= 0.
            min_size: wait until the table holds this many memories (0: no wait).
            timeout_s: how long ``min_size`` may wait, seconds.
            with_payloads: answer the drawn memories' payloads.
            table: the table sampled (checked by the caller: it exists).

        Raises:
            SampleRefused: an empty table without ``min_size``, or ``min_size`` not reached
                within ``timeout_s`` (FAILED_PRECONDITION; the message names the size).
            BulkOpError: a primary still failed when the retry budget ran out (UNAVAILABLE).
            BudgetExceeded: a reply over a worker's max_message_bytes (RESOURCE_EXHAUSTED).
        """
        loop = asyncio.get_running_loop()
        wait_until = loop.time() + timeout_s
        retry_until = loop.time() + self._retry_budget_s
        backoff_s = 0.05
        while True:
            try:
                async with self._rebalancer.map_lock:
                    sums = await self._sums(table, alpha, uniform=False)
                    if sums.size < max(min_size, 1):
                        if not min_size:
                            raise SampleRefused(
                                f"table {table!r} is empty: nothing to sample "
                                "(min_size waits for memories)"
                            )
                        if loop.time() + POLL_INTERVAL_S > wait_until:
                            raise SampleRefused(
                                f"table {table!r} holds {sums.size} memories, fewer "
                                f"than min_size {min_size}, after {timeout_s:g} s"
                            )
                        pause_s = POLL_INTERVAL_S
                    else:
                        if not sums.total:
                            sums = await self._sums(table, alpha, uniform=True)  # all weights 0
                        return await self._pick(table, sums, n, seed, with_payloads)
            except (BulkOpError, _Stale) as exc:
                retryable = isinstance(exc, _Stale) or exc.retryable
                pause_s = backoff_s * random.uniform(0.5, 1.0)
                if not retryable or loop.time() + pause_s > retry_until:
                    raise BulkOpError(f"sample: {exc}") from None
                backoff_s = min(2 * backoff_s, 1.0)
            await asyncio.sleep(pause_s)

    async def _sums(self, table: str, alpha: float, uniform: bool) -> _Sums:
        """Phase 1 on every primary of the current map (``map_lock`` held)."""
        current = self._rebalancer.current
        names, stub_list = primary_stubs(
            current, self._membership, self._clients, "sample weight sums"
        )
        stubs = dict(zip(names, stub_list, strict=True))
        request = worker_pb2.WorkerSampleSumsRequest(
            epoch=current.epoch, table=table, alpha=alpha, uniform=uniform
        )
        replies = await _all(
            {n: s.SampleSums(request, timeout=self._timeout_s) for n, s in stubs.items()},
            "sample weight sums",
        )
        totals_S, owner_S = slot_sums([replies[n] for n in names], current.slots)
        total = _weight_sum(totals_S)
        if total >= 2**64:
            raise BudgetExceeded("sample: the table's weight sum W overflows 64 bits")
        return _Sums(
            stubs,
            {n: int(r.version) for n, r in replies.items()},
            totals_S,
            owner_S,
            names,
            sum(int(r.memories) for r in replies.values()),
            total,
        )

    async def _pick(
        self, table: str, sums: _Sums, n: int, seed: int, with_payloads: bool
    ) -> SampleResult:
        """Draw, then phase 2 on the primaries the draws fall on (``map_lock`` held)."""
        slots, offsets = draw_slots(sums.totals_S, n, seed)
        owner = sums.owner_S[slots]
        epoch = self._rebalancer.current.epoch
        parts = {name: np.flatnonzero(owner == i) for i, name in enumerate(sums.names)}
        parts = {name: draws for name, draws in parts.items() if len(draws)}
        replies = await _all(
            {
                name: sums.stubs[name].SamplePick(
                    worker_pb2.WorkerSamplePickRequest(
                        epoch=epoch,
                        table=table,
                        version=sums.versions[name],
                        slots=rows_to_bytes(slots[draws]),
                        offsets=ids_to_bytes(offsets[draws]),
                        with_payloads=with_payloads,
                    ),
                    timeout=self._timeout_s,
                )
                for name, draws in parts.items()
            },
            "sample picks",
        )
        stale = sorted(name for name, r in replies.items() if r.stale)
        if stale:
            raise _Stale(f"primaries {', '.join(stale)} changed between the phases")
        ids, strengths, weights, payloads = gather_picks(
            n, [(draws, replies[name]) for name, draws in parts.items()], with_payloads
        )
        return SampleResult(
            ids, strengths, payloads, weights / float(sums.total), seed, sums.size, sums.total
        )


def _weight_sum(totals_S: np.ndarray) -> int:
    """W = the sum of totals_S [S] uint64, exact (a Python int, never wrapped at 2**64)."""
    if float(totals_S.sum(dtype=np.float64)) < 2.0**63:  # far from a wrap: uint64 is exact
        return int(totals_S.sum(dtype=np.uint64))
    return sum(int(t) for t in totals_S.tolist())


async def _all(calls: dict[str, Awaitable[Any]], what: str) -> dict[str, Any]:
    """Await each primary's call; all replies, or BulkOpError naming the failed ones.

    Raises:
        BulkOpError: retryable when every failure may pass once the map moves.
        BudgetExceeded: a worker refused a reply over its message limit (RESOURCE_EXHAUSTED).
    """
    names = list(calls)
    results = await asyncio.gather(*calls.values(), return_exceptions=True)
    failed = [(n, r) for n, r in zip(names, results, strict=True) if isinstance(r, BaseException)]
    if not failed:
        return dict(zip(names, results, strict=True))
    for _, exc in failed:
        if isinstance(exc, aio.AioRpcError) and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise BudgetExceeded(exc.details() or "a sample reply is too large")
    n, first = failed[0]
    detail = first.details() if isinstance(first, aio.AioRpcError) else str(first)
    retryable = all(isinstance(e, aio.AioRpcError) and e.code() in _RETRYABLE for _, e in failed)
    raise BulkOpError(
        f"{what}: {len(failed)} of {len(names)} primaries failed "
        f"({', '.join(sorted(f for f, _ in failed))}; first: {n}: {detail})",
        retryable,
    )
