"""The worker's memory metrics: one count and one duration per operation served (refused
ones not counted), and memories per role read from the node at each scrape."""

from __future__ import annotations

import numpy as np
import pytest

from shared.metrics import Metrics
from tests.unit.worker.memory.test_memory_node import (
    SLOTS,
    FakePeers,
    _ids_in,
    _primary_map,
    _write,
)
from worker.memory.memory_node import MemoryNode
from worker.memory.roles import StaleEpoch
from worker.store.store import SlotStore
from worker.store.store_metrics import StoreMetrics


def _sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_operations_are_counted_and_timed_once_per_call() -> None:
    # Arrange: 'me' is primary of slots 0-3, replica of 4-7 ('r' their primary).
    metrics = Metrics()
    ops = StoreMetrics(metrics)
    node = MemoryNode(
        "me", SlotStore(slots=SLOTS), FakePeers().forward, FakePeers().report, ops=ops
    )
    ops.report_memories(node.memories_by_role)
    try:
        await node.apply_slot_map(_primary_map(1, [0, 1, 2, 3]))
        mine = _ids_in(0, 3) + _ids_in(1, 2)

        # Act
        await _write(node, 1, mine)
        await node.get(1, np.asarray(mine, np.uint64))
        await node.get(1, np.asarray(mine[:1], np.uint64))
        await node.topk(1, 2)
        with pytest.raises(StaleEpoch):
            await _write(node, 7, mine)

        # Assert: per call, not per item; the refused write is not counted.
        assert _sample(metrics, "neuroshard_memory_ops_total", op="upsert") == 1
        assert _sample(metrics, "neuroshard_memory_ops_total", op="get") == 2
        assert _sample(metrics, "neuroshard_memory_ops_total", op="topk") == 1
        assert _sample(metrics, "neuroshard_memory_op_seconds_count", op="get") == 2
        assert _sample(metrics, "neuroshard_memory_op_seconds_sum", op="upsert") > 0
        assert _sample(metrics, "neuroshard_memories", role="primary") == 5
        assert _sample(metrics, "neuroshard_memories", role="replica") == 0
    finally:
        node.close()


def test_without_metrics_nothing_is_recorded() -> None:
    ops = StoreMetrics()

    with ops.op("get"):
        pass
    ops.report_memories(lambda: {"primary": 1})  # no registry: a no-op
