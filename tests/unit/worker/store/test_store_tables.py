"""Tables in one worker's store: independent ids, whole-slot copies, adopt and drop, journal."""

from __future__ import annotations

import os

import numpy as np
import pytest

from shared.memory.slots import slot_of
from shared.proto import worker_pb2
from worker.store.durable_store import DurableStore
from worker.store.journal import Journal, lock_data_dir, recover
from worker.store.store import SlotStore
from worker.store.table_store import TableStore

S = 16


def make_store() -> SlotStore:
    return SlotStore(S, device="cpu", max_payload_bytes=64)


def table_items(store: SlotStore) -> dict[str, tuple[list[int], bytes, dict[int, bytes]]]:
    out = {}
    for name in sorted(store.tables()):
        ids, strengths = store.items(name)
        out[name] = (ids.tolist(), strengths.tobytes(), dict(store.table(name).payloads))
    return out


def test_the_same_id_is_two_memories_in_two_tables() -> None:
    store = make_store()
    ids = np.arange(10, dtype=np.uint64)
    store.upsert(ids, np.full(10, 0.5, np.float32), [b"a"] * 10)
    store.upsert(ids[:4], np.full(4, 0.25, np.float32), [b"b"] * 4, table="replay")

    store.decay(0.25, table="replay")
    store.delete(ids[:2], table="replay")

    assert store.count(table="default") == 10 and store.count(table="replay") == 2
    assert len(store) == 12 and int(store.slot_counts().sum()) == 12
    _, s, p = store.get(ids[:4])
    assert s.tolist() == [0.5] * 4 and p == [b"a"] * 4
    found, s, p = store.get(ids[:4], table="replay")
    assert found.tolist() == [False, False, True, True] and s[2:].tolist() == [0.0, 0.0]
    assert p[2:] == [b"b", b"b"]


def test_a_table_payload_limit_refuses_the_batch_naming_the_index() -> None:
    store = make_store()
    with pytest.raises(ValueError, match=r"payloads\[1\]"):
        store.upsert(
            np.arange(2, dtype=np.uint64),
            np.ones(2, np.float32),
            [b"ok", b"toolong"],
            table="t",
            max_payload_bytes=4,
        )
    assert len(store) == 0


def test_a_whole_slot_copy_carries_every_table_and_replaces_every_table() -> None:
    src, dst = make_store(), make_store()
    ids = np.arange(200, dtype=np.uint64)
    src.upsert(ids, np.linspace(0, 1, 200, dtype=np.float32), [b"x"] * 200)
    src.upsert(ids[::3], np.full(67, 0.125, np.float32), table="replay")
    dst.upsert(ids, np.zeros(200, np.float32), table="stale")  # held before the copy
    slot = int(slot_of(ids[:1], S)[0])
    src.bump_seq([slot])

    parts = src.export_slot_parts(slot)
    dst.import_slots(parts)

    assert [p.table for p in parts] == ["default", "replay"]
    for name in ("default", "replay"):
        want = src.export_slot(slot, name)
        got = dst.export_slot(slot, name)
        assert got.ids.tolist() == want.ids.tolist()
        assert got.strengths.tobytes() == want.strengths.tobytes()
        assert got.payloads == want.payloads
    assert dst.export_slot(slot, "stale").ids.size == 0, "the copy replaced every table"
    assert int(dst.seq[slot]) == 1


def test_adopt_keeps_an_unknown_incarnation_and_resets_another() -> None:
    store = make_store()
    ids = np.arange(5, dtype=np.uint64)
    store.upsert(ids, np.ones(5, np.float32), table="t")  # by a forward: id 0

    assert store.adopt_table("t", 7) is False and store.count(table="t") == 5
    assert store.adopt_table("t", 7) is False
    assert store.adopt_table("t", 8) is True and store.count(table="t") == 0
    assert store.drop_table("t") == 0 and "t" not in store.tables()
    assert store.drop_table("default") == 0 and "default" in store.tables()


