"""worker/store/durable_store.py: a write of a few ids runs inline (``run_small``) when the
store thread is idle, and the snapshot its record makes due runs on the store thread after it,
never on the caller's thread; which writes count as small (``small_write``)."""

from __future__ import annotations

import os
import threading

import numpy as np

from shared.memory.slots import slot_of
from shared.proto import worker_pb2
from worker.store.durable_store import INLINE_WRITE_IDS, DurableStore, small_write
from worker.store.journal import Journal, lock_data_dir, recover
from worker.store.store import SlotStore

S = 16


def _forward(ids: np.ndarray, seq: int) -> tuple[worker_pb2.ReplicateRequest, np.ndarray]:
    sub = worker_pb2.UpsertRequest(
        ids=ids.astype("<u8").tobytes(),
        strengths=np.full(len(ids), 0.25, np.float32).tobytes(),
        request_id=b"u%d" % seq,
    )
    touched = np.unique(slot_of(ids, S))
    req = worker_pb2.ReplicateRequest(
        primary="w", epoch=1, slots=touched.tolist(), seqs=[seq] * len(touched), upsert=sub
    )
    return req, touched


async def test_an_inline_write_leaves_its_snapshot_to_the_store_thread(tmp_path) -> None:
    # Arrange: every record makes a snapshot due (snapshot_log_bytes=1)
    journal = Journal(tmp_path, lock_data_dir(tmp_path), S, 0, "always", 1.0, 1)
    data = DurableStore(SlotStore(S, device="cpu"), journal)
    snapshots: list[str] = []
    take = journal.snapshot

    def recording(store, recent) -> None:
        snapshots.append(threading.current_thread().name)
        take(store, recent)

    journal.snapshot = recording  # type: ignore[method-assign]
    ids = np.array([7, 11], np.uint64)
    writer: list[str] = []

    def apply(req, slots) -> int:
        writer.append(threading.current_thread().name)
        return data.apply_forward(req, slots)

    # Act
    pos = await data.run_small(apply, *_forward(ids, 1))
    assert snapshots == []  # not on the caller's thread: queued behind the write
    await data.sync(pos)
    await data.run(lambda: None)  # every job queued before has run
    data.close()

    # Assert
    assert writer == [threading.current_thread().name]  # applied and logged inline
    assert snapshots == ["store"]
    lock = lock_data_dir(tmp_path)
    try:
        rec = recover(tmp_path, lambda slots: SlotStore(slots, device="cpu"))
    finally:
        os.close(lock)
    assert rec is not None
    found, strengths, _ = rec.store.get(ids)
    assert found.all() and np.allclose(strengths, 0.25)


def test_small_writes_are_keyed_ops_of_few_ids_without_payloads() -> None:
    few = np.arange(INLINE_WRITE_IDS, dtype="<u8").tobytes()
    many = np.arange(INLINE_WRITE_IDS + 1, dtype="<u8").tobytes()
    assert small_write("upsert", worker_pb2.UpsertRequest(ids=few))
    assert small_write("reinforce", worker_pb2.ReinforceRequest(ids=few))
    assert small_write("delete", worker_pb2.DeleteRequest(ids=few))
    assert not small_write("upsert", worker_pb2.UpsertRequest(ids=many))
    assert not small_write("upsert", worker_pb2.UpsertRequest(ids=few[:8], payloads=[b"x"]))
    assert not small_write("decay", worker_pb2.WorkerDecayRequest())
