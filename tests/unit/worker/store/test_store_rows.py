"""Tests for the store's row layout (worker/store/slot_rows.py, worker/store/row_index_numba.py).

The store keeps each slot's memories at the front of a region of its row buffers and finds
them through a hash table. These tests drive the paths the small cases of test_store.py
rarely reach (regions outgrowing their room and moving, the buffers laid out again, the
table growing, deletes filling holes from the tail, dropped slots giving memory back) and
check the store against the independent reference after every step.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.memory.slots import slot_of, sort_key
from shared.memory.validation import MemoryInputError
from tests.memory_reference import ReferenceStore
from worker.store import row_index_numba as row_index
from worker.store.store import SlotSnapshot, SlotStore


def assert_store_equals(store: SlotStore, ref: ReferenceStore) -> None:
    """Same memories bit for bit, every one found by its id, regions and counts consistent."""
    ids, strengths = store.items()
    ref_ids, ref_s = ref.items()
    np.testing.assert_array_equal(ids, ref_ids)
    assert strengths.view(np.uint32).tolist() == ref_s.view(np.uint32).tolist()
    assert len(store) == store.count() == len(ref_ids) == int(store.slot_counts().sum())
    np.testing.assert_array_equal(
        store.slot_counts(), np.bincount(slot_of(ids, store.slots), minlength=store.slots)
    )
    found, got, _ = store.get(ref_ids)
    assert found.all() and got.view(np.uint32).tolist() == ref_s.view(np.uint32).tolist()
    starts, ends = store.table("default")._run_bounds(None)
    rows = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends, strict=True)] or [[]])
    assert sorted(store.ids[rows.astype(np.int64)].tolist()) == ref_ids.tolist()


@pytest.mark.parametrize("slots", [1, 2, 16, 1024, 1 << 16])
def test_compiled_sort_key_equals_the_shared_one(slots: int) -> None:
    rng = np.random.default_rng(slots)
    ids = np.concatenate(
        [
            np.array([0, 1, 2**63, 2**64 - 1, 12345678901234567], np.uint64),
            rng.integers(0, 2**64 - 1, 1000, np.uint64, endpoint=True),
        ]
    )

    got = row_index.sort_keys(ids, slots.bit_length() - 1)

    np.testing.assert_array_equal(got, sort_key(ids, slots))


# --- growth, moves and deletes against the reference ---------------------------------------

POOL = 3000  # ids 0..POOL-1: batches mix new ids and ids held
BATCH = st.lists(st.integers(0, POOL - 1), min_size=1, max_size=400)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("upsert"), BATCH),
        st.tuples(st.just("delete"), BATCH),
        st.tuples(st.just("reinforce"), BATCH),
        st.tuples(st.just("decay"), st.floats(0, 0.5, width=32)),
        st.tuples(st.just("drop"), st.integers(0, 31)),
        st.tuples(st.just("copy"), st.integers(0, 31)),
    ),
    min_size=1,
    max_size=14,
)


def _apply(op: tuple, store: SlotStore, ref: ReferenceStore, other: SlotStore) -> None:
    kind, arg = op
    ids = np.asarray(arg, np.uint64) if isinstance(arg, list) else None
    if kind == "upsert":
        values = (np.asarray(arg, np.float32) % 97) / 97
        assert store.upsert(ids, values) == ref.upsert(ids, values)
    elif kind == "delete":
        assert store.delete(ids) == ref.delete(ids)
    elif kind == "reinforce":
        boosts = np.full(len(arg), 0.01, np.float32)
        assert store.reinforce(ids, boosts) == ref.reinforce(ids, boosts)
    elif kind == "decay":
        assert store.decay(arg) == ref.decay(arg)
    elif kind == "drop":  # the reference loses the slot too: delete its ids
        ref_ids, _ = ref.items()
        ref.delete(ref_ids[slot_of(ref_ids, store.slots) == arg % store.slots])
        store.drop_slots([arg % store.slots])
    else:  # copy a slot out to another store, then back in place of itself
        other.import_slot(store.export_slot(arg % store.slots))
        store.import_slot(other.export_slot(arg % store.slots))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([4, 32]), OPS)
def test_regions_moving_and_laid_out_again_keep_every_memory(slots: int, ops: list) -> None:
    # Arrange: few slots, so regions outgrow their room within a batch: with 4 the buffers
    # are laid out again, with 32 a region mostly moves to the spare rows alone.
    store, ref, other = SlotStore(slots), ReferenceStore(slots), SlotStore(slots)

    for op in ops:
        # Act
        _apply(op, store, ref, other)

        # Assert
        assert_store_equals(store, ref)


def test_many_inserts_in_small_batches_grow_the_table_and_keep_kernels_exact() -> None:
    # Arrange: far past the first table (1024 cells) and many buffer layouts.
    rng = np.random.default_rng(7)
    ids = np.unique(rng.integers(0, 2**64 - 1, 440_000, np.uint64))[:400_000]
    ids = rng.permutation(ids)
    values = rng.random(len(ids), dtype=np.float32)
    store, ref = SlotStore(1024), ReferenceStore(1024)

    # Act
    for a in range(0, len(ids), 20_000):
        store.upsert(ids[a : a + 20_000], values[a : a + 20_000])
    ref.upsert(ids, values)
    gone = ids[rng.integers(0, len(ids), 80_000)]
    assert store.delete(gone) == ref.delete(gone)
    store.decay(0.25, list(range(0, 1024, 3)))
    ref.decay(0.25, list(range(0, 1024, 3)))

    # Assert
    assert len(store.strength) >= len(store) and len(store._rows.table) >= 2 * len(store)
    assert_store_equals(store, ref)
    quality, want = store.quality(), ref.quality()
    assert (quality.count, quality.min, quality.max, quality.histogram) == (
        want.count,
        want.min,
        want.max,
        want.histogram,
    )
    assert quality.sum == pytest.approx(want.sum, rel=1e-12)
    got_ids, got_s = store.topk(100, list(range(0, 1024, 2)))
    want_ids, want_s = ref.topk(100, list(range(0, 1024, 2)))
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_s, want_s)


def test_dropping_most_slots_gives_the_row_buffers_back() -> None:
    # Arrange
    rng = np.random.default_rng(8)
    ids = rng.choice(1 << 40, size=100_000, replace=False).astype(np.uint64)
    store = SlotStore(64)
    store.upsert(ids, rng.random(len(ids), dtype=np.float32), [b"x"] * len(ids))
    capacity = len(store.ids)

    # Act
    dropped = store.drop_slots(range(8, 64))

    # Assert: the rows left are a fraction, and so is the room they take.
    kept = np.isin(slot_of(ids, 64), range(8))
    assert dropped == int((~kept).sum()) and len(store) == int(kept.sum())
    assert len(store.ids) < capacity // 4
    assert len(store.payloads) == len(store)
    assert store.get(ids[kept])[0].all() and not store.get(ids[~kept])[0].any()


def test_export_is_in_key_order_whatever_order_rows_were_written_in() -> None:
    # Arrange: the same memories written in two orders, with deletes in between.
    ids = np.arange(500, dtype=np.uint64)
    a, b = SlotStore(4), SlotStore(4)
    a.upsert(ids, np.full(500, 0.5, np.float32))
    b.upsert(ids[::-1], np.full(500, 0.5, np.float32))
    a.delete(ids[::7])
    b.delete(ids[::7])

    for slot in range(4):
        # Act
        x, y = a.export_slot(slot), b.export_slot(slot)

        # Assert
        np.testing.assert_array_equal(x.ids, y.ids)
        keys = sort_key(x.ids, 4)
        assert bool((keys[1:] > keys[:-1]).all())


def test_load_fills_an_empty_store_and_refuses_repeats() -> None:
    # Arrange
    src = SlotStore(16)
    src.upsert(np.arange(300, dtype=np.uint64), np.linspace(0, 1, 300), [b"p"] * 300)
    src.bump_seq([2, 5])
    ids, strengths = src.rows()
    dst = SlotStore(16)

    # Act
    dst.load(ids[::-1], strengths[::-1], dict(src.payloads), src.seq)

    # Assert
    for a, b in zip(src.items(), dst.items(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert dst.payloads == src.payloads and dst.seq.tolist() == src.seq.tolist()
    with pytest.raises(MemoryInputError, match="already holds 300 memories"):
        dst.load(ids, strengths, {}, src.seq)
    with pytest.raises(MemoryInputError, match="ids: ids repeat"):
        SlotStore(16).load(np.array([3, 3], np.uint64), np.zeros(2, np.float32), {}, src.seq)
    with pytest.raises(MemoryInputError, match="seq: 4 entries for 16 slots"):
        SlotStore(16).load(ids, strengths, {}, np.zeros(4, np.uint64))


@pytest.mark.parametrize("slots", [4, 1 << 16])
def test_a_layout_repoints_cells_that_wrapped_past_the_end_of_the_table(slots: int) -> None:
    # Arrange: ids whose home is the table's last cell (of 1024), so their probes wrap to
    # the first cells, which belong to the first slot's stretch of the table.
    rng = np.random.default_rng(9)
    ids = rng.integers(0, 2**64 - 1, 400_000, np.uint64, endpoint=True)
    last_home = ids[(sort_key(ids, slots) >> np.uint64(64 - 10)) == 1023][:6]
    others = np.arange(100, dtype=np.uint64)
    store, ref = SlotStore(slots), ReferenceStore(slots)
    for target in (store, ref):
        target.upsert(last_home, np.full(len(last_home), 0.75, np.float32))
        target.upsert(others, np.full(100, 0.25, np.float32))
    assert len(last_home) == 6 and len(store._rows.table) == 1024

    # Act: every region moves (as when the buffers are full).
    store._rows._relayout(store._rows.length + 1)

    # Assert
    assert_store_equals(store, ref)
    assert store.delete(last_home[::2]) == 3
    assert ref.delete(last_home[::2]) == 3
    assert_store_equals(store, ref)


def _longest_cluster(table: np.ndarray) -> int:
    """The longest run of occupied cells of a linear-probing table (cyclic)."""
    used = np.concatenate([table, table]) != row_index.EMPTY  # a run may wrap around
    edges = np.flatnonzero(np.diff(np.concatenate([[0], used.astype(np.int8), [0]])))
    return int((edges[1::2] - edges[::2]).max(initial=0))


def test_a_copy_of_few_slots_into_an_empty_store_spreads_over_the_table() -> None:
    # Arrange: 64k memories of 4 slots out of 1024, as one slot copy brings them to a worker
    # that holds nothing yet (the table is sized for these memories alone).
    slots = 1024
    rng = np.random.default_rng(7)
    pool = rng.integers(0, 2**63, 2_000_000, np.uint64)
    chosen = [3, 4, 500, 1023]
    snaps = []
    for s in chosen:
        ids = np.unique(pool[slot_of(pool, slots) == s])[:16_000]
        snaps.append(
            SlotSnapshot(
                s, 1, ids[np.argsort(sort_key(ids, slots))], np.full(len(ids), 0.5, np.float32), {}
            )
        )
    store = SlotStore(slots)

    # Act
    store.import_slots(snaps)

    # Assert: probe clusters stay short (hashing the key's top bits, which are its slot, put
    # all 64k into one cluster and made the import take minutes), and every id is found.
    assert _longest_cluster(store._rows.table) < 500
    ids = np.concatenate([s.ids for s in snaps])
    found, strengths, _ = store.get(ids)
    assert found.all() and (strengths == 0.5).all()
