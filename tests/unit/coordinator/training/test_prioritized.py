"""PrioritizedSampling against fakes of the store: the table's life, the draws' layout, the
write-back and the decay (the arithmetic is ``test_priority_rules``; the whole path through
real daemons is ``tests/integration/test_prioritized_training.py``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from coordinator.training.prioritized import (
    PrioritizedSampling,
    PriorityStore,
    left_tables,
    priority_table,
)
from coordinator.training.priority_rules import draw_seed
from coordinator.training.step_types import Piece, ShardResult, StepOutcome, StepPlan
from shared.config import TrainJobSpec


class FakeStore:
    """Tables, sampler, memory ops, router and rebalancer in one, recording the calls."""

    def __init__(self, existing: bool = False) -> None:
        self.names = {"job-j-priorities"} if existing else set()
        self.calls: list[tuple[Any, ...]] = []
        self.next_id = 7

    # Tables
    def specs(self) -> list[Any]:
        return [SimpleNamespace(name=n) for n in sorted(self.names)]

    def spec(self, name: str) -> Any:
        return SimpleNamespace(name=name, id=3)

    async def create(self, name: str) -> Any:
        self.names.add(name)
        self.calls.append(("create", name))
        return SimpleNamespace(name=name, id=self.next_id)

    async def drop(self, name: str) -> None:
        self.names.discard(name)
        self.calls.append(("drop", name))

    # Router
    async def upsert(self, ids, strengths, payloads, table: str = "") -> int:
        self.calls.append(("upsert", ids.tolist(), strengths.tolist(), table))
        return len(ids)

    async def update_strengths(self, ids, strengths, request_id, table: str = "") -> int:
        self.calls.append(("update", ids.tolist(), strengths.tolist(), request_id, table))
        return len(ids)

    # Sampler: row k of a draw is (seed + k) % 10, every P(i) 1/10
    async def sample(self, n, alpha, seed, with_payloads=True, table=""):
        self.calls.append(("sample", n, alpha, seed, table))
        ids = (np.arange(n, dtype=np.uint64) + np.uint64(seed % 10)) % np.uint64(10)
        return SimpleNamespace(ids=ids, probabilities=np.full(n, 0.1), size=10)

    # MemoryOps
    async def quality(self, table):
        return SimpleNamespace(histogram=[0] * 9 + [3], count=3, mean=1.0, min=1.0, max=1.0)

    async def decay(self, rate, op_id, table):
        self.calls.append(("decay", rate, op_id, table))
        return 10

    # Rebalancer
    async def wait_settled(self, timeout_s: float) -> None:
        return None


class FakeSteps:
    """Steps of 3 rows (pieces of 2 and 1), 4 steps an epoch, 10 in all."""

    per_epoch, total = 4, 10

    def plan(self, step, members, rates) -> StepPlan:
        return StepPlan([Piece(0, np.arange(2), 0), Piece(1, np.arange(1), 1)], step % 4)


def sampling(store: FakeStore, **fields: Any) -> PrioritizedSampling:
    spec = TrainJobSpec.model_validate(
        {"kind": "train", "seed": 5, "sampling": {"name": "prioritized"} | fields}
    )
    s: Any = store
    return PrioritizedSampling("j", spec, FakeSteps(), 10, PriorityStore(s, s, s, s, s, 4, 1.0))


async def test_a_fresh_job_drops_a_left_table_and_fills_a_new_one() -> None:
    store = FakeStore(existing=True)

    await sampling(store).open(fresh=True)

    assert [c[0] for c in store.calls] == ["drop", "create", "upsert"]
    assert store.calls[2] == ("upsert", list(range(10)), [1.0] * 10, priority_table("j"))


async def test_a_resumed_job_keeps_its_table() -> None:
    store = FakeStore(existing=True)

    await sampling(store).open(fresh=False)

    assert store.calls == []


async def test_a_step_is_drawn_into_its_pieces_with_weights_and_written_back() -> None:
    store = FakeStore()
    s = sampling(store)
    await s.open(fresh=True)
    plan = FakeSteps().plan(5, [], {})

    filled = await s.fill(5, plan)
    outcome = StepOutcome(
        results={
            0: ShardResult(2, 0.0, 0, {}, losses=np.array([1.0, 3.0], np.float32)),
            1: ShardResult(1, 0.0, 0, {}, losses=np.array([2.0], np.float32)),
        }
    )
    await s.record(5, filled, outcome)
    await s.end_epoch(1)

    seed = draw_seed(5, 1, 5)
    assert store.calls[2] == ("sample", 3, 0.6, seed, "job-j-priorities")
    drawn = [(seed + k) % 10 for k in range(3)]
    assert [p.rows.tolist() for p in filled.pieces] == [drawn[:2], drawn[2:]]
    assert all(p.weights is not None and (p.weights == 1.0).all() for p in filled.pieces)
    assert all(p.shard == -1 for p in filled.pieces)
    update = store.calls[3]
    assert update[1] == drawn and update[3] == b"j/7/s5"
    m = 2.0  # the running mean of 1, 3 and 2
    assert update[2] == pytest.approx(
        [0.01 + 0.99 * (1 - np.exp(-loss / m)) for loss in (1.0, 3.0, 2.0)], abs=1e-7
    )
    assert store.calls[4:] == []  # decay_rate 0: no decay


async def test_the_decay_runs_once_per_epoch_by_its_op_id() -> None:
    store = FakeStore()
    s = sampling(store, decay_rate=0.25)
    await s.open(fresh=True)

    await s.end_epoch(2)

    assert store.calls[-1] == ("decay", 0.25, b"j/7/e2", "job-j-priorities")
    assert s.histogram == [0] * 9 + [3]  # read after the decay, for the progress


async def test_a_draw_larger_than_max_sample_batch_goes_in_parts() -> None:
    class Wide(FakeSteps):
        def plan(self, step, members, rates) -> StepPlan:
            return StepPlan([Piece(0, np.arange(6), 0), Piece(1, np.arange(3), 1)], 0)

    store = FakeStore()
    s = sampling(store)
    s.scheme = Wide()
    await s.open(fresh=True)

    filled = await s.fill(0, Wide().plan(0, [], {}))

    samples = [c for c in store.calls if c[0] == "sample"]
    assert [c[1] for c in samples] == [4, 4, 1]  # max_sample_batch 4
    assert [c[3] for c in samples] == [draw_seed(5, 0, 0, k) for k in range(3)]
    assert sum(len(p.rows) for p in filled.pieces) == 9 and s.drawn == 9


def test_left_tables_are_those_of_the_ended_jobs_only() -> None:
    tables = ["default", "job-a-priorities", "job-b-priorities", "job-mine-priorities", "t"]

    assert left_tables(tables, ["b", "a", "gone"]) == ["job-a-priorities", "job-b-priorities"]
    assert left_tables(tables, []) == []
