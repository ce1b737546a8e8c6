"""Tests for worker/store/sampling.py and the SlotStore sampling hooks, against ReferenceStore.

A sample is drawn as the coordinator draws it (``shared.memory.sampling.draw_slots`` over
the slot sums of every store, then ``sample_pick`` on each slot's store) and must equal the
independent reference's draws, probabilities and payloads, whatever the split of slots over
stores and whatever mutations came before (each must mark the slots it changed).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.memory.sampling import draw_slots
from shared.memory.slots import assign_slots
from tests.memory_reference import ReferenceStore
from worker.store.sampling import KEEP_VERSIONS, UNIFORM, SlotWeights, StaleVersion, sample_weights
from worker.store.store import SlotStore

SLOTS = 16


def sample(stores: dict[str, SlotStore], primary: dict[str, np.ndarray], n, alpha, seed):
    """Draw as the coordinator does: phase 1 on every store, the draw, phase 2 per slot."""
    totals = np.zeros(SLOTS, np.uint64)
    owner = np.empty(SLOTS, object)
    versions = {}
    mode = alpha
    for attempt in range(2):
        for name, store in stores.items():
            versions[name], t, _ = store.sample_sums(mode, primary[name])
            totals[primary[name]] = t
            owner[primary[name]] = name
        if int(totals.sum(dtype=np.uint64)) or attempt:
            break
        mode = UNIFORM  # every weight 0: uniform over every memory
    slots, offsets = draw_slots(totals, n, seed)
    ids = np.empty(n, np.uint64)
    strengths = np.empty(n, np.float32)
    weights = np.empty(n, np.uint64)
    payloads: list = [None] * n
    for name, store in stores.items():
        mine = np.flatnonzero(owner[slots] == name)
        got = store.sample_pick(versions[name], slots[mine], offsets[mine], True)
        ids[mine], strengths[mine], weights[mine] = got[0], got[1], got[2]
        assert got[4].all()
        for j, p in zip(mine.tolist(), got[3], strict=True):
            payloads[j] = p or None
    return ids, strengths, payloads, weights / float(totals.sum(dtype=np.uint64))


def assert_same_sample(got, want) -> None:
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1].tobytes() == want[1].tobytes()
    assert got[2] == want[2]
    np.testing.assert_array_equal(got[3], want[3])


def one_store() -> tuple[dict[str, SlotStore], dict[str, np.ndarray]]:
    return {"w0": SlotStore(SLOTS)}, {"w0": np.arange(SLOTS)}


OPS = st.one_of(
    st.tuples(
        st.just("upsert"),
        st.lists(st.tuples(st.integers(0, 40), st.floats(0, 1, width=32)), max_size=40),
    ),
    st.tuples(
        st.just("update"),
        st.lists(st.tuples(st.integers(0, 45), st.floats(0, 1, width=32)), max_size=40),
    ),
    st.tuples(
        st.just("reinforce"),
        st.lists(st.tuples(st.integers(0, 45), st.floats(0, 0.5, width=32)), max_size=40),
    ),
    st.tuples(st.just("delete"), st.lists(st.integers(0, 45), max_size=40)),
    st.tuples(st.just("decay"), st.floats(0, 0.25, width=32)),
    st.tuples(st.just("decay_slots"), st.floats(0, 0.25, width=32), st.integers(0, SLOTS - 1)),
    st.tuples(st.just("sample"), st.integers(1, 50), st.sampled_from([0.0, 0.6, 1.0, 2.5])),
)


def apply(stores, ref: ReferenceStore, op) -> None:
    kind = op[0]
    for store in stores.values():
        if kind == "upsert":
            ids, s = np.array([i for i, _ in op[1]], np.uint64), [x for _, x in op[1]]
            store.upsert(ids, np.array(s, np.float32), [bytes([int(i) % 7]) * 3 for i in ids])
        elif kind == "update":
            ids, s = np.array([i for i, _ in op[1]], np.uint64), [x for _, x in op[1]]
            store.upsert(ids, np.array(s, np.float32), None, existing_only=True)
        elif kind == "reinforce":
            ids, b = np.array([i for i, _ in op[1]], np.uint64), [x for _, x in op[1]]
            store.reinforce(ids, np.array(b, np.float32))
        elif kind == "delete":
            store.delete(np.array(op[1], np.uint64))
        elif kind == "decay":
            store.decay(op[1])
        elif kind == "decay_slots":
            store.decay(op[1], [op[2]])
    if kind == "upsert":
        ids = np.array([i for i, _ in op[1]], np.uint64)
        ref.upsert(
            ids, np.array([x for _, x in op[1]], np.float32), [bytes([int(i) % 7]) * 3 for i in ids]
        )
    elif kind == "update":
        ref.update_strengths(
            np.array([i for i, _ in op[1]], np.uint64), np.array([x for _, x in op[1]], np.float32)
        )
    elif kind == "reinforce":
        ref.reinforce(
            np.array([i for i, _ in op[1]], np.uint64), np.array([x for _, x in op[1]], np.float32)
        )
    elif kind == "delete":
        ref.delete(np.array(op[1], np.uint64))
    elif kind == "decay":
        ref.decay(op[1])
    elif kind == "decay_slots":
        ref.decay(op[1], [op[2]])


def split(workers: int) -> tuple[dict[str, SlotStore], dict[str, np.ndarray]]:
    """Stores of ``workers`` workers; every slot on its rendezvous primary and replica."""
    names = [f"w{i}" for i in range(workers)]
    p_idx, _ = assign_slots(names, SLOTS)
    return {n: SlotStore(SLOTS) for n in names}, {
        n: np.flatnonzero(p_idx == i) for i, n in enumerate(names)
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(OPS, max_size=12),
    workers=st.sampled_from([1, 2, 3, 5]),
    seed=st.integers(0, 2**32),
)
def test_samples_between_mutations_equal_the_reference(ops, workers, seed):
    stores, primary = split(workers)
    ref = ReferenceStore(SLOTS)
    alpha = 0.6
    for i, op in enumerate(ops):
        if op[0] == "sample":
            alpha = op[2]  # later samples use this alpha (a change rebuilds every slot)
        else:
            apply(stores, ref, op)
        if len(ref.ids):  # after every op: a missing hook leaves a stale slot behind
            n = op[1] if op[0] == "sample" else 32
            got = sample(stores, primary, n, alpha, seed + i)
            assert_same_sample(got, ref.sample(n, alpha, seed + i))


def test_zero_strengths_are_never_drawn_and_an_all_zero_store_is_uniform():
    stores, primary = one_store()
    ref = ReferenceStore(SLOTS)
    for store in (stores["w0"], ref):
        store.upsert(np.arange(10, dtype=np.uint64), np.r_[np.zeros(9), 0.5].astype(np.float32))
    ids, _, _, p = sample(stores, primary, 100, 0.0, 7)  # alpha 0: uniform over non-zero
    assert set(ids.tolist()) == {9} and (p == 1.0).all()
    for store in (stores["w0"], ref):
        store.decay(1.0)
    got = sample(stores, primary, 1000, 0.6, 7)
    assert_same_sample(got, ref.sample(1000, 0.6, 7))
    assert len(set(got[0].tolist())) == 10 and (got[3] == 0.1).all()


def test_weights_are_quantized_as_documented():
    s = np.array([0.0, 1e-12, 0.25, 0.5, 1.0], np.float32)
    np.testing.assert_array_equal(
        sample_weights(s, 1.0), np.array([0, 1, 2**30, 2**31, 2**32], np.uint64)
    )
    np.testing.assert_array_equal(sample_weights(s, 0.0), np.array([0] + [2**32] * 4, np.uint64))
    assert sample_weights(s, 0.5)[2] == 2**31
    np.testing.assert_array_equal(sample_weights(s, UNIFORM), np.ones(5, np.uint64))


def test_a_version_answers_as_it_was_until_it_is_dropped():
    store = SlotStore(SLOTS)
    store.upsert(np.arange(40, dtype=np.uint64), np.full(40, 0.5, np.float32))
    slots = np.arange(SLOTS)
    version, totals, count = store.sample_sums(1.0, slots)
    assert count == 40 and int(totals.sum()) == 40 * 2**31
    slot = int(np.flatnonzero(totals)[0])
    before = store.sample_pick(version, np.array([slot]), np.array([0], np.uint64), False)
    store.upsert(before[0], np.array([1.0], np.float32))  # a write between the two phases
    after = store.sample_pick(version, np.array([slot]), np.array([0], np.uint64), False)
    assert after[1].tolist() == [0.5] and after[4].tolist() == [True]  # as of the version
    store.delete(before[0])
    assert store.sample_pick(version, np.array([slot]), np.array([0], np.uint64), False)[
        4
    ].tolist() == [False]  # deleted since: the caller must not answer it
    for _ in range(KEEP_VERSIONS):
        store.decay(0.01)
        store.sample_sums(1.0, slots)
    with pytest.raises(StaleVersion, match=f"version {version} is no longer kept"):
        store.sample_pick(version, np.array([slot]), np.array([0], np.uint64), False)


def test_import_and_drop_mark_their_slots():
    a, b = SlotStore(SLOTS), SlotStore(SLOTS)
    a.upsert(np.arange(100, dtype=np.uint64), np.linspace(0, 1, 100, dtype=np.float32))
    slots = np.arange(SLOTS)
    b.sample_sums(1.0, slots)  # b's structure is built (empty)
    b.import_slots([a.export_slot(s) for s in range(SLOTS)])
    np.testing.assert_array_equal(b.sample_sums(1.0, slots)[1], a.sample_sums(1.0, slots)[1])
    b.drop_slots([3])
    assert b.sample_sums(1.0, slots)[1][3] == 0


def chi_square_bound(df: int, z: float = 4.75) -> float:
    """Wilson-Hilferty: the chi-square quantile of df degrees at normal quantile z
    (4.75: p ~ 1e-6)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_one_million_draws_follow_p_i(alpha):
    """Chi-square goodness of fit of 10**6 draws to P(i) = w_i / W over 500 memories."""
    rng = np.random.default_rng(1)
    store = SlotStore(SLOTS)
    ids = rng.choice(2**40, 500, replace=False).astype(np.uint64)
    strengths = rng.uniform(0.01, 1, 500).astype(np.float32)
    store.upsert(ids, strengths)
    slots = np.arange(SLOTS)
    version, totals, _ = store.sample_sums(alpha, slots)
    n = 10**6
    drawn_slots, offsets = draw_slots(totals, n, seed=2016)
    got = store.sample_pick(version, drawn_slots, offsets, False)[0]
    weights = sample_weights(strengths, alpha).astype(np.float64)
    expected = n * weights / weights.sum()
    observed = np.array([np.count_nonzero(got == i) for i in ids], np.float64)
    assert observed.sum() == n
    stat = float(((observed - expected) ** 2 / expected).sum())
    assert stat < chi_square_bound(len(ids) - 1), f"chi-square {stat:.1f} over 499 df"
    # each draw's weight is its memory's
    by_id = dict(zip(ids.tolist(), sample_weights(strengths, alpha).tolist(), strict=True))
    picked = store.sample_pick(version, drawn_slots[:100], offsets[:100], False)
    assert picked[2].tolist() == [by_id[i] for i in picked[0].tolist()]


def test_refresh_rebuilds_only_stale_slots():
    w = SlotWeights(4)
    reads: list[list[int]] = []

    def read(slots):
        reads.append(slots.tolist())
        n = len(slots)
        return slots.astype(np.int64), np.arange(n, dtype=np.uint64), np.full(n, 0.5, np.float32)

    w.refresh(1.0, np.arange(4), read)
    w.refresh(1.0, np.arange(4), read)
    w.mark(np.array([2, 2]))
    w.refresh(1.0, np.arange(4), read)
    w.refresh(0.5, np.arange(4), read)  # another alpha: every slot again
    w.mark(np.array([1]))
    w.refresh(1.0, np.arange(4), read)  # the first alpha's structure was kept
    w.refresh(None, np.arange(4), read)  # a third mode evicts the least recent (0.5)
    w.refresh(1.0, np.arange(4), read)
    w.refresh(0.5, np.arange(4), read)
    assert reads == [[0, 1, 2, 3], [2], [0, 1, 2, 3], [1], [0, 1, 2, 3], [0, 1, 2, 3]]
