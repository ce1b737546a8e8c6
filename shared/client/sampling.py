"""A prioritized sample as the client returns it, and its request (``Client.sample``).

Shape letters: K draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shared.proto import coordinator_pb2
from shared.rpc.codec import f32_from_bytes, ids_from_bytes

__all__ = ["SampleBatch", "sample_from_pb", "sample_request"]


@dataclass(frozen=True)
class SampleBatch:
    """The draws of one sample, in draw order (an id drawn twice appears twice).

    Attributes:
        ids: [K] uint64.
        strengths: [K] float32, each draw's strength when it was drawn.
        payloads: [K] bytes, or None where the memory has none (or not asked for).
        probabilities: [K] float64, P(i) = w_i / W of each draw (importance weights
            (size * P(i)) ** -beta, Schaul et al. 2016).
        seed: the seed of the draws: passing it again with the same table content and alpha
            gives the same draws.
        size: memories in the table when sampled.
        total_weight: W, the sum of the table's integer weights.
    """

    ids: npt.NDArray[np.uint64]
    strengths: npt.NDArray[np.float32]
    payloads: list[bytes | None]
    probabilities: npt.NDArray[np.float64]
    seed: int
    size: int
    total_weight: int


def sample_request(
    table: str,
    n: int,
    alpha: float,
    replacement: bool,
    seed: int | None,
    min_size: int,
    timeout_s: float,
    with_payloads: bool,
) -> coordinator_pb2.SampleRequest:
    """The ``SampleRequest`` of ``Client.sample``'s arguments (checked by the coordinator)."""
    return coordinator_pb2.SampleRequest(
        table=table,
        n=n,
        alpha=alpha,
        without_replacement=not replacement,
        has_seed=seed is not None,
        seed=seed or 0,
        min_size=min_size,
        timeout_s=timeout_s,
        without_payloads=not with_payloads,
    )


def sample_from_pb(r: coordinator_pb2.SampleResponse) -> SampleBatch:
    """Decode a ``SampleResponse``."""
    ids = ids_from_bytes(r.ids)
    payloads: list[bytes | None] = [p or None for p in r.payloads] or [None] * len(ids)
    return SampleBatch(
        ids=ids,
        strengths=f32_from_bytes(r.strengths, "strengths"),
        payloads=payloads,
        probabilities=np.frombuffer(r.probabilities, "<f8").astype(np.float64),
        seed=int(r.seed),
        size=int(r.size),
        total_weight=int(r.total_weight),
    )
