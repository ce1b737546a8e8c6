"""A worker's two phases of a prioritized sample, as replies built on the store thread.

Phase 1 (``sums_reply``) brings the primary slots' sampling structure up to date and
answers each slot's weight sum with the version it is of; phase 2 (``pick_reply``) maps the
coordinator's draws (slot, offset) to memories as of that version, with their payloads read
now. A drawn memory deleted between the phases, or a version no longer kept, makes the reply
``stale`` and nothing else: the coordinator samples again, so a deleted id is never answered.
Semantics and costs: ``worker/store/sampling.py``; the draw: ``shared/memory/sampling.py``.

Shape letters: T primary slots, K draws.
"""

from __future__ import annotations

import numpy as np

from shared.proto import worker_pb2
from shared.rpc.codec import f32_to_bytes, ids_to_bytes
from shared.rpc.limits import BudgetExceeded
from worker.store.sampling import UNIFORM, StaleVersion
from worker.store.store import SlotStore

__all__ = ["pick_reply", "sums_reply"]


def sums_reply(
    store: SlotStore, alpha: float, uniform: bool, primary: np.ndarray, table: str
) -> worker_pb2.WorkerSampleSumsResponse:
    """On the store thread: phase 1 over the primary slots [T] int64 (ascending).

    Args:
        store: the worker's store.
        alpha: the priority exponent, finite and >= 0 (validated by the caller).
        uniform: weight 1 per memory instead (``sampling.UNIFORM``).
        primary: [T] int64 this worker's primary slots.
        table: the table sampled (checked by the caller).
    """
    version, totals, memories = store.sample_sums(UNIFORM if uniform else alpha, primary, table)
    return worker_pb2.WorkerSampleSumsResponse(
        version=version,
        slots=primary.tolist(),
        totals=totals.astype("<u8").tobytes(),
        memories=memories,
    )


def pick_reply(
    store: SlotStore,
    version: int,
    slots: np.ndarray,
    offsets: np.ndarray,
    with_payloads: bool,
    max_bytes: int | None,
    table: str,
) -> worker_pb2.WorkerSamplePickResponse:
    """On the store thread: phase 2, the memories at draws (slot, offset) as of ``version``.

    Args:
        store: the worker's store.
        version: from phase 1.
        slots: [K] int64 primary slots (checked by the caller).
        offsets: [K] uint64, each below its slot's sum at ``version``.
        with_payloads: answer the payloads too.
        max_bytes: the largest reply, bytes; None: no limit.
        table: the table sampled (checked by the caller).

    Raises:
        BudgetExceeded: the reply would exceed ``max_bytes`` (RESOURCE_EXHAUSTED).
        MemoryInputError: an offset past its slot's sum (INVALID_ARGUMENT).
    """
    try:
        ids, strengths, weights, payloads, present = store.sample_pick(
            version, slots, offsets, with_payloads, table
        )
    except StaleVersion:
        return worker_pb2.WorkerSamplePickResponse(stale=True)
    if not present.all():
        return worker_pb2.WorkerSamplePickResponse(stale=True)
    size = 24 * len(ids) + 30 + sum(len(p) + 6 for p in payloads)
    if max_bytes is not None and size > max_bytes:
        raise BudgetExceeded(
            f"SamplePick reply of {len(ids)} draws would be {size} bytes, over "
            f"max_message_bytes {max_bytes}; ask for fewer draws (or without payloads)"
        )
    return worker_pb2.WorkerSamplePickResponse(
        ids=ids_to_bytes(ids),
        strengths=f32_to_bytes(strengths),
        weights=weights.astype("<u8").tobytes(),
        payloads=payloads if with_payloads else [],
    )
