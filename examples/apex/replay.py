"""The replay the Ape-X example writes to and samples from: a neuroshard table, or a local one.

:class:`LocalReplay` is the single-process exact prioritized replay (the semantics the cluster's
table has: P(i) = s_i^alpha / sum_j s_j^alpha, FIFO removal at capacity, decay clipped at 0), for
tuning and tests without a cluster. Shapes: K ids of a call, B draws of a sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class Drawn:
    """One sample: ids [B] uint64, payloads [B] bytes, probabilities [B] float64, table size."""

    ids: np.ndarray
    payloads: list[bytes]
    probs: np.ndarray
    size: int


class Replay(Protocol):
    """What the actors and the learner need of a replay table."""

    def insert(self, ids: np.ndarray, priorities: np.ndarray, payloads: list[bytes]) -> None:
        """Insert K memories (ids [K] uint64, priorities [K] float32 in [0, 1])."""

    def sample(self, n: int, alpha: float, seed: int) -> Drawn:
        """Draw n with replacement, P(i) proportional to s_i^alpha."""

    def update(self, ids: np.ndarray, priorities: np.ndarray) -> None:
        """Set the strengths of K ids (payloads kept; ids no longer held are skipped)."""

    def decay(self, rate: float) -> None:
        """Lower every strength by rate, clipped at 0."""

    def size(self) -> int:
        """Return the number of memories held."""


class LocalReplay:
    """An exact prioritized replay in one process (FIFO removal at ``capacity``)."""

    def __init__(self, capacity: int) -> None:
        """Hold at most ``capacity`` memories."""
        self.capacity = capacity
        self._ids = np.zeros(capacity, np.uint64)
        self._s = np.zeros(capacity, np.float32)
        self._payloads: list[bytes] = [b""] * capacity
        self._row: dict[int, int] = {}
        self._next = 0  # ring position of the oldest insert once full

    def insert(self, ids: np.ndarray, priorities: np.ndarray, payloads: list[bytes]) -> None:
        """Insert, removing the oldest memories when full."""
        for i, p, b in zip(ids.tolist(), priorities.tolist(), payloads, strict=True):
            if i in self._row:
                r = self._row[i]
            else:
                r = self._next
                if len(self._row) == self.capacity:
                    del self._row[int(self._ids[r])]
                self._next = (self._next + 1) % self.capacity
                self._row[i] = r
                self._ids[r] = i
            self._s[r] = np.float32(min(max(p, 0.0), 1.0))
            self._payloads[r] = b

    def sample(self, n: int, alpha: float, seed: int) -> Drawn:
        """Draw n with replacement by s^alpha (uniform over held memories when alpha is 0)."""
        rows = np.fromiter(self._row.values(), np.int64, len(self._row))
        w = np.ones(len(rows)) if alpha == 0 else self._s[rows].astype(np.float64) ** alpha
        if w.sum() <= 0:
            raise RuntimeError("every priority is 0")
        p = w / w.sum()
        pick = np.random.default_rng(seed).choice(len(rows), size=n, p=p)
        chosen = rows[pick]
        return Drawn(self._ids[chosen], [self._payloads[r] for r in chosen], p[pick], len(rows))

    def update(self, ids: np.ndarray, priorities: np.ndarray) -> None:
        """Set strengths of held ids; others are skipped."""
        for i, p in zip(ids.tolist(), priorities.tolist(), strict=True):
            r = self._row.get(i)
            if r is not None:
                self._s[r] = np.float32(min(max(p, 0.0), 1.0))

    def decay(self, rate: float) -> None:
        """Lower every strength by rate, clipped at 0."""
        np.clip(self._s - np.float32(rate), 0, 1, out=self._s)

    def size(self) -> int:
        """Return the number of memories held."""
        return len(self._row)


class ClusterReplay:
    """A neuroshard table as the replay (a ``SyncClient`` of the caller's process)."""

    def __init__(self, address: str | None, table: str, timeout_s: float = 30.0) -> None:
        """Connect to the coordinator at ``address`` (None: $NEUROSHARD_COORDINATOR)."""
        from shared.client import SyncClient

        self.table = table
        self._client = SyncClient(address, timeout_s=timeout_s)

    def insert(self, ids: np.ndarray, priorities: np.ndarray, payloads: list[bytes]) -> None:
        """Upsert K memories into the table (FIFO removal when full is the table's)."""
        self._client.upsert(ids, priorities, payloads, table=self.table)

    def sample(self, n: int, alpha: float, seed: int, min_size: int = 0) -> Drawn:
        """Draw n with replacement by s^alpha, exact over the table (waits for min_size)."""
        b = self._client.sample(n, alpha=alpha, seed=seed, min_size=min_size, table=self.table)
        return Drawn(b.ids, [p or b"" for p in b.payloads], b.probabilities, b.size)

    def update(self, ids: np.ndarray, priorities: np.ndarray) -> None:
        """Bulk priority update: payloads kept, ids no longer held skipped."""
        self._client.update_strengths(ids, priorities, table=self.table)

    def decay(self, rate: float) -> None:
        """Decay the table's strengths by rate (clipped at 0)."""
        self._client.decay(rate, table=self.table)

    def size(self) -> int:
        """Return the table's number of memories."""
        return int(self._client.quality(table=self.table)["count"])

    def close(self) -> None:
        """Close the client."""
        self._client.close()


@dataclass
class ClusterReplayFactory:
    """Picklable: makes a :class:`ClusterReplay` in each actor and in the learner."""

    address: str | None
    table: str

    def __call__(self) -> ClusterReplay:
        """Return a new client of the table."""
        return ClusterReplay(self.address, self.table)

    def create(self, capacity: int) -> None:
        """Create the table (capacity, FIFO removal; replaces none: the name must be free)."""
        r = ClusterReplay(self.address, self.table)
        try:
            r._client.create_table(self.table, capacity=capacity, eviction="fifo")
        finally:
            r.close()

    def drop(self) -> None:
        """Drop the table."""
        r = ClusterReplay(self.address, self.table)
        try:
            r._client.drop_table(self.table)
        finally:
            r.close()
