"""Quality statistics of strengths and the exact merges of the workers' partial answers.

The coordinator merges the primaries' quality summaries and local top-k lists with these
functions; the workers' kernels produce them; the client reads them off the wire. All host
NumPy, no device code.

Shape letters: K candidates (the concatenated local top-k lists).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shared.proto import common_pb2

__all__ = [
    "EMPTY_QUALITY",
    "HIST_BINS",
    "Quality",
    "convergence_ratio",
    "merge_quality",
    "merge_topk",
    "quality_from_pb",
    "quality_to_pb",
    "top_of",
]

HIST_BINS = 10


@dataclass(frozen=True)
class Quality:
    """Summary of a set of strengths, as every worker computes it and the coordinator merges.

    An empty set has count 0 and every other field 0.

    Attributes:
        count: number of strengths.
        sum: their sum, accumulated in float64.
        mean: ``sum / count`` in float64.
        min: the smallest, a float32 value as a Python float.
        max: the largest, a float32 value as a Python float.
        histogram: counts of ``HIST_BINS`` bins of width 0.1 over [0, 1]; the last bin
            includes 1.0.
    """

    count: int
    sum: float
    mean: float
    min: float
    max: float
    histogram: tuple[int, ...]


EMPTY_QUALITY = Quality(0, 0.0, 0.0, 0.0, 0.0, (0,) * HIST_BINS)


def convergence_ratio(accessed_mean: float, accessed: int, table: Quality) -> float:
    """How far the memories in use stand above the store: their mean strength over the table's.

    A memory job's ``convergence`` (README, "Memory jobs: convergence and quality"): the mean
    strength of the distinct memories reinforced in the last iteration, read after that
    iteration's reinforce and decay, over the mean strength of the whole table at the same
    moment. 1 means the accesses leave no mark (used and unused memories alike); above 1 the
    store separates what is used from what is not; the ratio is at most ``1 / table.mean``.

    Args:
        accessed_mean: mean strength of the accessed memories found, float64.
        accessed: how many distinct accessed memories were found (0: none).
        table: the whole table's statistics, read after the same decay.

    Returns:
        The ratio; 0.0 when no accessed memory was found, 1.0 when every strength of the table
        is 0 (nothing to separate).
    """
    if accessed == 0:
        return 0.0
    if table.mean <= 0.0:
        return 1.0
    return float(accessed_mean / table.mean)


def merge_quality(parts: list[Quality]) -> Quality:
    """Merge the summaries of disjoint sets (the primaries' slots) into the summary of their union.

    Count, min, max and histogram are exact; sum is a float64 sum of float64 partial sums,
    so it may differ from a single-process sum in the last bits. Empty parts are ignored.
    """
    parts = [q for q in parts if q.count > 0]
    if not parts:
        return EMPTY_QUALITY
    count = sum(q.count for q in parts)
    total = float(np.sum(np.array([q.sum for q in parts], dtype=np.float64)))
    hist = np.sum(np.array([q.histogram for q in parts], dtype=np.int64), axis=0)
    return Quality(
        count=count,
        sum=total,
        mean=total / count,
        min=min(q.min for q in parts),
        max=max(q.max for q in parts),
        histogram=tuple(int(c) for c in hist),
    )


def top_of(
    ids: npt.NDArray[np.uint64], strengths: npt.NDArray[np.float32], k: int
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]:
    """The k strongest of a small candidate set, strongest first, ties broken by smaller id.

    A full sort: meant for K of at most workers x k, not for a whole store (the workers'
    kernels select from millions without sorting them).

    Args:
        ids: [K] uint64, distinct.
        strengths: [K] float32, in [0, 1] (no -0.0, no NaN).
        k: number wanted, >= 0.

    Returns:
        ``(ids, strengths)``: [min(k, K)] uint64 and float32.
    """
    order = np.lexsort((ids, -strengths))[: max(int(k), 0)]
    return ids[order], strengths[order]


def merge_topk(
    parts: Sequence[tuple[npt.ArrayLike, npt.ArrayLike]], k: int
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]:
    """Merge local top-k lists of disjoint id sets into the exact global top-k.

    Exact because each global winner is a winner of its own part: it ranks at least as
    high there as in the union.

    Args:
        parts: ``(ids [k_i] uint64, strengths [k_i] float32)`` pairs, ids disjoint.
        k: number wanted.

    Returns:
        ``(ids, strengths)`` as :func:`top_of`.
    """
    if not parts:
        return np.empty(0, np.uint64), np.empty(0, np.float32)
    ids = np.concatenate([np.asarray(p[0], dtype=np.uint64) for p in parts])
    strengths = np.concatenate([np.asarray(p[1], dtype=np.float32) for p in parts])
    return top_of(ids, strengths, k)


def quality_to_pb(q: Quality) -> common_pb2.QualityStats:
    """Encode a ``Quality`` as its wire form, a ``QualityStats`` message."""
    return common_pb2.QualityStats(
        count=q.count,
        sum=q.sum,
        mean=q.mean,
        min=q.min,
        max=q.max,
        histogram=[int(h) for h in q.histogram],
    )


def quality_from_pb(pb: common_pb2.QualityStats) -> Quality:
    """Decode a ``QualityStats`` message into a ``Quality``."""
    return Quality(
        count=int(pb.count),
        sum=float(pb.sum),
        mean=float(pb.mean),
        min=float(pb.min),
        max=float(pb.max),
        histogram=tuple(int(h) for h in pb.histogram),
    )
