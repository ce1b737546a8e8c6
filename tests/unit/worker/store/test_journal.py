"""worker/store/journal.py and journal_format.py: snapshot + log round trips equal the store bit for
bit (ids, strengths, payloads, seqs, request ids), a torn tail is dropped, fsync policies."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from shared import private_files
from shared.memory.slots import slot_of
from shared.proto import worker_pb2
from worker.store import journal as journal_mod
from worker.store.journal import Journal, JournalError, lock_data_dir, recover, segment_path
from worker.store.journal_format import apply_op
from worker.store.store import SlotStore

S = 16


def make_store(slots: int = S) -> SlotStore:
    return SlotStore(slots, device="cpu", max_payload_bytes=64)


class Recorder:
    """Applies ops to a store and logs them the way MemoryNode does (seqs bumped per op)."""

    def __init__(
        self,
        tmp: Path,
        policy: str = "always",
        snapshot_log_bytes: int = 1 << 30,
        interval_s: float = 1.0,
    ) -> None:
        self.dir = tmp
        self.store = make_store()
        self.requests: list[tuple[bytes, list[int]]] = []
        self.journal = Journal(
            tmp, lock_data_dir(tmp), S, 0, policy, interval_s, snapshot_log_bytes
        )

    def op(self, op: str, sub, slots: np.ndarray) -> int:
        touched = np.unique(slots)
        seqs = self.store.bump_seq(touched)
        rid = apply_op(self.store, op, sub, touched)
        if rid:
            self.requests.append((rid, touched.tolist()))
        req = worker_pb2.ReplicateRequest(
            primary="w", epoch=3, slots=touched.tolist(), seqs=seqs.tolist(), **{op: sub}
        )
        pos = self.journal.log_op(req)
        self.journal.maybe_snapshot(self.store, lambda: list(self.requests))
        return pos

    def upsert(self, ids, strengths, payloads=None, rid=b"u") -> int:
        sub = worker_pb2.UpsertRequest(
            ids=ids.astype("<u8").tobytes(),
            request_id=rid,
            strengths=strengths.astype("<f4").tobytes(),
            payloads=payloads or [],
        )
        return self.op("upsert", sub, slot_of(ids, S))

    def update(self, ids, strengths, rid=b"p") -> int:
        sub = worker_pb2.UpsertRequest(
            ids=ids.astype("<u8").tobytes(),
            request_id=rid,
            strengths=strengths.astype("<f4").tobytes(),
            existing_only=True,
        )
        return self.op("upsert", sub, slot_of(ids, S))

    def reinforce(self, ids, boosts, rid=b"r") -> int:
        sub = worker_pb2.ReinforceRequest(
            ids=ids.astype("<u8").tobytes(), request_id=rid, boosts=boosts.astype("<f4").tobytes()
        )
        return self.op("reinforce", sub, slot_of(ids, S))

    def delete(self, ids, rid=b"d") -> int:
        sub = worker_pb2.DeleteRequest(ids=ids.astype("<u8").tobytes(), request_id=rid)
        return self.op("delete", sub, slot_of(ids, S))

    def decay(self, rate: float, slots) -> int:
        return self.op("decay", worker_pb2.WorkerDecayRequest(rate=rate), np.asarray(slots))


def workload(r: Recorder, rng: np.random.Generator, rounds: int = 6) -> None:
    """Upserts with and without payloads, reinforces with duplicates, priority updates,
    deletes, decays, a slot imported from elsewhere and slots dropped."""
    ids = rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64)
    for i in range(rounds):
        part = ids[i * 400 : (i + 1) * 400]
        payloads = [bytes([i]) * (j % 5) for j in range(len(part))] if i % 2 else None
        r.upsert(part, rng.random(len(part), dtype=np.float32), payloads, rid=b"u%d" % i)
        r.reinforce(
            rng.choice(ids[: (i + 1) * 400], 700), rng.random(700, np.float32) * 0.1, rid=b"r%d" % i
        )
        # A priority update: ids stored and not (the next round's), payloads kept.
        updated = rng.choice(ids[: (i + 2) * 400], 300)
        r.update(updated, rng.random(300, np.float32), rid=b"p%d" % i)
        r.delete(part[:20], rid=b"d%d" % i)
        r.decay(0.01 * (i + 1), np.arange(0, S, 2 + i % 3))
    donor = make_store()
    donor.upsert(ids[2800:], np.full(200, 0.25, np.float32), [b"x"] * 200)
    snap = donor.export_slot(5)
    snap.seq, snap.requests = 77, [b"copied"]
    r.store.import_slot(snap)
    r.journal.log_import(snap)
    # The copy replaces the request ids slot 5 applied here with its own.
    r.requests = [(rid, [s for s in slots if s != 5]) for rid, slots in r.requests]
    r.requests = [(rid, slots) for rid, slots in r.requests if slots] + [(b"copied", [5])]
    r.store.drop_slots([3, 9])
    r.journal.log_drop(np.array([3, 9]))


def assert_same_store(a: SlotStore, b: SlotStore) -> None:
    # Row layouts may differ (a reloaded store is laid out afresh); the memories may not.
    (a_ids, a_s), (b_ids, b_s) = a.items(), b.items()
    np.testing.assert_array_equal(a_ids, b_ids)
    assert a_s.dtype == b_s.dtype == np.float32
    assert a_s.tobytes() == b_s.tobytes()  # bit for bit
    np.testing.assert_array_equal(a.slot_counts(), b.slot_counts())
    assert a.payloads == b.payloads
    np.testing.assert_array_equal(a.seq, b.seq)


def reload(tmp: Path):
    lock = lock_data_dir(tmp)
    try:
        return recover(tmp, make_store)
    finally:
        os.close(lock)


@pytest.mark.parametrize("snapshot_log_bytes", [1 << 30, 20_000], ids=["log-only", "snapshots"])
def test_snapshot_and_log_round_trip_equals_the_store(tmp_path, snapshot_log_bytes) -> None:
    r = Recorder(tmp_path, snapshot_log_bytes=snapshot_log_bytes)
    workload(r, np.random.default_rng(1))
    r.journal.close()

    rec = reload(tmp_path)

    assert rec is not None
    assert_same_store(rec.store, r.store)
    assert rec.requests == r.requests
    if snapshot_log_bytes < 1 << 30:
        # A snapshot is skipped while the previous one is being written, so how many were
        # taken depends on timing; at least one was.
        assert r.journal.snapshots >= 1 and (tmp_path / "snapshot.bin").exists()
        assert len(list(tmp_path.glob("log-*.wal"))) <= 2  # replaced segments are deleted
        assert rec.records < 5 * 6 + 2  # only what followed the last snapshot is replayed


def test_reopened_journal_continues_the_log(tmp_path) -> None:
    r = Recorder(tmp_path)
    rng = np.random.default_rng(2)
    workload(r, rng, rounds=2)
    r.journal.close()
    rec = reload(tmp_path)
    assert rec is not None
    j = Journal(tmp_path, lock_data_dir(tmp_path), S, rec.next_gen, "always", 1.0, 1 << 30)
    r.journal, r.store = j, rec.store
    r.upsert(np.arange(50, dtype=np.uint64), np.full(50, 0.5, np.float32), rid=b"later")
    j.close()

    again = reload(tmp_path)

    assert again is not None and again.records == rec.records + 1
    assert_same_store(again.store, r.store)


def test_torn_last_record_is_dropped_and_later_appends_survive(tmp_path) -> None:
    r = Recorder(tmp_path)
    ids = np.arange(100, dtype=np.uint64)
    r.upsert(ids, np.full(100, 0.5, np.float32), rid=b"a")
    expected = make_store()
    expected.upsert(ids, np.full(100, 0.5, np.float32))
    expected.bump_seq(np.unique(slot_of(ids, S)))
    r.reinforce(ids, np.full(100, 0.25, np.float32), rid=b"b")
    r.journal.abandon()
    seg = segment_path(tmp_path, 0)
    os.truncate(seg, seg.stat().st_size - 7)  # the crash tore the last record

    rec = reload(tmp_path)

    assert rec is not None and rec.records == 1
    assert_same_store(rec.store, expected)
    assert rec.requests == [(b"a", np.unique(slot_of(ids, S)).tolist())]
    # The segment was cut at the last good record, so a later segment is not orphaned by it.
    j = Journal(tmp_path, lock_data_dir(tmp_path), S, rec.next_gen, "never", 1.0, 1 << 30)
    r.journal, r.store = j, rec.store
    r.delete(ids[:10], rid=b"c")
    j.close()
    again = reload(tmp_path)
    assert again is not None and again.records == 2
    assert_same_store(again.store, r.store)


def test_corrupt_record_ends_the_replay(tmp_path) -> None:
    r = Recorder(tmp_path)
    ids = np.arange(10, dtype=np.uint64)
    first_end = r.upsert(ids, np.full(10, 0.5, np.float32))
    r.upsert(ids, np.full(10, 0.75, np.float32))
    r.journal.close()
    seg = segment_path(tmp_path, 0)
    data = bytearray(seg.read_bytes())
    data[first_end + 20] ^= 0xFF  # a flipped bit inside the second record
    seg.write_bytes(bytes(data))

    rec = reload(tmp_path)

    assert rec is not None and rec.records == 1
    assert set(rec.store.get(ids)[1].tolist()) == {0.5}


def test_empty_dir_recovers_nothing_and_is_locked_once(tmp_path) -> None:
    assert reload(tmp_path) is None
    fd = lock_data_dir(tmp_path)
    with pytest.raises(JournalError, match="is in use by another worker"):
        lock_data_dir(tmp_path)
    os.close(fd)


def test_corrupt_snapshot_is_refused(tmp_path) -> None:
    r = Recorder(tmp_path, snapshot_log_bytes=1)
    r.upsert(np.arange(10, dtype=np.uint64), np.full(10, 0.5, np.float32))
    r.journal.close()
    snap = tmp_path / "snapshot.bin"
    data = bytearray(snap.read_bytes())
    data[40] ^= 1
    snap.write_bytes(bytes(data))

    with pytest.raises(JournalError, match="snapshot.bin: CRC mismatch"):
        reload(tmp_path)


def test_a_snapshot_is_written_by_write_private(tmp_path, monkeypatch) -> None:
    # The daemons' one atomic whole-file write (shared/private_files.py), its pieces streamed;
    # a snapshot written another way again (its own tmp, fsync, rename) fails here. Appends
    # to the log (the hot path) are not whole-file writes and stay the journal's own.
    written: list[Path] = []

    def recording(path: Path, data) -> None:
        written.append(path)
        private_files.write_private(path, data)

    monkeypatch.setattr(journal_mod, "write_private", recording)
    r = Recorder(tmp_path, snapshot_log_bytes=1)

    r.upsert(np.arange(10, dtype=np.uint64), np.full(10, 0.5, np.float32))
    r.journal.close()

    assert written == [tmp_path / "snapshot.bin"]
    rec = reload(tmp_path)
    assert rec is not None and rec.records == 0  # all of it from the snapshot
    assert_same_store(rec.store, r.store)


def count_fsyncs(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(journal_mod.os, "fsync", fsync)
    return calls


def test_fsync_always_syncs_before_returning(tmp_path, monkeypatch) -> None:
    r = Recorder(tmp_path, policy="always")
    calls = count_fsyncs(monkeypatch)
    pos = r.upsert(np.arange(10, dtype=np.uint64), np.full(10, 0.5, np.float32))
    assert r.journal.synced < pos and calls == []

    asyncio.run(r.journal.sync(pos))

    assert r.journal.synced >= pos and len(calls) == 1
    asyncio.run(r.journal.sync(pos))  # already durable: no second fsync
    assert len(calls) == 1
    r.journal.close()


def test_fsync_never_does_not_sync(tmp_path, monkeypatch) -> None:
    r = Recorder(tmp_path, policy="never")
    calls = count_fsyncs(monkeypatch)
    pos = r.upsert(np.arange(10, dtype=np.uint64), np.full(10, 0.5, np.float32))

    asyncio.run(r.journal.sync(pos))
    r.journal.close()

    assert calls == []


def test_fsync_interval_syncs_in_the_background(tmp_path, monkeypatch) -> None:
    # Arrange: fsyncs record their thread and block until the test opens the gate, so what
    # sync() does and what the interval thread does are told apart without timing luck.
    gate, calls = threading.Event(), []
    real = os.fsync

    def gated_fsync(fd: int) -> None:
        calls.append(threading.current_thread().name)
        assert gate.wait(10), "the gate was never opened"
        real(fd)

    r = Recorder(tmp_path, policy="interval", interval_s=0.02)  # its segment header: fsynced
    monkeypatch.setattr(journal_mod.os, "fsync", gated_fsync)
    try:
        pos = r.upsert(np.arange(10, dtype=np.uint64), np.full(10, 0.5, np.float32))

        # Act 1: sync() must return without an fsync of its own (one would block on the gate).
        asyncio.run(asyncio.wait_for(r.journal.sync(pos), timeout=5))

        # Assert 1: nothing is durable yet; only the interval thread has asked for an fsync.
        assert r.journal.synced < pos
        assert set(calls) <= {"journal-interval"}

        # Act 2: let the fsyncs through.
        gate.set()

        # Assert 2: the interval thread makes the record durable within a deadline.
        deadline = time.monotonic() + 10
        while r.journal.synced < pos and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.journal.synced >= pos, f"synced {r.journal.synced} < {pos} after 10 s"
        assert calls and set(calls) == {"journal-interval"}
    finally:
        gate.set()
        r.journal.close()


def test_abandon_leaves_the_written_records_without_any_fsync(tmp_path, monkeypatch) -> None:
    # Arrange: records appended, none synced yet (policy always syncs only when asked).
    r = Recorder(tmp_path, policy="always")
    ids = np.arange(10, dtype=np.uint64)
    r.upsert(ids, np.full(10, 0.5, np.float32), rid=b"a")
    r.reinforce(ids, np.full(10, 0.25, np.float32), rid=b"b")
    calls = count_fsyncs(monkeypatch)

    # Act: crash (close would fsync here).
    r.journal.abandon()

    # Assert: no fsync on the way out, and what kill -9 leaves (the written bytes) replays.
    assert calls == []
    rec = reload(tmp_path)
    assert rec is not None and rec.records == 2
    assert_same_store(rec.store, r.store)


def test_segment_of_another_slot_count_is_refused(tmp_path) -> None:
    r = Recorder(tmp_path, snapshot_log_bytes=1)
    r.upsert(np.arange(10, dtype=np.uint64), np.full(10, 0.5, np.float32))
    r.journal.close()
    stray = Journal(tmp_path, lock_data_dir(tmp_path), 2 * S, 99, "never", 1.0, 1 << 30)
    stray.close()

    with pytest.raises(JournalError, match="32 slots, but the snapshot has 16"):
        reload(tmp_path)
