"""What the ``memory`` job stores and which ids it reinforces.

Generated memories, YCSB's scrambled Zipfian access stream, and trace replay.

Everything is a pure function of the job's seed, so a run can be replayed exactly (the
integration test replays a job against ``tests.memory_reference.ReferenceStore``). Each
consumer draws from its own stream, ``np.random.default_rng([seed, STREAM])``, so changing
one (e.g. the access batch size) leaves the others alone.

Shape letters: N memories, B accesses per iteration, I iterations.
"""

from __future__ import annotations

import numpy as np

MEMORIES_STREAM, SCRAMBLE_STREAM, ACCESS_STREAM = 0, 1, 2
ID_SPACE = 2**63 - 1  # generated ids lie in [0, 2**63 - 1)


def generate_memories(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Draw n distinct ids and their initial strengths.

    Returns:
        ids [N] uint64, distinct, uniform over [0, 2**63 - 1) without replacement;
        strengths [N] float32, uniform in [0, 1).
    """
    rng = np.random.default_rng([seed, MEMORIES_STREAM])
    ids = rng.choice(ID_SPACE, size=n, replace=False).astype(np.uint64)
    strengths = rng.random(n, dtype=np.float32)
    return ids, strengths


def zeta(n: int, theta: float, chunk: int = 1 << 22) -> float:
    """The generalized harmonic number ``sum_{i=1..n} 1 / i**theta`` in float64.

    Summed in chunks (so n may be large) from i = 1 upwards, as YCSB's ``zetastatic`` does.
    """
    total = 0.0
    for start in range(1, n + 1, chunk):
        i = np.arange(start, min(start + chunk, n + 1), dtype=np.float64)
        total += float(np.sum(i**-theta))
    return total


class ZipfianGenerator:
    """Zipf-distributed ranks in [0, items): rank 0 is the most popular, P(r) ~ 1/(r+1)**theta.

    The algorithm of Gray et al., "Quickly generating billion-record synthetic databases"
    (SIGMOD 1994), exactly as YCSB's ``ZipfianGenerator.nextLong`` implements it, vectorized:
    ``u ~ U[0, 1)``; rank 0 if ``u * zeta(n) < 1``, rank 1 if below ``1 + 0.5**theta``, else
    ``floor(n * (eta * u - eta + 1) ** (1 / (1 - theta)))`` with
    ``eta = (1 - (2 / n)**(1 - theta)) / (1 - zeta(2) / zeta(n))``. Needs 0 < theta < 1.
    """

    def __init__(self, items: int, theta: float, rng: np.random.Generator) -> None:
        """Precompute zeta(items) and the constants of the draw.

        Args:
            items: n, the number of ranks, >= 1.
            theta: the Zipf exponent, 0 < theta < 1.
            rng: the generator every draw uses.

        Raises:
            ValueError: items < 1 or theta outside (0, 1).
        """
        if items < 1 or not 0 < theta < 1:
            raise ValueError(f"need items >= 1 and 0 < theta < 1, got {items}, {theta}")
        self.items, self.theta, self._rng = items, theta, rng
        self.zetan = zeta(items, theta)
        self._alpha = 1.0 / (1.0 - theta)
        self._rank1 = 1.0 + 0.5**theta
        zeta2 = zeta(2, theta)
        self._eta = (
            (1.0 - (2.0 / items) ** (1.0 - theta)) / (1.0 - zeta2 / self.zetan)
            if items > 2
            else 0.0
        )

    def ranks(self, size: int) -> np.ndarray:
        """Draw ``size`` ranks: [size] int64 in [0, items)."""
        u = self._rng.random(size)
        uz = u * self.zetan
        with np.errstate(invalid="ignore"):
            r = np.floor(self.items * (self._eta * u - self._eta + 1.0) ** self._alpha)
        ranks = np.where(uz < 1.0, 0, np.where(uz < self._rank1, 1, r))
        # u close to 1 can round to rank n; YCSB would return it, we stay in range.
        return np.asarray(np.clip(np.nan_to_num(ranks), 0, self.items - 1), dtype=np.int64)


class ScrambledZipfStream:
    """Zipf-popular ids whose popularity is unrelated to id order.

    Like YCSB's ``ScrambledZipfianGenerator``, ranks are scattered over the key space so the
    hot ids do not cluster; here through a seeded permutation rather than an FNV hash, so
    every id has exactly one rank and there are no collisions.
    """

    def __init__(self, ids: np.ndarray, theta: float, batch: int, seed: int) -> None:
        """Scatter the ranks over ``ids`` with a permutation seeded by ``seed``.

        Args:
            ids: [N] uint64, distinct: the key space.
            theta: the Zipf exponent, in (0, 1).
            batch: B >= 1, ids drawn per iteration.
            seed: the job's seed (its scramble and access streams are derived from it).
        """
        perm = np.random.default_rng([seed, SCRAMBLE_STREAM]).permutation(len(ids))
        self.by_rank = np.ascontiguousarray(ids[perm])  # [N] uint64: id of rank r
        self.batch = batch
        self._zipf = ZipfianGenerator(len(ids), theta, np.random.default_rng([seed, ACCESS_STREAM]))

    def next_batch(self, iteration: int) -> np.ndarray:
        """The ids accessed in ``iteration`` (drawn in order): [B] uint64, repeats allowed."""
        return np.take(self.by_rank, self._zipf.ranks(self.batch))


class TraceStream:
    """Replays a trace: row ``iteration`` of an [I, B] trace, or the single row of [1, B]."""

    def __init__(self, trace_IB: np.ndarray) -> None:
        """Replay ``trace_IB``: [I, B] or [1, B] uint64 ids (``load_trace`` checked it)."""
        self.trace_IB = trace_IB
        self.batch = int(trace_IB.shape[1])

    def next_batch(self, iteration: int) -> np.ndarray:
        """The ids accessed in ``iteration``: [B] uint64."""
        return np.asarray(self.trace_IB[iteration if len(self.trace_IB) > 1 else 0])
