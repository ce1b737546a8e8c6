"""Tests for worker/store/store.py: SlotStore vs ReferenceStore, alone and split across workers.

The invariant (docs/architecture.md, "Invariants"): for any sequence of operations and any
number of workers, the union of the workers' ``{id: strength}`` equals the single-process
reference bit for bit,
and both copies of every slot are identical, also across joins, leaves and slot migration.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.memory.slots import assign_slots, slot_of
from shared.memory.stats import merge_quality, merge_topk
from shared.memory.validation import MemoryInputError
from shared.rpc.limits import BudgetExceeded
from tests.memory_reference import ReferenceStore
from worker.store.store import SlotStore

SLOTS = 16

# --- a simulated cluster: every op goes to every holder of each touched slot --------------


class Cluster:
    """Stores of named workers; each slot held by its rendezvous primary and replica."""

    def __init__(self, workers: int):
        self.names = [f"w{i}" for i in range(workers)]
        self.stores = {n: SlotStore(SLOTS) for n in self.names}
        self.holders = self._placement()

    def _placement(self) -> list[list[str]]:
        primary, replica = assign_slots(self.names, SLOTS)
        return [
            [self.names[p]] + ([self.names[r]] if r >= 0 else [])
            for p, r in zip(primary.tolist(), replica.tolist(), strict=True)
        ]

    def _batches(self, ids: np.ndarray):
        """Yield ``(store, item mask, slots touched)``: boolean masks keep batch order."""
        slots = slot_of(ids, SLOTS)
        for name, store in self.stores.items():
            held = np.array([name in h for h in self.holders])
            mask = held[slots]
            if mask.any():
                yield store, mask, np.unique(slots[mask])

    def upsert(self, ids, strengths, payloads):
        for store, mask, touched in self._batches(ids):
            part = (
                None if payloads is None else [p for p, m in zip(payloads, mask, strict=True) if m]
            )
            store.upsert(ids[mask], strengths[mask], part)
            store.bump_seq(touched)

    def reinforce(self, ids, boosts):
        for store, mask, touched in self._batches(ids):
            store.reinforce(ids[mask], boosts[mask])
            store.bump_seq(touched)

    def delete(self, ids):
        for store, mask, touched in self._batches(ids):
            store.delete(ids[mask])
            store.bump_seq(touched)

    def decay(self, rate, slots):
        chosen = range(SLOTS) if slots is None else slots
        for name, store in self.stores.items():
            mine = [s for s in chosen if name in self.holders[s]]
            store.decay(rate, mine)
            store.bump_seq(mine)

    def primaries(self):
        """Yield ``(store, slots it is primary of)``."""
        for name, store in self.stores.items():
            yield store, [s for s in range(SLOTS) if self.holders[s][0] == name]

    def rebalance(self, names: list[str]):
        """Change membership and migrate slots: copy to new holders, drop from old ones."""
        leaving = set(self.names) - set(names)
        for n in names:
            self.stores.setdefault(n, SlotStore(SLOTS))
        self.names = names
        new_holders = self._placement()
        for slot in range(SLOTS):
            survivors = [h for h in self.holders[slot] if h not in leaving]
            source = self.stores[survivors[0]]
            snapshot = source.export_slot(slot)
            for h in new_holders[slot]:
                if h not in self.holders[slot]:
                    self.stores[h].import_slot(snapshot)
            for h in survivors:
                if h not in new_holders[slot]:
                    self.stores[h].drop_slots([slot])
        for n in leaving:
            del self.stores[n]
        self.holders = new_holders


def assert_matches(cluster: Cluster, ref: ReferenceStore):
    """The union of the primaries equals the reference; replicas equal their primaries."""
    ids, strengths, payloads = [], [], {}
    for store, mine in cluster.primaries():
        for slot in mine:
            snap = store.export_slot(slot)
            ids.append(snap.ids)
            strengths.append(snap.strengths)
            payloads.update(snap.payloads)
            for h in cluster.holders[slot][1:]:
                copy = cluster.stores[h].export_slot(slot)
                assert copy.seq == snap.seq
                assert np.array_equal(copy.ids, snap.ids)
                assert np.array_equal(
                    copy.strengths.view(np.uint32), snap.strengths.view(np.uint32)
                )
                assert copy.payloads == snap.payloads
    ids, strengths = np.concatenate(ids), np.concatenate(strengths)
    order = np.argsort(ids)
    ref_ids, ref_s = ref.items()
    assert np.array_equal(ids[order], ref_ids)
    assert np.array_equal(strengths[order].view(np.uint32), ref_s.view(np.uint32))
    assert payloads == ref.payloads()
    for name, store in cluster.stores.items():  # nothing held outside the store's slots
        mine = {s for s in range(SLOTS) if name in cluster.holders[s]}
        assert set(store.held_slots().tolist()) <= mine


# --- hypothesis operations ----------------------------------------------------------------

IDS = st.integers(0, 40) | st.sampled_from([2**63, 2**64 - 1, 12345678901234567])
STRENGTH = st.sampled_from([0.0, 1.0, 0.5]) | st.floats(0, 1, width=32)
BOOST = st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0, 1.5, width=32)
PAYLOAD = st.none() | st.binary(max_size=8)
SLOT_SET = st.none() | st.lists(st.integers(0, SLOTS - 1), max_size=6)

DATA_OPS = st.one_of(
    st.tuples(
        st.just("upsert"),
        st.lists(st.tuples(IDS, STRENGTH, PAYLOAD), min_size=1, max_size=25),
        st.booleans(),
    ),
    st.tuples(st.just("reinforce"), st.lists(st.tuples(IDS, BOOST), max_size=25)),
    st.tuples(st.just("delete"), st.lists(IDS, max_size=8)),
    st.tuples(st.just("decay"), st.floats(0, 1, width=32) | st.just(1.0), SLOT_SET),
)
MEMBERSHIP_OPS = st.tuples(st.just("join")) | st.tuples(st.just("leave"), st.integers(0, 10))
OPS = DATA_OPS | MEMBERSHIP_OPS


def data_args(op) -> tuple:
    """Turn a generated data op into the positional arguments of the store method it names."""
    kind, rest = op[0], op[1:]
    if kind == "upsert":
        items, with_payloads = rest
        return (
            np.array([t[0] for t in items], np.uint64),
            np.array([t[1] for t in items], np.float32),
            [t[2] for t in items] if with_payloads else None,
        )
    if kind == "reinforce":
        return np.array([t[0] for t in rest[0]], np.uint64), np.array(
            [t[1] for t in rest[0]], np.float32
        )
    if kind == "delete":
        return (np.array(rest[0], np.uint64),)
    return rest  # decay: (rate, slots)


def apply(op, cluster: Cluster, ref: ReferenceStore, joined: list[int]):
    kind = op[0]
    if kind == "join":
        joined[0] += 1
        cluster.rebalance([*cluster.names, f"new{joined[0]}"])
    elif kind == "leave":
        if len(cluster.names) > 1:
            names = list(cluster.names)
            names.pop(op[1] % len(names))
            cluster.rebalance(names)
    else:
        args = data_args(op)
        getattr(cluster, kind)(*args)
        getattr(ref, kind)(*args)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([1, 2, 3, 5]), st.lists(OPS, max_size=12), st.integers(1, 12))
def test_cluster_equals_reference(workers, ops, k):
    cluster, ref, joined = Cluster(workers), ReferenceStore(SLOTS), [0]
    for op in ops:
        apply(op, cluster, ref, joined)
        assert_matches(cluster, ref)
    quality = merge_quality([s.quality(mine) for s, mine in cluster.primaries()])
    want = ref.quality()
    assert (quality.count, quality.min, quality.max, quality.histogram) == (
        want.count,
        want.min,
        want.max,
        want.histogram,
    )
    assert quality.sum == pytest.approx(want.sum, rel=1e-12, abs=1e-12)
    got_ids, got_s = merge_topk([s.topk(k, mine) for s, mine in cluster.primaries()], k)
    want_ids, want_s = ref.topk(k)
    assert np.array_equal(got_ids, want_ids) and np.array_equal(got_s, want_s)


@settings(max_examples=40, deadline=None)
@given(st.lists(DATA_OPS, max_size=12))
def test_single_store_equals_reference_including_get(ops):
    store, ref = SlotStore(SLOTS), ReferenceStore(SLOTS)
    for op in ops:
        kind, args = op[0], data_args(op)
        assert getattr(store, kind)(*args) == getattr(ref, kind)(*args)
    probe = np.arange(45, dtype=np.uint64)
    found, strengths, payloads = store.get(probe)
    want_found, want_s, want_p = ref.get(probe)
    assert np.array_equal(found, want_found) and np.array_equal(strengths, want_s)
    assert payloads == want_p
    assert store.count() == ref.count() == len(store)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(DATA_OPS, max_size=12),
    st.lists(st.integers(0, 44), max_size=30),
    st.booleans(),
)
def test_get_reply_answers_each_distinct_id_as_get_and_the_reference_do(ops, asked, payloads):
    # Arrange: get_reply is get over the distinct ids (one implementation, review finding);
    # both are checked against the reference, the distinct order computed here.
    store, ref = SlotStore(SLOTS), ReferenceStore(SLOTS)
    for op in ops:
        getattr(store, op[0])(*data_args(op))
        getattr(ref, op[0])(*data_args(op))
    ids = np.array(asked, np.uint64)
    distinct = np.array(list(dict.fromkeys(asked)), np.uint64)

    # Act
    reply = store.get_reply(ids, payloads, None)

    # Assert
    want_found, want_s, want_p = ref.get(distinct)
    found, strengths, got_p = store.get(distinct, payloads)
    assert np.frombuffer(reply.found, np.uint8).astype(bool).tolist() == want_found.tolist()
    assert np.frombuffer(reply.strengths, "<f4").tobytes() == want_s.tobytes()
    assert found.tolist() == want_found.tolist() and strengths.tobytes() == want_s.tobytes()
    if payloads:
        assert list(reply.payloads) == [p or b"" for p in want_p] and got_p == want_p
    else:
        assert list(reply.payloads) == [] and got_p == [None] * len(distinct)


def test_get_reply_over_its_budget_is_refused_before_it_is_built():
    s = SlotStore(SLOTS)
    s.upsert([1, 2], [0.5, 0.5], [b"x" * 100, b""])

    small = s.get_reply(np.array([1, 2, 1], np.uint64), False, 64)
    with pytest.raises(BudgetExceeded, match=r"^Get reply of 2 distinct ids would be 146 bytes"):
        s.get_reply(np.array([1, 2, 1], np.uint64), True, 145)
    full = s.get_reply(np.array([1, 2], np.uint64), True, 146)

    assert np.frombuffer(small.found, np.uint8).tolist() == [1, 1] and small.payloads == []
    assert full.payloads == [b"x" * 100, b""] and full.ByteSize() <= 146


# --- validation: exact messages, and a refused batch changes nothing ---------------------


def _state(store: SlotStore):
    ids, strengths = store.items()
    return (
        ids.tolist(),
        strengths.view(np.uint32).tolist(),
        dict(store.payloads),
        store.seq.tolist(),
    )


@pytest.fixture
def store() -> SlotStore:
    s = SlotStore(SLOTS, max_payload_bytes=4096, k_max=10000)
    s.upsert(np.arange(10, dtype=np.uint64), np.linspace(0, 1, 10), [b"p"] * 10)
    s.bump_seq([1, 2])
    return s


BAD_CALLS = [
    ("upsert", ([1, 2, 3, 4], [0.1, 0.2, 0.3, 1.5]), "strengths[3]: 1.5 is outside [0, 1]"),
    ("upsert", ([1, 2], [0.1, -0.25]), "strengths[1]: -0.25 is outside [0, 1]"),
    ("upsert", ([1, 2], [np.nan, 2.0]), "strengths[0]: nan is not finite"),
    ("upsert", ([1, 2, 3], [0.1, 0.2]), "ids and strengths differ in length (3 != 2)"),
    (
        "upsert",
        ([1, 2], [0.1, 0.2], [b"", b"x" * 5000]),
        "payloads[1]: 5000 bytes exceeds max_payload_bytes 4096",
    ),
    ("upsert", ([1, 2], [0.1, 0.2], [b""]), "ids and payloads differ in length (2 != 1)"),
    ("upsert", ([1], [0.1], ["text"]), "payloads[0]: expected bytes, got str"),
    ("upsert", ([1, -2], [0.1, 0.2]), "ids[1]: -2 is negative; ids are uint64"),
    ("upsert", ([1.5], [0.1]), "ids: dtype float64 is not an integer type"),
    ("upsert", ([[1]], [0.1]), "ids: expected a 1-D array, got shape (1, 1)"),
    ("reinforce", (list(range(20)), [0.1] * 17 + [np.nan, 0, 0]), "boosts[17]: nan is not finite"),
    ("reinforce", ([1, 2, 3, 4, 5], [0.1] * 4), "ids and boosts differ in length (5 != 4)"),
    ("reinforce", ([1, 2], [0.5, -0.5]), "boosts[1]: -0.5 is negative"),
    ("reinforce", ([1], [1e300]), "boosts[0]: 1e+300 overflows float32"),
    ("reinforce", ([1], [np.inf]), "boosts[0]: inf is not finite"),
    ("decay", (1.5,), "rate: 1.5 is outside [0, 1]"),
    ("decay", (float("nan"),), "rate: nan is not finite"),
    ("decay", ("0.1",), "rate: '0.1' is not a number"),
    ("decay", (0.1, [3, 16]), "slots[1]: 16 is outside [0, 16)"),
    ("topk", (0,), "k: 0 must be >= 1"),
    ("topk", (20000,), "k: 20000 exceeds the limit 10000"),
    ("topk", (2.5,), "k: 2.5 is not an integer"),
    ("delete", ([-1],), "ids[0]: -1 is negative; ids are uint64"),
    ("get", (np.zeros((2, 2), np.uint64),), "ids: expected a 1-D array, got shape (2, 2)"),
    ("drop_slots", ([-1],), "slots[0]: -1 is outside [0, 16)"),
]


@pytest.mark.parametrize(("method", "args", "message"), BAD_CALLS)
def test_bad_input_is_refused_with_exact_message_and_changes_nothing(store, method, args, message):
    before = _state(store)
    with pytest.raises(MemoryInputError) as info:
        getattr(store, method)(*args)
    assert str(info.value) == message
    assert _state(store) == before


def test_bad_snapshot_is_refused_and_changes_nothing(store):
    snap = store.export_slot(int(store.held_slots()[0]))
    other = next(s for s in range(SLOTS) if s != snap.slot)
    before = _state(store)
    bad = [
        (dataclass_replace(snap, slot=other), "is not in slot"),
        (dataclass_replace(snap, strengths=snap.strengths * 0 + 2), "is outside [0, 1]"),
        (dataclass_replace(snap, payloads={999: b"x"}), "id 999 is not in snapshot.ids"),
        (dataclass_replace(snap, ids=np.repeat(snap.ids[:1], len(snap.ids))), "ids repeat"),
    ]
    for candidate, message in bad:
        if message == "ids repeat" and len(snap.ids) < 2:
            continue
        with pytest.raises(MemoryInputError, match=message.replace("[", r"\[")):
            store.import_slot(candidate)
    assert _state(store) == before


def dataclass_replace(snap, **changes):
    from dataclasses import replace

    return replace(snap, **changes)


# --- behaviour ------------------------------------------------------------------------------


def test_upsert_last_wins_and_payload_rules():
    s = SlotStore(SLOTS)
    assert s.upsert([5, 6, 5], [0.1, 0.2, 0.3], [b"a", b"b", b"c"]) == 2
    assert s.upsert([6], [0.4]) == 1  # payloads None: payload kept
    found, strengths, payloads = s.get([5, 6, 7])
    assert found.tolist() == [True, True, False]
    assert strengths.tolist() == [np.float32(0.3), np.float32(0.4), 0.0]
    assert payloads == [b"c", b"b", None]
    s.upsert([5, 6], [0.3, 0.4], [b"", None])  # b"" removes, None leaves alone
    assert s.get([5, 6])[2] == [None, b"b"]
    assert s.upsert([7], [-0.0]) == 1 and s.get([7])[1].view(np.uint32).tolist() == [0]
    assert s.upsert([8, 9, 8, 8, 9], [0.1, 0.2, 0.3, 0.4, 0.5]) == 2  # duplicates, unsorted
    assert s.get([8, 9])[1].tolist() == [np.float32(0.4), np.float32(0.5)]
    empty = np.empty(0, np.uint64)
    assert s.upsert(empty, []) == 0 and s.reinforce(empty, []) == 0 and len(s) == 5


def test_priority_update_keeps_payloads_skips_absent_ids_and_equals_reference():
    s, ref = SlotStore(SLOTS), ReferenceStore(SLOTS)
    for store in (s, ref):
        store.upsert([1, 2, 3], [0.5, 0.5, 0.5], [b"x", None, b"z"])
    ids, strengths = [2, 9, 2, 3, 9], [0.1, 0.2, 0.7, 0.0, 1.0]  # 9 absent, 2 twice
    assert s.upsert(ids, strengths, None, existing_only=True) == 2
    assert ref.update_strengths(ids, strengths) == 2
    assert len(s) == 3 and s.get([9])[0].tolist() == [False]  # absent: not inserted
    assert s.get([1, 2, 3])[1].tolist() == [np.float32(0.5), np.float32(0.7), 0.0]
    assert s.payloads == ref.payloads() == {1: b"x", 3: b"z"}
    assert s.items()[1].tobytes() == ref.items()[1].tobytes()
    with pytest.raises(MemoryInputError, match="payloads: a priority update keeps payloads"):
        s.upsert([1], [0.2], [b"new"], True)
    with pytest.raises(MemoryInputError, match=r"strengths\[1\]: 1.5 is outside \[0, 1\]"):
        s.upsert([1, 2], [0.2, 1.5], None, True)
    assert s.get([1])[1].tolist() == [np.float32(0.5)]  # nothing applied


def test_delete_reinforce_counts():
    s = SlotStore(SLOTS)
    s.upsert([1, 2, 3], [0.5, 0.5, 0.5], [b"x", b"y", b"z"])
    assert s.reinforce([1, 1, 9], [0.2, 0.2, 1.0]) == 2
    assert s.get([1])[1].tolist() == [np.float32(0.5) + np.float32(0.4)]
    assert s.delete([1, 1, 9]) == 1
    assert s.payloads == {2: b"y", 3: b"z"} and len(s) == 2


def test_slot_operations_and_export_import_roundtrip():
    rng = np.random.default_rng(1)
    ids = rng.choice(2**40, size=2000, replace=False).astype(np.uint64)
    a, b = SlotStore(SLOTS), SlotStore(SLOTS)
    a.upsert(ids, rng.random(2000, dtype=np.float32), [b"%d" % i for i in range(2000)])
    counts = np.bincount(slot_of(ids, SLOTS), minlength=SLOTS)
    assert np.array_equal(a.slot_counts(), counts)
    assert a.held_slots().tolist() == np.flatnonzero(counts).tolist()
    assert a.count([0, 1, 3]) == counts[[0, 1, 3]].sum()
    assert a.bump_seq([3, 3, 4]).tolist() == [1, 1, 1]
    for slot in (3, 4):
        b.import_slot(a.export_slot(slot))
    assert b.seq[[3, 4]].tolist() == [1, 1] and b.count() == counts[[3, 4]].sum()
    for slot in (3, 4):
        x, y = a.export_slot(slot), b.export_slot(slot)
        assert np.array_equal(x.ids, y.ids) and np.array_equal(x.strengths, y.strengths)
        assert x.payloads == y.payloads and x.seq == y.seq
    assert a.drop_slots([3, 4]) == counts[[3, 4]].sum()
    assert a.seq[[3, 4]].tolist() == [0, 0] and a.count([3, 4]) == 0
    assert not set(a.payloads) & set(b.payloads)
    b.import_slot(a.export_slot(3))  # importing an empty slot clears it
    assert b.count([3]) == 0 and b.count([4]) == counts[4]


def test_decay_of_a_slot_set_touches_only_those_slots():
    s, ref = SlotStore(SLOTS), ReferenceStore(SLOTS)
    ids = np.arange(500, dtype=np.uint64)
    for target in (s, ref):
        target.upsert(ids, np.full(500, 0.5, np.float32))
    assert s.decay(0.2, [0, 1, 2, 7, 9]) == ref.decay(0.2, [0, 1, 2, 7, 9])
    assert np.array_equal(s.items()[1], ref.items()[1])
    touched = np.isin(slot_of(ids, SLOTS), [0, 1, 2, 7, 9])
    assert np.all(s.get(ids)[1][touched] == np.float32(0.3))
    assert np.all(s.get(ids)[1][~touched] == np.float32(0.5))


def test_large_store_split_across_workers_equals_reference():
    # Large enough for the fused numba decay on some runs and NumPy blocks on others.
    rng = np.random.default_rng(2)
    n, slots = 300_000, 1024
    ids = rng.choice(2**62, size=n, replace=False).astype(np.uint64)
    ref = ReferenceStore(slots)
    names = ["a", "b", "c"]
    primary, _ = assign_slots(names, slots)
    stores = [SlotStore(slots) for _ in names]
    owner = primary[slot_of(ids, slots)]
    strengths = rng.random(n, dtype=np.float32)
    hot = ids[(rng.zipf(1.3, size=100_000) - 1) % n]
    boosts = rng.random(100_000, dtype=np.float32) * 0.1
    hot_owner = primary[slot_of(hot, slots)]
    ref.upsert(ids, strengths)
    ref.reinforce(hot, boosts)
    ref.decay(0.05)
    ref.decay(0.1, list(range(0, slots, 2)))
    for w, store in enumerate(stores):
        store.upsert(ids[owner == w], strengths[owner == w])
        store.reinforce(hot[hot_owner == w], boosts[hot_owner == w])
        store.decay(0.05, np.flatnonzero(primary == w))
        store.decay(0.1, [s for s in range(0, slots, 2) if primary[s] == w])
    got_ids = np.concatenate([s.items()[0] for s in stores])
    got_s = np.concatenate([s.items()[1] for s in stores])
    order = np.argsort(got_ids)
    want_ids, want_s = ref.items()
    assert np.array_equal(got_ids[order], want_ids)
    assert np.array_equal(got_s[order].view(np.uint32), want_s.view(np.uint32))


def test_100k_lookups_among_1m_rows():
    # Not a timing assert: a quadratic lookup would make this test take minutes.
    rng = np.random.default_rng(3)
    ids = rng.permutation(np.unique(rng.integers(0, 2**64 - 1, 1_050_000, np.uint64)))[:1_000_000]
    s = SlotStore(1024)
    s.upsert(ids, rng.random(1_000_000, dtype=np.float32))
    probe = np.concatenate([ids[rng.integers(0, 1_000_000, 90_000)], ids[:10_000] + 1])
    found, strengths, _ = s.get(probe)
    assert found[:90_000].all()
    assert s.reinforce(probe, np.full(len(probe), 0.01, np.float32)) >= 90_000


def test_import_slots_equals_one_import_per_slot() -> None:
    # Arrange: a source store with data in several slots, two empty targets.
    from worker.store.store import SlotStore

    rng = np.random.default_rng(4)
    src = SlotStore(slots=16)
    ids = rng.choice(1 << 40, size=3000, replace=False).astype(np.uint64)
    src.upsert(ids, rng.random(3000, dtype=np.float32), [b"p"] * 3000)
    src.bump_seq([1, 2, 3])
    one, bulk = SlotStore(slots=16), SlotStore(slots=16)
    old = np.arange(10, dtype=np.uint64)
    for target in (one, bulk):
        target.upsert(old, np.full(10, 0.25, np.float32))  # replaced where slots overlap
    snaps = [src.export_slot(s) for s in (3, 1, 2, 9)]

    # Act
    for snap in snaps:
        one.import_slot(snap)
    bulk.import_slots(snaps)

    # Assert: same rows, strengths, payloads and seqs either way.
    for a, b in zip(one.items(), bulk.items(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert one.payloads == bulk.payloads
    np.testing.assert_array_equal(one.seq, bulk.seq)
