"""The fused sweep equals decay then quality / top-k, bit for bit, on both kernel paths, and
keeps the decay's exactly-once rule (issue 12, item 2)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from shared.memory.stats import EMPTY_QUALITY
from shared.memory.validation import MemoryInputError
from shared.proto import common_pb2, worker_pb2
from tests.unit.worker.memory.node_pair import Wire, pair_map
from tests.unit.worker.store.test_kernels import _runs_case, bits
from worker.memory.memory_node import MemoryNode
from worker.store import kernels
from worker.store.journal import Journal, lock_data_dir, recover
from worker.store.kernels_numba import SWEEP_BLOCK
from worker.store.store import SlotStore

SLOTS = 8


@pytest.fixture(params=["compiled", "portable"])
def path(request, monkeypatch):
    """kernels with the numba loops, or with them disabled (the CuPy / no-numba path)."""
    if request.param == "portable":
        monkeypatch.setattr(kernels, "_nb", None)
    return request.param


def _separately(s, ids, starts, ends, rate, k):
    """The reference: decay_runs, then quality_runs and topk_runs of the same runs."""
    if rate is not None:
        kernels.decay_runs(s, starts, ends, rate)
    return kernels.quality_runs(s, starts, ends), kernels.topk_runs(s, ids, starts, ends, k)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("rate", [0.001, 0.25, 1.0, None])
def test_sweep_equals_decay_then_quality_and_topk(path, seed, rate) -> None:
    # Arrange: strengths with ties and clipped values; runs longer than a block, too.
    s, ids, starts, ends, _ = _runs_case(seed, n=3 * SWEEP_BLOCK + 17)
    long_end = 2 * SWEEP_BLOCK + 5  # a run of several blocks, then the random ones after it
    later = starts > long_end
    starts = np.concatenate([[0], starts[later]]).astype(np.int64)
    ends = np.concatenate([[long_end], ends[later]]).astype(np.int64)
    expected = s.copy()
    want_q, (want_ids, want_s) = _separately(expected, ids, starts, ends, rate, 100)

    # Act
    q, (got_ids, got_s) = kernels.sweep_runs(s, ids, starts, ends, rate, True, 100)

    # Assert: every strength, every figure (the float64 sum included) and the top-k.
    assert np.array_equal(bits(s), bits(expected))
    assert q == want_q
    assert np.array_equal(got_ids, want_ids) and np.array_equal(bits(got_s), bits(want_s))


def test_sweep_breaks_ties_by_smaller_id(path) -> None:
    # Arrange: 50 memories at 1.0 (after the decay: 0.75) and 50 weaker, ids shuffled.
    rng = np.random.default_rng(3)
    ids = rng.permutation(np.arange(100, 200, dtype=np.uint64))
    s = np.where(ids % 2 == 0, np.float32(1.0), np.float32(0.5)).astype(np.float32)
    starts, ends = np.array([0], np.int64), np.array([100], np.int64)

    # Act
    _, (top_ids, top_s) = kernels.sweep_runs(s, ids, starts, ends, 0.25, False, 10)

    # Assert: the ten smallest even ids, all at 0.75.
    assert top_ids.tolist() == list(range(100, 120, 2))
    assert np.all(top_s == np.float32(0.75))


def test_sweep_of_no_rows_and_of_nothing_asked(path) -> None:
    s, ids, none = np.ones(3, np.float32), np.arange(3, dtype=np.uint64), np.empty(0, np.int64)
    q, (top_ids, _) = kernels.sweep_runs(s, ids, none, none, 0.5, True, 5)
    assert q == EMPTY_QUALITY and top_ids.size == 0 and np.all(s == 1)
    whole = np.array([0], np.int64), np.array([3], np.int64)
    assert kernels.sweep_runs(s, ids, *whole, 0.5, False, 0) == (None, None)
    assert np.all(s == np.float32(0.5))  # decayed although nothing was asked back


def test_compiled_and_portable_paths_agree() -> None:
    s, ids, starts, ends, _ = _runs_case(4)
    a, b = s.copy(), s.copy()
    qa, (ia, sa) = kernels.sweep_runs(a, ids, starts, ends, 0.1, True, 50)
    saved, kernels._nb = kernels._nb, None
    try:
        qb, (ib, sb) = kernels.sweep_runs(b, ids, starts, ends, 0.1, True, 50)
    finally:
        kernels._nb = saved
    assert np.array_equal(bits(a), bits(b))
    assert (qa.count, qa.min, qa.max, qa.histogram) == (qb.count, qb.min, qb.max, qb.histogram)
    assert qa.sum == pytest.approx(qb.sum, rel=1e-12)  # summed in another order
    assert np.array_equal(ia, ib) and np.array_equal(bits(sa), bits(sb))


def test_store_sweep_equals_decay_then_quality_and_topk() -> None:
    # Arrange: two equal stores of 5000 memories over 16 slots.
    rng = np.random.default_rng(5)
    ids = rng.choice(1 << 40, 5000, replace=False).astype(np.uint64)
    strengths = rng.random(5000, dtype=np.float32)
    a, b = SlotStore(slots=16), SlotStore(slots=16)
    for store in (a, b):
        store.upsert(ids, strengths)
    chosen, part = [1, 2, 3, 7, 8, 15], [2, 8]

    # Act: a's sweep decays only ``part`` of the slots it summarizes (a retry's case).
    q, (top_ids, top_s) = a.sweep(0.3, chosen, 20, True, decay_slots=part)
    b.decay(0.3, part)

    # Assert
    assert q == b.quality(chosen)
    want_ids, want_s = b.topk(20, chosen)
    assert np.array_equal(top_ids, want_ids) and np.array_equal(top_s, want_s)
    assert np.array_equal(bits(a.items()[1]), bits(b.items()[1]))
    with pytest.raises(MemoryInputError, match="k"):
        a.sweep(0.3, chosen, a.k_max + 1, True)
    assert np.array_equal(bits(a.items()[1]), bits(b.items()[1]))  # refused: nothing applied


# --- the node: exactly once, replicated -----------------------------------------------------


@pytest.fixture
def pair() -> Iterator[tuple[Wire, MemoryNode, MemoryNode]]:
    wire = Wire()
    for name in ("p", "r"):
        wire.nodes[name] = MemoryNode(name, SlotStore(slots=SLOTS), wire.forward, wire.report)
    yield wire, wire.nodes["p"], wire.nodes["r"]
    for node in wire.nodes.values():
        node.close()


async def _loaded(p: MemoryNode, r: MemoryNode, ids: np.ndarray) -> np.ndarray:
    m = pair_map(SLOTS)
    for node in (p, r):
        await node.apply_slot_map(m)
    strengths = np.linspace(0, 1, len(ids), dtype=np.float32)
    request = worker_pb2.UpsertRequest(
        epoch=1, ids=ids.astype("<u8").tobytes(), strengths=strengths.tobytes()
    )
    await p.upsert(request, ids, strengths, None)
    return strengths


async def test_node_sweep_decays_once_per_op_id_and_replicates(pair) -> None:
    # Arrange: 'p' primary of every slot, 'r' its replica, 40 memories.
    wire, p, r = pair
    ids = np.arange(1, 41, dtype=np.uint64)
    strengths = await _loaded(p, r, ids)
    once = np.clip(strengths - np.float32(0.125), 0, 1)
    forwards = len(wire.forwards)

    # Act: the same sweep twice (a retry), then a read-only sweep (rate 0).
    first = await p.sweep(1, 0.125, b"op-1", 5, True)
    again = await p.sweep(1, 0.125, b"op-1", 5, True)
    read = await p.sweep(1, 0.0, b"", 5, True)

    # Assert: decayed once on both copies, forwarded once; every answer is the state after.
    assert first[0] == again[0] == read[0] == 40
    for node in (p, r):
        assert np.array_equal(bits(node.items()[1]), bits(once))
    assert len(wire.forwards) == forwards + 1
    assert wire.forwards[-1].WhichOneof("op") == "decay"
    for _, (q, (top_ids, top_s)) in (first, again, read):
        assert q.count == 40 and q.max == float(once.max()) and q.min == float(once.min())
        assert top_ids.tolist() == list(range(40, 35, -1))
        assert np.array_equal(bits(top_s), bits(once[-1:-6:-1]))


async def test_a_sweep_that_fills_the_log_is_in_the_snapshot_it_triggers(tmp_path) -> None:
    # Arrange: a primary whose journal snapshots after every 4 KiB of log, no replica.
    journal = Journal(tmp_path, lock_data_dir(tmp_path), SLOTS, 0, "always", 1.0, 4096)
    wire = Wire()
    node = MemoryNode("p", SlotStore(slots=SLOTS), wire.forward, wire.report, journal)
    m = common_pb2.SlotMap(
        epoch=1, slots=SLOTS, workers=["p"], addresses=["p:1"], primary=[0] * SLOTS
    )
    m.replica.extend([-1] * SLOTS)
    await node.apply_slot_map(m)
    ids = np.arange(1, 201, dtype=np.uint64)
    s = np.linspace(0, 1, 200, dtype=np.float32)
    await node.upsert(
        worker_pb2.UpsertRequest(epoch=1, ids=ids.tobytes(), strengths=s.tobytes()), ids, s, None
    )

    # Act: sweeps until one of them triggers a snapshot (its record is logged before its
    # pass: the snapshot must wait for the pass), then a crash and a reload.
    while journal.snapshots == 0 and journal.since_snapshot < 4096:
        await node.sweep(1, 0.01, b"", 3, True)
    await node.sweep(1, 0.01, b"", 3, True)
    want_ids, want_s = node.items()
    node.abandon()
    back = recover(tmp_path, lambda slots: SlotStore(slots=slots))

    # Assert: the reloaded store has every decay, bit for bit.
    assert back is not None
    got_ids, got_s = back.store.items()
    assert np.array_equal(got_ids, want_ids) and got_s.tobytes() == want_s.tobytes()
