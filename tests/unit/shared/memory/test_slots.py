"""Tests for shared/memory/slots.py: mixer, slot keys, rendezvous placement, stable grouping."""

from __future__ import annotations

import hashlib
import struct
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.memory.slots import (
    assign_slots,
    group_by_slot,
    hash64,
    mix64,
    slot_bounds,
    slot_key_range,
    slot_of,
    sort_key,
)

M64 = (1 << 64) - 1
U64 = st.integers(min_value=0, max_value=M64)


def mix64_python(z: int) -> int:
    """splitmix64's finalizer on Python ints, the textbook form (Steele et al. 2014)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


# Golden vectors: computed once (2026-11, splitmix64 finalizer, slot = low bits) and written as
# literals. Every stored slot, snapshot order and placement depends on these values: if one
# changes, an upgraded worker would look for every memory in another slot than its data dir
# and its peers hold. Change them only with a migration.
# (id, mix64(id), slot_of(id, 1024), slot_of(id, 64))
GOLDEN_IDS = [
    (0x0, 0x0000000000000000, 0, 0),
    (0x1, 0x5692161D100B05E5, 485, 37),
    (0x2, 0xDBD238973A2B148A, 138, 10),
    (0x3, 0x1E535EEDE31428F0, 240, 48),
    (0x2A, 0xA759EA27D4727622, 546, 34),
    (0xF4243, 0xC1FD756F0B09CDF3, 499, 51),
    (0x100000000, 0xD820B7E910B0F93F, 319, 63),
    (0x7FFFFFFFFFFFFFFF, 0x5A682AFE7965DEBD, 701, 61),
    (0x8000000000000000, 0x25C26EA579CEA98A, 394, 10),
    (0xFFFFFFFFFFFFFFFF, 0xB4D055FCF2CBBD7B, 379, 59),
    (0x9E3779B97F4A7C15, 0xE220A8397B1DCDAF, 431, 47),
    (0xDEADBEEFCAFEBABE, 0x7AD6664F09FFE52C, 300, 44),
    (0xAB54A98CEB1F0AD2, 0xCB2060A1236747B7, 951, 55),
]
# Worker name -> hash64(name): blake2b with an 8-byte digest, read little-endian.
GOLDEN_NAMES = {
    "worker-0": 0x1294AEAB29544F19,
    "worker-1": 0xBB542C8848D11458,
    "worker-2": 0xA1F74F4DA0A444BB,
    "": 0xB4B2797457A0A6E4,
    "coordinator": 0x1CCF110085B869C9,
    "wörker-ß": 0xCE015A94D2449A63,
}
# assign_slots(["worker-0", "worker-1", "worker-2"], 16): indexes of primary and replica.
GOLDEN_PRIMARY_3W_16S = [1, 2, 2, 0, 1, 2, 1, 2, 1, 2, 2, 1, 1, 1, 0, 2]
GOLDEN_REPLICA_3W_16S = [0, 1, 1, 2, 2, 1, 0, 1, 0, 1, 0, 0, 0, 2, 1, 1]


@pytest.mark.parametrize(("id_", "mixed", "slot_1024", "slot_64"), GOLDEN_IDS)
def test_slot_of_golden_vectors(id_, mixed, slot_1024, slot_64):
    ids = np.array([id_], dtype=np.uint64)

    got = (int(mix64(ids)[0]), int(slot_of(ids, 1024)[0]), int(slot_of(ids, 64)[0]))

    assert got == (mixed, slot_1024, slot_64)
    # The literals agree with the textbook finalizer, independently of shared/memory/slots.py.
    assert (mix64_python(id_), mixed & 1023, mixed & 63) == (mixed, slot_1024, slot_64)


def test_slot_of_golden_vectors_as_one_batch():
    # Arrange: the whole table in one array (the vectorized path the store uses).
    ids = np.array([row[0] for row in GOLDEN_IDS], dtype=np.uint64)

    # Act / Assert
    assert slot_of(ids, 1024).tolist() == [row[2] for row in GOLDEN_IDS]
    assert slot_of(ids, 64).tolist() == [row[3] for row in GOLDEN_IDS]
    assert slot_of(ids, 1024).dtype == np.int64


@pytest.mark.parametrize(("name", "hashed"), GOLDEN_NAMES.items())
def test_hash64_golden_vectors(name, hashed):
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()

    assert hash64(name) == hashed
    assert struct.unpack("<Q", digest)[0] == hashed  # the literal is blake2b, little-endian


def test_assign_slots_golden_placement():
    names = ["worker-0", "worker-1", "worker-2"]

    primary, replica = assign_slots(names, 16)

    assert primary.tolist() == GOLDEN_PRIMARY_3W_16S
    assert replica.tolist() == GOLDEN_REPLICA_3W_16S
    # The same placement from the definition, in pure Python: weight(w, s) =
    # mix64(hash64(w) ^ mix64(s)); the primary weighs most, the replica second.
    for s in range(16):
        weights = [mix64_python(GOLDEN_NAMES[n] ^ mix64_python(s)) for n in names]
        ranked = sorted(range(len(names)), key=weights.__getitem__, reverse=True)
        assert ranked[:2] == [GOLDEN_PRIMARY_3W_16S[s], GOLDEN_REPLICA_3W_16S[s]], s


def test_mix64_known_values():
    # splitmix64 seeded with 0 first outputs mix64(golden gamma) = 0xe220a8397b1dcdaf.
    x = np.array([0, 0x9E3779B97F4A7C15], dtype=np.uint64)
    assert mix64(x).tolist() == [0, 0xE220A8397B1DCDAF]


@given(st.lists(U64, min_size=1, max_size=50))
def test_mix64_matches_python_without_warnings(values):
    x = np.array(values, dtype=np.uint64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = mix64(x)
    assert out.dtype == np.uint64
    assert out.tolist() == [mix64_python(v) for v in values]
    assert x.tolist() == values  # input untouched


def test_mix64_is_a_bijection_on_a_sample():
    x = np.arange(200_000, dtype=np.uint64) * np.uint64(0x10001)
    assert len(np.unique(mix64(x))) == len(x)


@pytest.mark.parametrize("slots", [1, 2, 16, 1024, 65536])
def test_sort_key_orders_by_slot(slots):
    rng = np.random.default_rng(slots)
    ids = rng.integers(0, M64, size=5000, dtype=np.uint64, endpoint=True)
    keys = sort_key(ids, slots)
    order = np.argsort(keys)
    assert np.all(np.diff(slot_of(ids[order], slots)) >= 0)
    assert len(np.unique(keys)) == len(np.unique(ids))
    bounds = slot_bounds(keys[order], slots)
    assert bounds.shape == (slots + 1,) and bounds[0] == 0 and bounds[-1] == len(ids)
    assert np.array_equal(np.diff(bounds), np.bincount(slot_of(ids, slots), minlength=slots))


def test_slot_key_range_contains_the_slot_keys():
    ids = np.arange(10_000, dtype=np.uint64)
    keys, slots = sort_key(ids, 64), slot_of(ids, 64)
    for s in (0, 17, 63):
        lo, hi = slot_key_range(s, 64)
        inside = (keys >= np.uint64(lo)) & (keys <= np.uint64(hi))
        assert np.array_equal(inside, slots == s)
    assert slot_key_range(0, 1) == (0, M64)


def test_slots_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="slots: 12 is not a power of two"):
        slot_of(np.arange(3, dtype=np.uint64), 12)


def test_hash64_is_blake2b_little_endian():
    assert hash64("worker-0") == hash64("worker-0") != hash64("worker-1")
    assert 0 <= hash64("") <= M64


def test_assign_slots_edge_cases():
    primary, replica = assign_slots([], 8)
    assert primary.tolist() == [-1] * 8 and replica.tolist() == [-1] * 8
    primary, replica = assign_slots(["solo"], 8)
    assert primary.tolist() == [0] * 8 and replica.tolist() == [-1] * 8
    assert primary.dtype == replica.dtype == np.int32
    with pytest.raises(ValueError, match="distinct"):
        assign_slots(["a", "a"], 8)


def test_assign_slots_balanced_distinct_and_order_free():
    names = [f"worker-{i}" for i in range(5)]
    primary, replica = assign_slots(names, 1024)
    assert np.all(primary != replica) and np.all(replica >= 0)
    counts = np.bincount(primary, minlength=5)
    assert counts.min() > 0.75 * 1024 / 5 and counts.max() < 1.25 * 1024 / 5
    shuffled = names[::-1]
    p2, r2 = assign_slots(shuffled, 1024)
    assert [shuffled[i] for i in p2] == [names[i] for i in primary]
    assert [shuffled[i] for i in r2] == [names[i] for i in replica]


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_adding_a_worker_moves_only_slots_it_wins(count):
    old = [f"w{i}" for i in range(count)]
    new = [*old, "joiner"]
    p_old, r_old = assign_slots(old, 1024)
    p_new, r_new = assign_slots(new, 1024)
    moved = p_new != p_old
    assert np.all(p_new[moved] == count)  # every primary move goes to the joiner
    assert 0.5 * 1024 / (count + 1) < moved.sum() < 1.5 * 1024 / (count + 1)
    # Holders only change where the joiner enters the top two.
    changed = (p_new != p_old) | (r_new != r_old)
    assert np.all((p_new[changed] == count) | (r_new[changed] == count))


def test_removing_a_worker_keeps_the_other_primaries():
    names = [f"w{i}" for i in range(4)]
    p_old, _ = assign_slots(names, 1024)
    p_new, _ = assign_slots(names[:3], 1024)
    kept = p_old != 3
    assert np.array_equal(p_new[kept], p_old[kept])


@given(st.lists(st.integers(0, 9), max_size=60))
def test_group_by_slot_is_stable(values):
    slot_ids = np.array(values, dtype=np.int64)
    order, present, bounds = group_by_slot(slot_ids)
    assert present.tolist() == sorted(set(values))
    assert bounds[0] == 0 and bounds[-1] == len(values)
    for g, s in enumerate(present):
        members = order[bounds[g] : bounds[g + 1]]
        assert members.tolist() == [i for i, v in enumerate(values) if v == s]


@given(st.lists(U64, min_size=1, max_size=50))
def test_slot_of_one_id_equals_the_batch_path(values):
    # Arrange: slot_of has a Python-integer path for one-id arrays (the single-key calls).
    ids = np.array(values, dtype=np.uint64)

    # Act
    one_by_one = [slot_of(ids[i : i + 1], 1024) for i in range(len(ids))]

    # Assert
    assert [int(s[0]) for s in one_by_one] == slot_of(ids, 1024).tolist()
    assert all(s.dtype == np.int64 and s.shape == (1,) for s in one_by_one)