def test_table_store_is_the_unit_a_sampling_structure_hooks() -> None:
    store = make_store()
    store.upsert(np.arange(3, dtype=np.uint64), np.ones(3, np.float32), table="t")
    assert isinstance(store.table("t"), TableStore) and store.table("t").count() == 3


@pytest.mark.parametrize("snapshot_log_bytes", [1 << 30, 2_000], ids=["log-only", "snapshots"])
def test_the_journal_brings_every_table_back(tmp_path, snapshot_log_bytes) -> None:
    journal = Journal(tmp_path, lock_data_dir(tmp_path), S, 0, "never", 1.0, snapshot_log_bytes)
    data = DurableStore(make_store(), journal)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 2**64 - 1, 400, dtype=np.uint64)
    for i, table in enumerate(["", "replay", "other", "replay"]):
        part = ids[i * 100 : (i + 1) * 100]
        sub = worker_pb2.UpsertRequest(
            ids=part.astype("<u8").tobytes(),
            strengths=rng.random(100, dtype=np.float32).tobytes(),
            payloads=[bytes([i]) * 3] * 100,
            request_id=b"u%d" % i,
            table=table,
        )
        touched = np.unique(slot_of(part, S))
        req = worker_pb2.ReplicateRequest(
            primary="w", epoch=1, slots=touched.tolist(), seqs=(touched * 0 + i + 1).tolist()
        )
        req.upsert.CopyFrom(sub)
        data.apply_forward(req, touched)
    data.adopt_table("replay", 4)
    data.adopt_table("other", 5)
    data.drop_table("other")
    donor = make_store()
    donor.upsert(ids[:50], np.full(50, 0.5, np.float32), table="replay")
    slot = int(slot_of(ids[:1], S)[0])
    data.import_slots(donor.export_slot_parts(slot)[1:])  # no default part: made empty
    data.store.decay(0.0)  # nothing
    want = table_items(data.store)
    want_ids = data.store.tables()
    data.close()

    lock = lock_data_dir(tmp_path)
    try:
        rec = recover(tmp_path, lambda slots: make_store())
    finally:
        os.close(lock)

    assert rec is not None
    assert table_items(rec.store) == want
    assert rec.store.tables() == want_ids == {"default": 0, "replay": 4}
    np.testing.assert_array_equal(rec.store.seq, data.store.seq)


def test_stamps_order_candidates_and_travel_with_copies() -> None:
    store, copy = make_store(), make_store()
    ids = np.arange(1, 41, dtype=np.uint64)
    store.upsert(ids, np.linspace(0.1, 0.9, 40, dtype=np.float32), table="c", stamps=ids + 100)
    store.upsert(ids[:5], np.zeros(5, np.float32), table="c", stamps=ids[:5] + 999)

    oldest, _, stamps, count = store.candidates(3, "oldest", table="c")
    weakest, strengths, _, _ = store.candidates(3, "weakest", table="c")
    for slot in range(S):
        copy.import_slots(store.export_slot_parts(slot))

    assert count == 40 and oldest.tolist() == [1, 2, 3], "an overwrite keeps its stamp"
    assert stamps.tolist() == [101, 102, 103]
    assert weakest.tolist() == [1, 2, 3] and strengths.tolist() == [0.0, 0.0, 0.0]
    assert copy.table("c").stamps == store.table("c").stamps
    with pytest.raises(ValueError, match="order"):
        store.candidates(3, "newest", table="c")


def test_a_decay_forgets_what_it_leaves_at_or_below_the_threshold() -> None:
    store = make_store()
    ids = np.arange(10, dtype=np.uint64)
    store.upsert(ids, np.linspace(0, 0.9, 10, dtype=np.float32), table="f")

    assert store.decay(0.0, table="f", forget_below=0.5) == 10  # rate 0 forgets nothing
    left = store.decay(0.25, table="f", forget_below=0.25)

    _, strengths = store.items("f")
    assert left == len(strengths) == 4 and bool((strengths > np.float32(0.25)).all())
