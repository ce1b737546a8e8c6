"""Quality statistics of strengths and the exact merges of the workers' partial answers.

The coordinator merges the primaries' quality summaries and local top-k lists with these
functions; the workers' kernels produce them; the client reads them off the wire. All host
NumPy, no device code.

Shape letters: K candidates (the concatenated local top-k lists).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.proto import common_pb2

__all__ = [
    "EMPTY_QUALITY",
    "HIST_BINS",
    "Quality",
    "merge_quality",
    "merge_topk",
    "quality_from_pb",
    "quality_to_pb",
    "top_of",
]

HIST_BINS = 10


@dataclass(frozen=True)
class Quality:
    """Summary of a set of strengths.

    ``sum`` and ``mean`` are float64; ``min``/``max`` are float32 values as Python floats;
    ``histogram`` counts 10 bins of width 0.1 over [0, 1], the last one including 1.0.
    An empty set has count 0 and every other field 0.
    """

    count: int
    sum: float
    mean: float
    min: float
    max: float
    histogram: tuple[int, ...]


EMPTY_QUALITY = Quality(0, 0.0, 0.0, 0.0, 0.0, (0,) * HIST_BINS)


def merge_quality(parts: list[Quality]) -> Quality:
    """Merge summaries of disjoint sets: count, min, max and histogram exact, sum in float64."""
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


def top_of(ids: np.ndarray, strengths: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
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


def merge_topk(parts: list[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
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
    """Quality statistics as a QualityStats message."""
    return common_pb2.QualityStats(
        count=q.count,
        sum=q.sum,
        mean=q.mean,
        min=q.min,
        max=q.max,
        histogram=[int(h) for h in q.histogram],
    )


def quality_from_pb(pb: common_pb2.QualityStats) -> Quality:
    """A QualityStats message as a ``Quality``."""
    return Quality(
        count=int(pb.count),
        sum=float(pb.sum),
        mean=float(pb.mean),
        min=float(pb.min),
        max=float(pb.max),
        histogram=tuple(int(h) for h in pb.histogram),
    )
